"""`tokenstream` command line, the top of the house: the stack, the topics, each role, the operator tools."""

from __future__ import annotations

import asyncio
import logging

import typer
from rich.console import Console
from rich.table import Table

from common.config import settings
from tokenstream.keys_cli import app as keys_app
from tokenstream.keys_cli import local_key
from tokenstream.stack import Stack
from tokenstream.stack_cli import (
    BROKERS,
    REGIONS,
    each_region,
    mirror_status,
    print_status,
    print_table,
    stack_down,
    stack_up,
    use_brokers,
)
from tokenstream.stack_cli import app as stack_app

app = typer.Typer(
    help="tokenstream: LLM serving as an event-driven pipeline over Apache Kafka.",
    no_args_is_help=True,
    add_completion=False,
)
topics_app = typer.Typer(
    help="The topic registry, applied to and read from the cluster.", no_args_is_help=True
)
app.add_typer(stack_app, name="stack")
app.add_typer(topics_app, name="topics")
app.add_typer(keys_app, name="keys")

console = Console()


def _say(message: str) -> None:
    console.print(message, highlight=False, soft_wrap=True)  # one line each, also in a log file


@app.callback()
def _everywhere(
    region: str = typer.Option(
        None,
        "--region",
        help="run the command as this local region's (`stack up --regions`): its stack, its keys, its roles",
    ),
) -> None:
    """The option is applied by main() before anything reads the settings (see _apply_region)."""


def _apply_region(argv: list[str]) -> None:
    """`tokenstream --region eu ...`: this process, and the roles it starts, are region eu's."""
    from tokenstream.stack import regions
    from tokenstream.stack.stack import use

    value = next((a.split("=", 1)[1] for a in argv[:2] if a.startswith("--region=")), None)
    if value is None and argv[:1] == ["--region"] and len(argv) > 1:
        value = argv[1]
    if value is None:
        return
    names = regions.recorded()
    if value not in names:
        raise SystemExit(
            f"--region {value}: no such local region (run `tokenstream stack up --regions "
            f"{value},...`; recorded: {', '.join(names) or 'none'})"
        )
    use(regions.environment(regions.region_settings(value, names)))


system_app = typer.Typer(
    help="The whole system locally: the stack, the topics and every role.", no_args_is_help=True
)
app.add_typer(system_app, name="system")


def _roles():
    """Every role process wanted locally (one of each unless `tokenstream ops scale` said otherwise)."""
    from tokenstream.stack.scale import local_instances

    return local_instances()


@system_app.command("up")
def system_up(brokers: int | None = BROKERS, regions: str = REGIONS) -> None:
    """Stack, topics, processors, a worker and the gateway; harmless when already up. With --regions,
    all of it in each region, and MirrorMaker 2 between them."""
    if regions is not None:
        stack_up(None, regions)
        for name in each_region():
            _say(f"\n[bold]region {name}[/]")
            _system_up()
        return
    stack_up(brokers, None)  # (called as a function: typer's option defaults are not values here)
    _system_up()


def _system_up() -> None:
    topics_apply(None)
    for role in _roles():
        role.start(_say)
    port = settings().gateway_port
    key_file = settings().data_dir / "local-api-key"
    key = local_key(key_file)
    _say(
        f"\n[bold]chat page:[/] http://127.0.0.1:{port}   [bold]OpenAI base URL:[/] http://127.0.0.1:{port}/v1"
    )
    _say(f"[bold]API key[/] (tenant local, paid, admin; kept in {key_file}): {key}")
    _say(f"[bold]chat page, signed in:[/] http://127.0.0.1:{port}/#key={key}")
    _say("logs: " + str(Stack.default().kafka.log_dir) + "   stop: make stop (or tokenstream system down)")


@system_app.command("down")
def system_down() -> None:
    """Stop every role (of every local region), then the stack (data is kept)."""
    for _ in each_region():
        for role in reversed(_roles()):
            role.stop(_say)
    stack_down()


@system_app.command("status")
def system_status() -> None:
    """A table of the stack's services and the roles (of every local region)."""
    rows = []
    for region in each_region():
        for status in [*Stack.default().status(), *(r.status() for r in _roles())]:
            status.name = f"{region}: {status.name}" if region else status.name
            rows.append(status)
    print_status("process", rows + mirror_status())


def _specs(models: list[str] | None):
    from topics.registry import all_topics

    return all_topics(models or settings().models)


@topics_app.command("apply")
def topics_apply(
    model: list[str] = typer.Option(None, help="models to serve (default: TOKENSTREAM_MODELS)"),
) -> None:
    """Create or update every topic of the registry (idempotent)."""
    from topics.admin import apply

    cfg = settings()
    changes = asyncio.run(apply(_specs(model), cfg.kafka_bootstrap, cfg.kafka_replication))
    table = Table("topic", "action", "detail")
    colour = {"created": "green", "updated": "yellow", "unchanged": "dim"}
    for c in changes:
        table.add_row(c.topic, f"[{colour[c.action]}]{c.action}[/]", c.detail)
    print_table(table)


