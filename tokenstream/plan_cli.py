"""`tokenstream plan`: print a capacity plan with its arithmetic (see tokenstream/plan.py)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

console = Console()


def plan_command(
    rps: float = typer.Option(..., help="peak requests per second"),
    prompt_tokens: int = typer.Option(..., help="mean prompt tokens per request"),
    output_tokens: int = typer.Option(..., help="mean output tokens per request"),
    ttft_slo: float = typer.Option(..., help="time-to-first-token target (p99), seconds"),
    utilisation: float = typer.Option(0.7, help="highest worker utilisation wanted (headroom)"),
    price: float = typer.Option(None, help="price of one worker per hour (any currency)"),
    worker_tokens_per_s: float = typer.Option(None, help="override the measured worker capacity"),
    ttft_p99: float = typer.Option(None, help="override the measured TTFT p99 (s)"),
    measured_utilisation: float = typer.Option(None, help="the utilisation that p99 was measured at"),
) -> None:
    """Workers, partitions, gateways and cost for a load, from the figures `bench worker` measured."""
    from tokenstream.plan import Measured, plan

    m = Measured.from_bench()
    if worker_tokens_per_s is not None:
        m.tokens_per_s, m.source = worker_tokens_per_s, "given"
    if ttft_p99 is not None:
        m.ttft_p99_s = ttft_p99
    if measured_utilisation is not None:
        m.utilisation = measured_utilisation
    try:
        result = plan(rps, prompt_tokens, output_tokens, ttft_slo, m, utilisation, price)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    table = Table("quantity", "arithmetic", "value", title="capacity plan")
    for quantity, arithmetic, value in result.lines:
        table.add_row(quantity, arithmetic, f"[bold]{value}[/]")
    console.print(table)
