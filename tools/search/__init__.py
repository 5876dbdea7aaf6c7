"""File search: uploaded files -> text -> chunks -> MiniLM vectors -> Weaviate (one tenant per tokenstream
tenant)."""
