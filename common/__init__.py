"""The leaf every role shares: configuration, tracing, model files, health, the vector store, embeddings,
presets.

It imports nothing of this project but `schemas`; the roles, `producers`, `topics` and the top
(`tokenstream`: the CLI and operator tools) import it.
"""
