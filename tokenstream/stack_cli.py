"""`tokenstream stack install | up | down | status`: the local Kafka, Redis and Weaviate on loopback, one
stack or one per region (`--regions eu,us`: each region's stack and topics, and MirrorMaker 2
between them)."""

from __future__ import annotations

import asyncio

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from common.config import settings
from tokenstream.stack import Stack

app = typer.Typer(help="The local Kafka, Redis and Weaviate on loopback (no Docker).", no_args_is_help=True)
console = Console()


def _say(message: str) -> None:
    console.print(message, highlight=False, soft_wrap=True)  # one line each, also in a log file


@app.command("install")
def stack_install() -> None:
    """Fetch the Kafka and MirrorMaker jars and build Weaviate into the cache, if not done before."""
    from tokenstream.stack.mirror import MirrorMaker

    stack = Stack.default()
    for service in stack.services:
        service.install(_say)
    MirrorMaker.fetch(stack.kafka.cache_dir, _say)  # the regions' replicator (`stack up --regions`)
    _say("stack: installed (" + ", ".join(s.name for s in stack.services) + ", mirrormaker)")


BROKERS = typer.Option(
    None,
    "--brokers",
    min=1,
    max=9,
    help="Kafka nodes: 3 makes a cluster (replication 3, "
    "min.insync.replicas 2) on the bootstrap port and the five after it (default: "
    "TOKENSTREAM_KAFKA_BROKERS, 1)",
)


def use_brokers(brokers: int | None) -> None:
    """Use `brokers` Kafka nodes from here on (None: as `stack up --brokers` last recorded, unless the
    environment names the broker); point this process's clients, and the roles it starts, at every node
    of a cluster, with its replication."""
    import os

    from tokenstream.stack.stack import use

    if brokers is None and "TOKENSTREAM_KAFKA_BOOTSTRAP" in os.environ:
        return  # the environment names the broker (a role a stack or a test started): nothing to look up
    record = Stack.default().folders[1] / "kafka-brokers"
    if brokers is None and "TOKENSTREAM_KAFKA_BROKERS" not in os.environ:
        brokers = int(record.read_text()) if record.exists() else None
    if brokers is not None:
        use({"TOKENSTREAM_KAFKA_BROKERS": str(brokers)})
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(str(brokers))
    if settings().kafka_brokers > 1:
        use(Stack.default().kafka.environment())


REGIONS = typer.Option(
    None,
    "--regions",
    help="comma-separated regions, e.g. eu,us: one stack per region "
    "(ports +100 per region, data under <data dir>/regions/<name>) and MirrorMaker 2 "
    "between their clusters; recorded, so `--region NAME` then names one of them",
)


@app.command("up")
def stack_up(brokers: int | None = BROKERS, regions: str = REGIONS) -> None:
    """Start Kafka, Redis and Weaviate (installing them on first use); harmless when already up."""
    if regions is not None:
        _regions_up(regions)
        return
    _forget_regions()
    if brokers is not None:
        use_brokers(brokers)
    Stack.default().up(_say)


def _regions_up(value: str) -> None:
    from tokenstream.stack import regions
    from topics.admin import apply
    from topics.registry import all_topics

    try:
        names = regions.parse(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    regions.record(names)
    for name in each_region():
        _say(f"[bold]region {name}[/]")
        Stack.default().up(_say)
        # the topics, and the users MirrorMaker and the roles authenticate as (their grants name the regions)
        asyncio.run(apply(all_topics(settings().models), settings().kafka_bootstrap))
    regions.mirror(names).start(_say)
    _say("run a region's roles with `tokenstream --region NAME system up` (or all: `system up --regions`)")


def _forget_regions() -> None:
    """A stack without regions from now on: the recorded regions are forgotten once all are down."""
    from tokenstream.stack import regions

    if not regions.recorded() or settings().region:
        return
    running = [name for name in each_region() if any(s.running for s in Stack.default().status())]
    if running:
        _say(
            f"[red]regions {', '.join(running)} are running:[/] `tokenstream stack down` first, or name one "
            "with `tokenstream --region NAME ...`"
        )
        raise typer.Exit(1)
    regions.record([])


def each_region():
    """Make this process each local region's in turn (yielding its name), or yield '' once without regions
    (or when `--region` already named one); the settings are the region's while the caller runs, and
    are as before once the loop ends."""
    from tokenstream.stack import regions
    from tokenstream.stack.stack import used

    names = regions.recorded()
    if not names or settings().region:
        yield settings().region
        return
    base = settings()
    for name in names:
        with used(regions.environment(regions.region_settings(name, names, base))):
            yield name


@app.command("down")
def stack_down() -> None:
    """Stop every service of the local stack (every region's, and MirrorMaker; data is kept)."""
    from tokenstream.stack import regions

    names = regions.recorded()
    if names and not settings().region:
        regions.mirror(names).stop(_say)
    for _ in each_region():
        Stack.default().down(_say)


@app.command("status")
def stack_status() -> None:
    """A table of the local services (of every region, with MirrorMaker)."""
    rows = []
    for region in each_region():
        for status in Stack.default().status():
            if region:
                status.name = f"{region}: {status.name}"
            rows.append(status)
    print_status("service", rows + mirror_status())


def mirror_status() -> list:
    """MirrorMaker's row, where this machine runs regions (and no one region was named)."""
    from tokenstream.stack import regions

    names = regions.recorded()
    return [regions.mirror(names).status()] if names and not settings().region else []


def print_status(kind: str, statuses) -> None:
    table = Table(kind, "state", "pid", "address", "detail", "log")
    for s in statuses:
        if s.ready:
            state = "[yellow]degraded[/]" if "degraded:" in s.detail else "[green]ready[/]"
        else:
            state = "[yellow]not ready[/]" if s.running else "[red]stopped[/]"
        table.add_row(s.name, state, str(s.pid or "-"), s.address, s.detail or "", str(s.log))
    print_table(table)


def print_table(table: Table) -> None:
    """Print `table` with every cell whole. On a terminal rich fits it to the window. Into a file or a
    pipe (`make run > log`, a supervisor's log) rich takes 80 columns and cuts the long cells (a log's
    path, a degraded role's detail) or folds them, so there the table is as wide as its rows need."""
    if console.is_terminal:
        console.print(table)
        return
    needed = Measurement.get(console, console.options.update_width(10_000), table).maximum  # no edge
    Console(file=console.file, width=max(needed, console.width)).print(table)