@topics_app.command("describe")
def topics_describe(
    model: list[str] = typer.Option(None, help="models served"),
    flow: bool = typer.Option(
        False,
        "--flow",
        help="the way of a request: who writes and reads each topic (from the registry; no broker needed)",
    ),
    access: bool = typer.Option(
        False,
        "--access",
        help="each broker user's grants, from the registry, and whether the broker holds them",
    ),
) -> None:
    """Partitions, configs and end offsets of every registered topic."""
    if access:
        _access_table(model)
        return
    if flow:
        from tokenstream.flowmap import flow_table
        from topics.registry import flow as flow_order

        console.print(flow_table(flow_order(model or settings().models)))
        return
    from topics.admin import describe

    specs = {s.name: s for s in _specs(model)}
    infos = asyncio.run(describe(list(specs), settings().kafka_bootstrap))
    table = Table("topic", "partitions", "key", "events", "configs", "end offsets")
    found = {i.name for i in infos}
    for info in infos:
        spec = specs[info.name]
        configs = "\n".join(f"{k}={v}" for k, v in sorted(info.configs.items())) or "(defaults)"
        table.add_row(
            info.name,
            str(info.partitions),
            spec.key,
            ", ".join(e.__name__ for e in spec.events),
            configs,
            f"{info.end_offsets:,}",
        )
    for name in specs.keys() - found:
        table.add_row(name, "[red]missing[/]", specs[name].key, "", "run `tokenstream topics apply`", "")
    print_table(table)


def _access_table(model: list[str] | None) -> None:
    from topics.access import by_user
    from topics.access_admin import broker_grants

    held = asyncio.run(broker_grants(settings().kafka_bootstrap))
    table = Table("user", "resource", "name", "operations", "on the broker")
    for user, user_grants in by_user(_specs(model)).items():
        rows: dict[tuple[str, str], list] = {}
        for g in user_grants:
            rows.setdefault((g.resource, g.name + ("*" if g.pattern == "prefixed" else "")), []).append(g)
        for (resource, name), grants in rows.items():
            missing = [g.operation for g in grants if g not in held]
            table.add_row(
                user,
                resource,
                name,
                ", ".join(g.operation for g in grants),
                f"[red]missing {', '.join(missing)}[/]" if missing else "yes",
            )
    print_table(table)


@topics_app.command("export")
def topics_export(
    fmt: str = typer.Option(
        "strimzi",
        "--format",
        help="strimzi: KafkaTopic resources; strimzi-users: KafkaUser resources, one per role, with its ACLs",
    ),
    model: list[str] = typer.Option(None, help="models served (default: TOKENSTREAM_MODELS)"),
    cluster: str = typer.Option("tokenstream", help="the Strimzi Kafka cluster's name"),
    replicas: int = typer.Option(3, help="replication factor in the cluster"),
) -> None:
    """Print the registry as Kubernetes resources (YAML), for Strimzi's Topic and User Operators."""
    from topics.export import strimzi_topics, strimzi_users, to_yaml

    if fmt == "strimzi":
        typer.echo(to_yaml(strimzi_topics(_specs(model), cluster, replicas)), nl=False)
    elif fmt == "strimzi-users":
        typer.echo(to_yaml(strimzi_users(_specs(model), cluster), fmt), nl=False)
    else:
        console.print(f"[red]unknown format {fmt!r}: strimzi or strimzi-users[/]")
        raise typer.Exit(2)


@topics_app.command("grow")
def topics_grow(
    topic: str,
    partitions: int = typer.Option(..., help="the new partition count"),
    yes: bool = typer.Option(False, "--yes", help="also grow topics holding table state by key"),
) -> None:
    """Grow a topic's partitions, and those of every topic co-partitioned with it, together."""
    from topics.admin import grow
    from topics.registry import KEYED_STATE, co_partitioned

    names = co_partitioned(topic)
    keyed = sorted(KEYED_STATE & set(names))
    if keyed and not yes:
        console.print(
            f"[red]refused:[/] growing {', '.join(names)} moves existing keys of {', '.join(keyed)} to "
            "other partitions, so processors no longer find rows (conversation histories) where their "
            "next events arrive. Stop the processors, grow with --yes, and accept that history rows "
            "start afresh; see docs/operators.md.",
            highlight=False,
        )
        raise typer.Exit(2)
    try:
        changes = asyncio.run(grow(names, partitions, settings().kafka_bootstrap))
    except (ValueError, RuntimeError) as exc:
        console.print(f"[red]{exc}[/]", highlight=False)
        raise typer.Exit(2) from None
    table = Table("topic", "action", "detail", title="grown together" if len(names) > 1 else None)
    for c in changes:
        table.add_row(c.topic, c.action, c.detail)
    print_table(table)


