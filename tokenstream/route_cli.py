"""`tokenstream route ...`: change canary weights at run time, roll back, show the routes."""

from __future__ import annotations

import asyncio
import uuid

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Model routing at run time (RouteUpdate events on ts.routes).", no_args_is_help=True)
console = Console()


def _parse(weights: list[str]) -> dict[str, float]:
    parsed = {}
    for item in weights:
        name, _, share = item.partition("=")
        try:
            parsed[name] = float(share)
        except ValueError:
            raise typer.BadParameter(f"expected MODEL=SHARE, got {item!r}") from None
    if not parsed or sum(parsed.values()) <= 0:
        raise typer.BadParameter("give at least one positive weight")
    return parsed


async def publish_route(model: str, weights: dict[str, float], fallback: str | None) -> None:
    from producers import publish, start_producer
    from schemas import RouteUpdate
    from topics import ROUTES

    producer = await start_producer()
    try:
        update = RouteUpdate(
            request_id=f"route-{uuid.uuid4().hex[:12]}", model=model, weights=weights, fallback=fallback
        )
        await publish(producer, ROUTES, update, key=model)
    finally:
        await producer.stop()


@app.command("set")
def set_route(
    model: str,
    weight: list[str] = typer.Option(..., "--weight", "-w", help="TARGET=SHARE"),
    fallback: str | None = typer.Option(None, help="target when the chosen one is overloaded"),
) -> None:
    """Route requests for MODEL by weight, e.g. -w smollm2=0.9 -w smollm2-v2=0.1 (a canary). A target other
    than MODEL gets traffic only with a passed shadow gate against MODEL (`tokenstream shadow`)."""
    from tokenstream.shadow.gate import latest, refusal

    weights = _parse(weight)
    why = refusal(model, [t for t, w in weights.items() if w > 0], asyncio.run(latest()))
    if why is not None:
        console.print(f"route {model}: refused: {why}", highlight=False)
        raise typer.Exit(1)
    asyncio.run(publish_route(model, weights, fallback))
    console.print(
        f"route {model}: " + ", ".join(f"{t} {w / sum(weights.values()):.0%}" for t, w in weights.items())
    )


@app.command("rollback")
def rollback(model: str, to: str | None = typer.Option(None, help="target (default: MODEL itself)")) -> None:
    """Send every request for MODEL to one target again (undoes a canary in one command)."""
    asyncio.run(publish_route(model, {to or model: 1.0}, None))
    console.print(f"route {model}: {to or model} 100%")


@app.command("show")
def show() -> None:
    """The latest route of every model on ts.routes."""
    from aiokafka.structs import TopicPartition

    from producers import start_consumer
    from producers.consume import caught_up
    from schemas import RouteUpdate, decode
    from topics import ROUTES

    async def read() -> dict[str, RouteUpdate]:
        consumer = await start_consumer(group=None)
        try:
            tps = [TopicPartition(ROUTES.name, p) for p in range(ROUTES.partitions)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            ends, latest = await consumer.end_offsets(tps), {}
            while not await caught_up(consumer, ends):
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    for r in records:
                        update = decode(r.value, RouteUpdate)
                        latest[update.model] = update
            return latest
        finally:
            await consumer.stop()

    table = Table("model", "weights", "fallback", "changed by")
    for model, update in sorted(asyncio.run(read()).items()):
        total = sum(update.weights.values())
        table.add_row(
            model,
            ", ".join(f"{t} {w / total:.0%}" for t, w in update.weights.items()),
            update.fallback or "-",
            update.request_id,
        )
    console.print(table)
