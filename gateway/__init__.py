"""The gateway role: the OpenAI-compatible HTTP edge, keys and limits, caches, and SSE fan-out from
ts.tokens."""
