"""`tokenstream ops lag | scale | supervise | autoscale`: the operator's tools, built on the registry."""

from __future__ import annotations

import asyncio
import signal

import typer
from rich.console import Console
from rich.table import Table

from common.config import settings

app = typer.Typer(
    help="Operators: consumer-group lag, scaling roles by hand or on lag.", no_args_is_help=True
)
console = Console()


def _say(message: str) -> None:
    console.print(message, highlight=False, soft_wrap=True)  # one line each, also in a log file


def _wait(seconds: float | None) -> str:
    if seconds is None:
        return "[red]stalled[/]"
    return "0s" if seconds == 0 else f"{seconds:.1f}s"


@app.command("lag")
def lag(
    model: list[str] = typer.Option(None, help="models served (default: TOKENSTREAM_MODELS)"),
    group: str = typer.Option(None, help="only this consumer group"),
    interval: float = typer.Option(2.0, help="seconds between the two readings of the drain rate"),
    all_partitions: bool = typer.Option(False, "--all", help="also list partitions without lag"),
) -> None:
    """Committed and end offsets, lag, owner, drain rate and estimated wait per group and partition."""
    from tokenstream.ops.lag import sample
    from topics.registry import all_topics

    rows, states = asyncio.run(
        sample(settings().kafka_bootstrap, all_topics(model or settings().models), interval)
    )
    if group:
        rows = [r for r in rows if r.group == group]
    groups = Table(
        "group",
        "state",
        "members",
        "topics",
        "lag",
        "drain/s",
        "est. wait",
        title="consumer groups (from the topic registry)",
    )
    by_group: dict[str, list] = {}
    for r in rows:
        by_group.setdefault(r.group, []).append(r)
    for name, rs in sorted(by_group.items()):
        state = states.get(name)
        total, rate = sum(r.lag for r in rs), sum(r.rate for r in rs)
        groups.add_row(
            name,
            state.state if state else "-",
            str(state.members if state else 0),
            ", ".join(sorted({r.topic for r in rs})),
            f"{total:,}",
            f"{rate:.1f}",
            _wait(total / rate if rate else (0.0 if total == 0 else None)),
        )
    console.print(groups)
    table = Table(
        "group",
        "topic",
        "partition",
        "committed",
        "end",
        "lag",
        "owner",
        "drain/s",
        "est. wait",
        title="partitions" + ("" if all_partitions else " with lag (--all for every one)"),
    )
    for r in rows:
        if r.lag or all_partitions:
            table.add_row(
                r.group,
                r.topic,
                str(r.partition),
                "-" if r.committed is None else f"{r.committed:,}",
                f"{r.end:,}",
                f"{r.lag:,}",
                r.owner or "-",
                f"{r.rate:.1f}",
                _wait(r.wait_s),
            )
    console.print(table)


@app.command("probe")
def probe(
    group: str = typer.Option(None, help="the consumer group this process joins"),
    host: str = typer.Option(
        None, help="this process's address as the broker sees it (default: this host's address)"
    ),
    redis: bool = typer.Option(
        True,
        help="also require Redis to answer (every processor keeps its "
        "ledger of done effects there and holds its input without it)",
    ),
    url: str = typer.Option(
        None,
        help="instead: a role's /health/ready (worker, tool processor, "
        "gateway), e.g. http://127.0.0.1:9400/health/ready",
    ),
) -> None:
    """Exit 0 when a member of GROUP on this host holds a partition (and Redis answers): a processor pod's
    readiness. With --url, exit 0 when that readiness endpoint answers 200; either way print why."""
    from tokenstream.ops.probe import group_ready, url_ready

    if url:
        ok, why = url_ready(url)
    elif group:
        import socket

        ok, why = group_ready(group, host or socket.gethostbyname(socket.gethostname()), redis)
    else:
        raise typer.BadParameter("give --group (a processor) or --url (a role's /health/ready)")
    typer.echo(why)
    raise typer.Exit(0 if ok else 1)


def _local():
    """The local stack's run folder, the wanted counts and a supervisor over them."""
    from tokenstream.stack import Stack
    from tokenstream.stack.scale import Supervisor, Wanted, local_instances

    run_dir = Stack.default().kafka.run_dir
    return Wanted.load(run_dir), Supervisor(run_dir, local_instances, _say)


@app.command("scale")
def scale(
    targets: list[str] = typer.Argument(
        ..., help="ROLE=N ... (conversation, safety, router, worker, worker:MODEL, gateway)"
    ),
    wait: bool = typer.Option(True, help="wait until started processes are ready"),
) -> None:
    """Start or stop local processes of roles; refuses more members than the group's partitions."""
    from tokenstream.stack.scale import ScaleError, check_ceiling, parse_targets
    from topics.admin import partition_counts

    cfg = settings()
    try:
        wanted_now = parse_targets(targets, cfg.models[0])
        counts = asyncio.run(partition_counts(cfg.kafka_bootstrap))
        check_ceiling(wanted_now, counts.get, cfg.models[0])
    except ScaleError as exc:
        console.print(f"[red]{exc}[/]", highlight=False)
        raise typer.Exit(2) from None
    wanted, supervisor = _local()
    wanted.counts.update(wanted_now)
    wanted.save()
    for action in supervisor.reconcile(wait=wait) or ["nothing to change"]:
        _say(action)


@app.command("supervise")
def supervise(interval: float = typer.Option(1.0, help="seconds between checks")) -> None:
    """Keep the wanted processes running (restart a crashed one with back-off) until stopped."""
    _, supervisor = _local()
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    _say("supervising the local roles (scale.json in the stack's run folder); Ctrl-C stops")
    try:
        supervisor.run(interval, stop=lambda: bool(stopping))
    except KeyboardInterrupt:
        pass


@app.command("autoscale")
def autoscale(
    model: str = typer.Option(None, help="the worker group's model (default: the first served)"),
    lag_threshold: int = typer.Option(10, help="waiting requests per replica (KEDA lagThreshold)"),
    activation_lag_threshold: int = typer.Option(0, help="lag above which the group is active"),
    min_replicas: int = typer.Option(1, "--min", help="0 opts in to scaling to zero"),
    max_replicas: int = typer.Option(4, "--max"),
    cooldown: float = typer.Option(300.0, help="seconds inactive before scaling to zero"),
    stabilization: float = typer.Option(300.0, help="scale-down stabilization window, seconds"),
    allow_idle_consumers: bool = typer.Option(False, help="allow more replicas than partitions"),
    interval: float = typer.Option(5.0, help="seconds between lag samples"),
) -> None:
    """Scale a worker group on its lag with the semantics of KEDA's Kafka scaler, until stopped."""
    from tokenstream.ops.autoscale import Autoscaler, ScalePolicy
    from topics import inference_topic, worker_group

    cfg = settings()
    model = model or cfg.models[0]
    key = "worker" if model == cfg.models[0] else f"worker:{model}"
    wanted, supervisor = _local()
    policy = ScalePolicy(
        lag_threshold,
        activation_lag_threshold,
        min_replicas,
        max_replicas,
        cooldown,
        stabilization,
        allow_idle_consumers=allow_idle_consumers,
    )

    def apply(replicas: int, decision) -> None:
        wanted.counts[key] = replicas
        wanted.save()
        supervisor.reconcile(wait=False)

    scaler = Autoscaler(
        cfg.kafka_bootstrap,
        worker_group(model),
        inference_topic(model).name,
        policy,
        wanted.count(key),
        apply,
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        _say(f"autoscaling {worker_group(model)} on {inference_topic(model).name}: {policy}")
        await scaler.run(interval, stop, _say)

    asyncio.run(main())
