"""The GPU worker role: continuous batching over a dense KV slot pool (one slot per running request),
consuming ts.inference.<model>, writing ts.tokens."""
