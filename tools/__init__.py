"""The tool processor role: ToolCall in, ToolResult out, each call run once; the sandbox, web fetch and
file search."""
