"""`tokenstream processor conversation | safety | router`: run one processor in this process.

Each processor's module builds its faust app when imported, so the import happens here,
inside the command, and `tokenstream --help` stays fast.
"""

from __future__ import annotations

import typer

LogLevel = typer.Option(
    "warn", envvar="TOKENSTREAM_PROCESSOR_LOGLEVEL", help="faust log level: crit, error, warn, info, debug"
)


def conversation(loglevel: str = LogLevel) -> None:
    """History, assistant presets and context-window trimming: ts.chat.requests -> ts.requests.prepared."""
    from processors.conversation.agent import app, warm_up
    from processors.faust_app import run

    run(app, loglevel, warm_up)


def safety(loglevel: str = LogLevel) -> None:
    """Input screening and streaming output windows: ts.requests.prepared -> ts.requests.screened."""
    from processors.faust_app import run
    from processors.safety.agent import app, warm_up

    run(app, loglevel, warm_up)


def router(loglevel: str = LogLevel) -> None:
    """Model, tier, load and canary routing: ts.requests.screened -> ts.inference.<model>."""
    from processors.faust_app import run
    from processors.router.agent import app

    run(app, loglevel)
