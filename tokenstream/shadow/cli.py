"""`tokenstream shadow`: try a candidate model on the traffic a served model answered, before it serves.

    tokenstream shadow --model smollm2-v2 --served smollm2 --since 1h --require agreement>=0.9

The recorded requests of the range are replayed to the candidate's worker group (never to a client,
rate-limited, below every tier), its answers compared with what was served (tokenstream/shadow/
compare.py), and the outcome recorded on ts.shadow.gates, where `tokenstream route set` looks before it
sends the candidate any traffic. Exit 1 when a condition of `--require` failed.
"""

from __future__ import annotations

import asyncio
import time

import typer
from rich.console import Console
from rich.table import Table

from common.config import settings

console = Console()


def shadow(
    model: str = typer.Option(..., "--model", help="the candidate (a worker group must serve it)"),
    served: str = typer.Option(
        None, help="the model whose traffic is replayed (default: the first of TOKENSTREAM_MODELS)"
    ),
    since: str = typer.Option(..., help="ISO 8601, or a duration back (90s, 15m, 2h, 7d)"),
    until: str = typer.Option(None, help="the end of the range (default: now)"),
    tenant: str = typer.Option(None, help="only this tenant's requests"),
    limit: int = typer.Option(None, min=1, help="at most this many requests (the first of the range)"),
    rate: float = typer.Option(2.0, min=0.01, help="replayed requests a second, at most"),
    in_flight: int = typer.Option(4, min=1, help="replayed requests unanswered at once, at most"),
    require: list[str] = typer.Option(
        [],
        "--require",
        help="a gate condition, e.g. agreement>=0.9 (repeatable; without one the evaluation cannot pass)",
    ),
    timeout: float = typer.Option(600.0, min=1, help="seconds to wait for the candidate's answers"),
) -> None:
    """Replay what SERVED answered in a time range to the candidate, compare, record the gate."""
    from audit.cli import parse_time
    from common import id_key
    from tokenstream.shadow.compare import figures
    from tokenstream.shadow.gate import failed, new_gate, parse, record
    from tokenstream.shadow.replay import recorded, replay

    for condition in require:
        try:
            parse(condition)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--require") from None
    id_key.install()  # the copies' request ids are sealed like every other
    cfg = settings()
    served = served or cfg.models[0]
    since_ms = parse_time(since)
    until_ms = parse_time(until) if until else int(time.time() * 1000)

    def progress(done: int, total: int) -> None:
        if done == total or time.monotonic() - progress.last >= 5:
            console.print(f"shadow: {done} of {total} answered", highlight=False)
            progress.last = time.monotonic()

    progress.last = 0.0

    async def run():
        pairs = await recorded(cfg.kafka_bootstrap, served, since_ms, until_ms, tenant, limit)
        console.print(
            f"shadow: {len(pairs)} requests {served} answered in the range; replaying them to {model} "
            f"({rate:g}/s at most, {in_flight} at once)",
            highlight=False,
        )
        if pairs:
            await replay(
                cfg.kafka_bootstrap,
                model,
                pairs,
                rate=rate,
                in_flight=in_flight,
                timeout_s=timeout,
                progress=progress,
            )
        return pairs

    pairs = asyncio.run(run())
    if not pairs:
        console.print(
            f"shadow: nothing to compare: no request {served} answered in the range", highlight=False
        )
        raise typer.Exit(1)
    found = figures(pairs)
    missed = failed(require, found)
    gate = new_gate(
        candidate=model,
        served=served,
        since=since_ms / 1000,
        until=until_ms / 1000,
        requests=len(pairs),
        figures=found,
        require=list(require),
        passed=bool(require) and not missed,
    )
    asyncio.run(record(cfg.kafka_bootstrap, gate))
    _print(gate, missed, pairs)
    raise typer.Exit(0 if gate.passed else 1)


def _print(gate, missed: list[str], pairs) -> None:
    from tokenstream.shadow.compare import FIGURES

    table = Table(
        "figure",
        "value",
        title=f"shadow evaluation {gate.request_id}: {gate.candidate} on "
        f"{gate.requests} requests {gate.served} answered",
    )
    for name in FIGURES:
        value = gate.figures.get(name)
        table.add_row(name, "-" if value is None else f"{value:.3f}")
    console.print(table)
    differing = [p for p in pairs if p.shadow is not None and p.shadow.text != p.served.text][:3]
    for p in differing:
        console.print(
            f"[dim]{p.request.request_id}[/] served: {p.served.text[:80]!r}\n"
            f"{' ' * len(p.request.request_id)} {gate.candidate}: {p.shadow.text[:80]!r}",
            highlight=False,
        )
    if not gate.require:
        console.print(
            "gate: no --require given: recorded as not passed (route set will refuse the candidate)"
        )
    elif missed:
        console.print(f"gate: [red]FAIL[/] ({', '.join(missed)})")
    else:
        console.print(f"gate: [green]PASS[/] ({', '.join(gate.require)})")
