"""`tokenstream tools`: run one tool processor in this process (imports happen inside the command)."""

from __future__ import annotations

import typer

EXIT_INDEX_UNAVAILABLE = 70  # as a processor whose agent cannot go on: the supervisor restarts it


def tools(
    health_port: int = typer.Option(
        None,
        help="serve /health/live and /health/ready on this port "
        "(default: TOKENSTREAM_TOOLS_HEALTH_PORT, else none)",
    ),
) -> None:
    """Server tools (code interpreter, web fetch, file search): ts.tool.calls -> ts.tool.results,
    file ingestion: ts.files.ingest -> Weaviate (group ts-ingest), and speech jobs:
    ts.speech.jobs -> ts.tokens (group ts-speech)."""
    import asyncio
    import logging

    from common.health import HealthServer
    from tools import health
    from tools.config import tool_settings
    from tools.ingestion import Ingestor
    from tools.processor import ToolProcessor
    from tools.search.retry import IndexUnavailable
    from tools.speech.loop import SpeechLoop

    processor, ingestor, speech = ToolProcessor(), Ingestor(), SpeechLoop()
    port = health_port or tool_settings().health_port
    server = HealthServer(port, lambda: health.report(processor, ingestor)) if port else None

    async def main() -> None:
        ready = asyncio.Event()  # ingestion starts once the tools (the embedder) are warm
        await asyncio.gather(processor.run(ready), ingestor.run(after=ready), speech.run(after=ready))

    try:
        asyncio.run(main())
    except IndexUnavailable as exc:
        logging.getLogger("tools").critical(
            "%s: exiting with %d for the supervisor to restart this process (the held event is read again)",
            exc,
            EXIT_INDEX_UNAVAILABLE,
        )
        raise typer.Exit(EXIT_INDEX_UNAVAILABLE) from None
    finally:
        if server is not None:
            server.close()
