"""How many processes of each role run locally, and a supervisor that keeps it so.

`tokenstream ops scale worker=2 safety=2` records the wanted counts in the stack's run folder
(scale.json) and starts or stops processes to match; `tokenstream ops supervise` keeps matching
them, restarting a process that died with exponential back-off (1 s doubling to 60 s, reset once
it has stayed up for a minute), after taking it out of its consumer groups at once (a standby takes
its partitions then, not when its session ends: producers/membership.py, `evict`). Instance 1 of a
role keeps the role's plain name (its pid file and log are the ones `system up` uses); instance
i > 1 is `<role>-<i>`.

The partition ceiling is explicit: a consumer group cannot have more active members than its
input topic has partitions, so asking for more is refused with a message that says so (grow the
partitions with `tokenstream topics grow`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common.config import settings
from producers.membership import evict_and_say
from tokenstream.stack.roles import Role, shared_host_worker_args
from topics.registry import (
    CHAT_REQUESTS,
    PREPARED,
    SCREENED,
    TOKENS,
    TOOL_CALLS,
    inference_topic,
    processor_group,
)

SCALABLE = ("conversation", "safety", "router", "tools", "worker", "gateway")
BACKOFF_FIRST_S, BACKOFF_MAX_S, STABLE_S = 1.0, 60.0, 60.0


class ScaleError(ValueError):
    pass


def input_topic(kind: str, model: str) -> str:
    """The topic whose partition count caps a role's members (its group's main input)."""
    return {
        "conversation": CHAT_REQUESTS.name,
        "safety": PREPARED.name,
        "router": SCREENED.name,
        "tools": TOOL_CALLS.name,
        "gateway": TOKENS.name,
    }.get(kind) or inference_topic(model).name


def parse_targets(items: list[str], default_model: str) -> dict[str, int]:
    """["worker=2", "worker:other=1", "safety=3"] -> {"worker": 2, "worker:other": 1, "safety": 3}."""
    out = {}
    for item in items:
        name, sep, count = item.partition("=")
        kind = name.split(":", 1)[0]
        if not sep or kind not in SCALABLE or not count.isdigit():
            raise ScaleError(
                f"{item!r}: write ROLE=N with ROLE one of {', '.join(SCALABLE)} "
                "(worker:MODEL for a model other than the first)"
            )
        if name == f"worker:{default_model}":
            name = "worker"
        out[name] = int(count)
    return out


def check_ceiling(
    targets: dict[str, int], partitions: Callable[[str], int | None], default_model: str
) -> None:
    """Refuse more members than partitions: the extra ones would sit idle and take no load."""
    for name, count in targets.items():
        kind, _, model = name.partition(":")
        topic = input_topic(kind, model or default_model)
        have = partitions(topic)
        if have is not None and count > have:
            raise ScaleError(
                f"{name}={count} refused: {topic} has {have} partitions, so at most {have} "
                f"{kind} processes can take work (grow it: tokenstream topics grow {topic} "
                f"--partitions {count})"
            )


@dataclass
class Wanted:
    """scale.json in the run folder: the wanted count per role (1 when never set)."""

    path: Path
    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def load(cls, run_dir: Path) -> Wanted:
        path = run_dir / "scale.json"
        try:
            return cls(path, {k: int(v) for k, v in json.loads(path.read_text()).items()})
        except (OSError, ValueError):
            return cls(path)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.counts, indent=1, sort_keys=True))

    def count(self, name: str) -> int:
        return self.counts.get(name, 1)


def local_instances() -> list[Role]:
    """Every role process wanted on this machine's stack (the counts `tokenstream ops scale` saved, one
    of each by default) under the current settings; the workers of every local region share its cores."""
    from common.config import settings
    from tokenstream.stack import Stack, regions

    cfg, stack = settings(), Stack.default()
    return instances(
        stack.folders,
        cfg.models,
        cfg.gateway_port,
        cfg.worker_metrics_port,
        Wanted.load(stack.kafka.run_dir),
        cfg.tools_health_port,
        systems=max(1, len(regions.recorded())),
    )


def _changed(recorded: list[str] | None, wanted: list[str]) -> bool:
    """Whether a running role must restart to take `wanted` arguments. A worker's thread share alone
    is not a reason: scaling the group down would interrupt the survivors' streams to give them more
    cores (they take their new share at their next start)."""
    if recorded is None:
        return False
    return _without_threads(recorded) != _without_threads(wanted)


def _without_threads(args: list[str]) -> list[str]:
    if "--threads" not in args:
        return args
    at = args.index("--threads")
    return args[:at] + args[at + 2 :]


def instances(
    folders: tuple[Path, Path, Path, Path],
    models: list[str],
    gateway_port: int,
    worker_metrics_port: int,
    wanted: Wanted,
    tools_health_port: int = 9450,
    systems: int = 1,
) -> list[Role]:
    """Every process `wanted` asks for, in start order (processors, the tool processor, the notary, workers,
    gateways). `systems` is how many such systems share this host (one per local region of `stack up
    --regions`): their workers share its cores."""
    roles: list[Role] = []

    def named(base: str, i: int) -> str:
        return base if i == 0 else f"{base}-{i + 1}"

    for kind, settle in (("conversation", 3.0), ("safety", 5.0), ("router", 3.0)):
        roles += [
            Role(named(kind, i), ["processor", kind], folders, settle_s=settle, group=processor_group(kind))
            for i in range(wanted.count(kind))
        ]
    # the tool processor loads MiniLM and tries its sandbox before it serves (it exits if that fails)
    roles += [
        Role(
            named("tools", i),
            ["tools", "--health-port", str(tools_health_port + i)],
            folders,
            probe_url=f"http://127.0.0.1:{tools_health_port + i}/health/ready",
        )
        for i in range(wanted.count("tools"))
    ]
    # the audit ledger's notary: one per cluster, never more (a second would write a second chain)
    roles += [
        Role("notary", ["audit", "notarize", "--follow"], folders, settle_s=3.0)
        for _ in range(min(1, wanted.count("notary")))
    ]
    port = worker_metrics_port
    workers = {
        model: wanted.count("worker") if m == 0 else wanted.counts.get(f"worker:{model}", 0)
        for m, model in enumerate(models)
    }
    share = shared_host_worker_args(
        sum(workers.values()) * systems
    )  # every model's (and region's) worker is here
    for m, model in enumerate(models):
        base = "worker" if m == 0 else f"worker.{model}"
        for i in range(workers[model]):
            roles.append(
                Role(
                    named(base, i),
                    ["worker", "--model", model, "--metrics-port", str(port), *share],
                    folders,
                    probe_url=f"http://127.0.0.1:{port}/health/ready",
                )
            )
            port += 1
    n = wanted.count("gateway")
    for i in range(n):
        args = ["gateway", "--port", str(gateway_port + i)]
        if n > 1:
            args += ["--instance-index", str(i), "--instance-count", str(n)]
        roles.append(
            Role(
                named("gateway", i),
                args,
                folders,
                probe_url=f"http://127.0.0.1:{gateway_port + i}/health/ready",
            )
        )
    return roles


def strays(run_dir: Path, wanted: list[Role]) -> list[str]:
    """Names of role processes with a pid file that `wanted` no longer lists (to be stopped)."""
    names = {r.name for r in wanted}
    out = []
    for pid_file in sorted(run_dir.glob("*.pid")):
        name = pid_file.stem
        kind = name.split(".", 1)[0].rsplit("-", 1)[0]
        if kind in SCALABLE and name not in names:
            out.append(name)
    return out


@dataclass
class Backoff:
    """Restart pacing of one instance."""

    failures: int = 0
    next_at: float = 0.0
    started_at: float = 0.0
    restarts: int = 0

    def started(self, now: float) -> None:
        self.started_at = now

    def died(self, now: float) -> None:
        if self.started_at and now - self.started_at >= STABLE_S:
            self.failures = 0
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2**self.failures)
        self.failures += 1
        self.restarts += 1
        self.next_at = now + delay

    def due(self, now: float) -> bool:
        return now >= self.next_at


class Supervisor:
    """Brings the running role processes to `wanted`, and (in `run`) keeps them there."""

    def __init__(self, run_dir: Path, make: Callable[[], list[Role]], say=print) -> None:
        self.run_dir, self.make, self.say = run_dir, make, say
        self.backoff: dict[str, Backoff] = {}
        self.seen_alive: dict[str, int] = {}  # name -> the pid it ran as (0: not known)

    def reconcile(self, wait: bool = True, now: float | None = None) -> list[str]:
        """One pass: stop what is not wanted, (re)start what is missing or changed. Returns actions."""
        now = time.monotonic() if now is None else now
        roles = self.make()
        actions = []
        for name in reversed(strays(self.run_dir, roles)):  # highest instance first
            stray = Role(name, [], _folders_of(roles, self.run_dir))
            if stray.stop(self.say):
                actions.append(f"stopped {name}")
            self.backoff.pop(name, None)
            self.seen_alive.pop(name, None)
        for role in roles:
            pid = role.pid()
            if pid is not None and _changed(role.recorded_args(), role.args):
                role.stop(self.say)  # its arguments changed (e.g. the gateway count): start it afresh
                pid = None
                actions.append(f"restarted {role.name} with new arguments")
            if pid is not None:
                self.seen_alive[role.name] = pid
                continue
            pace = self.backoff.setdefault(role.name, Backoff())
            if role.name in self.seen_alive:  # it was running under us and died
                self._evict(role.name, self.seen_alive.pop(role.name))
                pace.died(now)
                self.say(
                    f"{role.name}: exited; restart in {pace.next_at - now:.0f}s (restart {pace.restarts})"
                )
            if not pace.due(now):
                continue
            role.start(self.say, wait=wait)
            pace.started(now)
            self.seen_alive[role.name] = role.pid() or 0
            actions.append(f"started {role.name}")
        return actions

    def _evict(self, name: str, pid: int) -> None:
        if pid:
            asyncio.run(evict_and_say(settings().kafka_bootstrap, pid, name, self.say))

    def run(self, interval_s: float = 1.0, stop: Callable[[], bool] = lambda: False) -> None:
        while not stop():
            try:
                self.reconcile(wait=False)
            except Exception as exc:  # noqa: BLE001 - a failed start is retried on the next pass
                self.say(f"supervisor: {exc}")
            time.sleep(interval_s)


def _folders_of(roles: list[Role], run_dir: Path) -> tuple[Path, Path, Path, Path]:
    if roles:
        r = roles[0]
        return r.data_dir.parent, r.run_dir, r.log_dir, r.cache_dir
    return run_dir.parent / "data", run_dir, run_dir.parent / "logs", run_dir.parent / "cache"
