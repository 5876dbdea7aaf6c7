"""`tokenstream` command line: the stack, the topics, and (as they land) each role."""

from __future__ import annotations

import asyncio
import logging

import typer
from rich.console import Console
from rich.table import Table

from tokenstream.config import settings
from tokenstream.stack import Stack

app = typer.Typer(help="tokenstream: LLM serving as an event-driven pipeline over Apache Kafka.",
                  no_args_is_help=True, add_completion=False)
stack_app = typer.Typer(help="The local Kafka, Redis and Weaviate on loopback (no Docker).", no_args_is_help=True)
topics_app = typer.Typer(help="The topic registry, applied to and read from the cluster.", no_args_is_help=True)
app.add_typer(stack_app, name="stack")
app.add_typer(topics_app, name="topics")

console = Console()


def _say(message: str) -> None:
    console.print(message, highlight=False)


@stack_app.command("install")
def stack_install() -> None:
    """Fetch the Kafka jars and build Weaviate into the cache, if not done before."""
    stack = Stack.default()
    for service in stack.services:
        service.install(_say)
    _say("stack: installed (" + ", ".join(s.name for s in stack.services) + ")")


@stack_app.command("up")
def stack_up() -> None:
    """Start Kafka, Redis and Weaviate (installing them on first use); harmless when already up."""
    Stack.default().up(_say)


@stack_app.command("down")
def stack_down() -> None:
    """Stop every service of the local stack (data is kept)."""
    Stack.default().down(_say)


@stack_app.command("status")
def stack_status() -> None:
    """A table of the local services."""
    table = Table("service", "state", "pid", "address", "log")
    for s in Stack.default().status():
        state = "[green]ready[/]" if s.ready else ("[yellow]starting[/]" if s.running else "[red]stopped[/]")
        table.add_row(s.name, state, str(s.pid or "-"), s.address, str(s.log))
    console.print(table)


def _specs(models: list[str] | None):
    from topics.registry import all_topics

    return all_topics(models or settings().models)


@topics_app.command("apply")
def topics_apply(model: list[str] = typer.Option(None, help="models to serve (default: TOKENSTREAM_MODELS)")) -> None:
    """Create or update every topic of the registry (idempotent)."""
    from topics.admin import apply

    cfg = settings()
    changes = asyncio.run(apply(_specs(model), cfg.kafka_bootstrap, cfg.kafka_replication))
    table = Table("topic", "action", "detail")
    colour = {"created": "green", "updated": "yellow", "unchanged": "dim"}
    for c in changes:
        table.add_row(c.topic, f"[{colour[c.action]}]{c.action}[/]", c.detail)
    console.print(table)


@topics_app.command("describe")
def topics_describe(model: list[str] = typer.Option(None, help="models served")) -> None:
    """Partitions, configs and end offsets of every registered topic."""
    from topics.admin import describe

    specs = {s.name: s for s in _specs(model)}
    infos = asyncio.run(describe(list(specs), settings().kafka_bootstrap))
    table = Table("topic", "partitions", "key", "events", "configs", "end offsets")
    found = {i.name for i in infos}
    for info in infos:
        spec = specs[info.name]
        configs = "\n".join(f"{k}={v}" for k, v in sorted(info.configs.items())) or "(defaults)"
        table.add_row(info.name, str(info.partitions), spec.key,
                      ", ".join(e.__name__ for e in spec.events), configs, f"{info.end_offsets:,}")
    for name in specs.keys() - found:
        table.add_row(name, "[red]missing[/]", specs[name].key, "", "run `tokenstream topics apply`", "")
    console.print(table)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
