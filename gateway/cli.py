"""`tokenstream gateway`: serve the OpenAI-compatible API and the chat page (imports stay light)."""

from __future__ import annotations

import typer


def gateway(
    host: str = typer.Option(None, help="bind address (default TOKENSTREAM_GATEWAY_HOST or 127.0.0.1)"),
    port: int = typer.Option(None, help="port (default TOKENSTREAM_GATEWAY_PORT or 8000)"),
    instance_index: int = typer.Option(
        None, help="this instance's index i: owns tokens partitions p % n == i"
    ),
    instance_count: int = typer.Option(None, help="number n of gateway instances"),
    model: list[str] = typer.Option(None, help="models served (default TOKENSTREAM_GATEWAY_MODELS)"),
) -> None:
    """The gateway: POST /v1/chat/completions (OpenAI-compatible, SSE), resumable streams, chat page at /."""
    import uvicorn

    from common.config import settings
    from gateway.app import create_app
    from gateway.config import GatewaySettings

    overrides = {
        k: v
        for k, v in dict(
            host=host,
            port=port,
            instance_index=instance_index,
            instance_count=instance_count,
            models=model or None,
        ).items()
        if v is not None
    }
    cfg = GatewaySettings(**overrides)
    from common import tracing

    tracing.setup("gateway")
    base = settings()
    app = create_app(cfg, base.kafka_bootstrap, base.redis_url, base.cache_redis_url)
    typer.echo(
        f"gateway {cfg.instance_id}: chat page http://{cfg.host}:{cfg.port}/ "
        f"(OpenAI base URL http://{cfg.host}:{cfg.port}/v1), models {cfg.models}"
    )
    import gc

    # Everything imported so far lives as long as the process: out of the collector's sight, and the
    # young generation collected less often, so a collection does not walk thousands of live streams.
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    uvicorn.run(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=3,
        backlog=BACKLOG,
    )


# Connections accepted by the kernel and not yet by the gateway: room for a burst of thousands of
# streams opening at once (the kernel caps it at net.core.somaxconn).
BACKLOG = 8192
