"""Stateless stream processors on faust-streaming, one consumer group each.

    conversation  ts.chat.requests -> ts.requests.prepared   (history, presets, context window)
    safety        ts.requests.prepared -> ts.requests.screened (or a refusal on ts.tokens)
                  ts.tokens -> ts.safety.verdicts              (output windows; a block is sent in band)
    router        ts.requests.screened -> ts.inference.<model> (model, tier, load, canary weights)

State lives in faust tables backed by compacted changelog topics and in Redis; processing is
at-least-once with effects made idempotent by request id (`processors.effects`), so a
processor killed at any point and restarted re-reads its input without emitting twice.
"""
