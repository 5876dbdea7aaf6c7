"""`tokenstream tools`: run one tool processor in this process (imports happen inside the command)."""

from __future__ import annotations


def tools() -> None:
    """Server tools (code interpreter, web fetch, file search): ts.tool.calls -> ts.tool.results,
    and file ingestion: ts.files.ingest -> Weaviate (group ts-ingest)."""
    import asyncio

    from tools.ingestion import Ingestor
    from tools.processor import ToolProcessor

    async def main() -> None:
        ready = asyncio.Event()  # ingestion starts once the tools (the embedder) are warm
        await asyncio.gather(ToolProcessor().run(ready), Ingestor().run(after=ready))

    asyncio.run(main())
