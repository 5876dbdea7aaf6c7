"""`tokenstream tools`: run one tool processor in this process (imports happen inside the command)."""

from __future__ import annotations


def tools() -> None:
    """Server tools (code interpreter, web fetch, file search): ts.tool.calls -> ts.tool.results."""
    import asyncio

    from tools.processor import ToolProcessor

    asyncio.run(ToolProcessor().run())
