"""Built-in server tools: one module each, each exposing TOOL (see tools/base.py)."""