bench_app = typer.Typer(
    help="Benchmarks: each prints its figures beside its baseline, measured in the same run.",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")
processor_app = typer.Typer(
    help="The stateless stream processors (faust-streaming agents).", no_args_is_help=True
)
app.add_typer(processor_app, name="processor")

# Each role brings its own commands from a light `cli` module (heavy imports such as torch
# happen inside the command), so `tokenstream stack up` never loads a model. This table is
# the whole wiring.
ROLE_COMMANDS = {
    (app, "worker"): "gpu_workers.cli:worker",
    (app, "gateway"): "gateway.cli:gateway",
    (app, "chaos"): "tokenstream.chaos.cli:chaos",
    (bench_app, "worker"): "bench.worker:main",
    (bench_app, "gateway"): "bench.gateway:main",
    (bench_app, "safety"): "bench.safety:main",
    (bench_app, "pipeline"): "bench.pipeline:main",
    (bench_app, "tools"): "bench.tools:main",
    (bench_app, "speech"): "bench.speech:main",
    (bench_app, "audit"): "bench.audit:main",
    (app, "plan"): "tokenstream.plan_cli:plan_command",
    (app, "usage"): "tokenstream.usage_cli:usage",
    (app, "erase"): "tokenstream.erase_cli:erase_command",
    (app, "shadow"): "tokenstream.shadow.cli:shadow",
    (bench_app, "cache"): "bench.cache:main",
    (bench_app, "grammar"): "bench.grammar:main",
    (bench_app, "engine"): "bench.engine:main",
    (bench_app, "routing"): "bench.routing:main",
    (bench_app, "tokens"): "bench.tokens:main",
    (processor_app, "conversation"): "processors.cli:conversation",
    (processor_app, "safety"): "processors.cli:safety",
    (processor_app, "router"): "processors.cli:router",
    (app, "tools"): "tools.cli:tools",
}
# commands whose trailing words are another command's (typer leaves them in ctx.args)
PASS_THROUGH = {(app, "guard"): "tokenstream.guard:guard"}


# Tools for auditors and operators, each a typer app in its own module.
TOOL_APPS = {
    "audit": "audit.cli:app",
    "ops": "tokenstream.ops.cli:app",
    "route": "tokenstream.route_cli:app",
}


def _register() -> None:
    """Wire every command of the tables above; a module that fails to import is an error, never a gap."""
    import importlib

    for (parent, name), target in ROLE_COMMANDS.items():
        module, func = target.split(":")
        parent.command(name)(getattr(importlib.import_module(module), func))
    for (parent, name), target in PASS_THROUGH.items():
        module, func = target.split(":")
        parent.command(name, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
            getattr(importlib.import_module(module), func)
        )
    for name, target in TOOL_APPS.items():
        module, attr = target.split(":")
        app.add_typer(getattr(importlib.import_module(module), attr), name=name)


# The broker user each role's command runs as (its ACLs: topics/access.py); every other command is the
# operator's and runs as admin. TOKENSTREAM_KAFKA_USER, when set, wins (common/kafka_auth.py).
BROKER_USERS = {
    ("worker",): "worker",
    ("gateway",): "gateway",
    ("tools",): "tools",
    ("processor", "conversation"): "conversation",
    ("processor", "safety"): "safety",
    ("processor", "router"): "router",
    ("audit",): "audit",
    ("route",): "operator",
    ("shadow",): "operator",
}


def _broker_user(argv: list[str]) -> str:
    from common.kafka_auth import ADMIN

    if argv[:1] == ["guard"]:  # the guard acts as the role it runs
        argv = argv[1:]
    for words, user in BROKER_USERS.items():
        if tuple(argv[: len(words)]) == words:
            return user
    return ADMIN


def quiet_kafka_clients() -> None:
    """An operator's command (one run as admin) prints what it found on stdout. aiokafka logs each
    connection at INFO ("Authenticated as admin via SCRAM-SHA-512", one per broker asked, e.g. for each
    role's group in `system status`), which came between the lines of its tables in `make run > log
    2>&1`: only its warnings and errors are shown. A role's process keeps the INFO lines (its group
    joins and rebalances are read in its log)."""
    logging.getLogger("aiokafka").setLevel(logging.WARNING)


def main() -> None:
    import sys

    from common import kafka_auth

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:]
    words = (
        argv[1:]
        if argv[:1] and argv[0].startswith("--region=")
        else argv[2:]
        if argv[:1] == ["--region"]
        else argv
    )
    user = _broker_user(words)
    kafka_auth.act_as(user)
    if user == kafka_auth.ADMIN:
        quiet_kafka_clients()
    _apply_region(argv)
    use_brokers(None)  # the local stack's cluster, when `stack up --brokers` made one
    _register()
    app()


if __name__ == "__main__":
    main()
