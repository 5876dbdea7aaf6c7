"""`tokenstream ops lag`: the operator's view of every consumer group in the registry."""

from __future__ import annotations

import asyncio

import typer
from rich.console import Console
from rich.table import Table

from tokenstream.config import settings

app = typer.Typer(help="Operators: consumer-group lag per partition.", no_args_is_help=True)
console = Console()


def _wait(seconds: float | None) -> str:
    if seconds is None:
        return "[red]stalled[/]"
    return "0s" if seconds == 0 else f"{seconds:.1f}s"


@app.command("lag")
def lag(model: list[str] = typer.Option(None, help="models served (default: TOKENSTREAM_MODELS)"),
        group: str = typer.Option(None, help="only this consumer group"),
        interval: float = typer.Option(2.0, help="seconds between the two readings of the drain rate"),
        all_partitions: bool = typer.Option(False, "--all", help="also list partitions without lag")) -> None:
    """Committed and end offsets, lag, owner, drain rate and estimated wait per group and partition."""
    from tokenstream.ops.lag import sample
    from topics.registry import all_topics

    rows, states = asyncio.run(sample(settings().kafka_bootstrap, all_topics(model or settings().models), interval))
    if group:
        rows = [r for r in rows if r.group == group]
    groups = Table("group", "state", "members", "topics", "lag", "drain/s", "est. wait",
                   title="consumer groups (from the topic registry)")
    by_group: dict[str, list] = {}
    for r in rows:
        by_group.setdefault(r.group, []).append(r)
    for name, rs in sorted(by_group.items()):
        state = states.get(name)
        total, rate = sum(r.lag for r in rs), sum(r.rate for r in rs)
        groups.add_row(name, state.state if state else "-", str(state.members if state else 0),
                       ", ".join(sorted({r.topic for r in rs})), f"{total:,}", f"{rate:.1f}",
                       _wait(total / rate if rate else (0.0 if total == 0 else None)))
    console.print(groups)
    table = Table("group", "topic", "partition", "committed", "end", "lag", "owner", "drain/s", "est. wait",
                  title="partitions" + ("" if all_partitions else " with lag (--all for every one)"))
    for r in rows:
        if r.lag or all_partitions:
            table.add_row(r.group, r.topic, str(r.partition), "-" if r.committed is None else f"{r.committed:,}",
                          f"{r.end:,}", f"{r.lag:,}", r.owner or "-", f"{r.rate:.1f}", _wait(r.wait_s))
    console.print(table)
