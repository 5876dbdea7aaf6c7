"""The GPU worker role: continuous batching over a paged KV cache, consuming ts.inference.<model>, writing ts.tokens."""
