"""The fault drill: steady streaming load on the whole system while processes die and the broker restarts.

Every role runs with two processes (`instances=2`) and two gateway instances; `clients` users
stream greedy answers one after another, resuming on any gateway when their connection drops or
their stream ends with an error event. A supervisor starts again every process that exits (with
back-off for one that keeps exiting by itself). Every `every_s` seconds one fault is injected, in
turn (or, with `schedule`, exactly those faults spread evenly over the run):
  kill     kill -9 one process of a role (the roles in turn, a random instance);
  broker   stop the broker (SIGTERM) and start it again; on a three-node cluster (`brokers=3`) kill -9
           a node, kill -9 the active controller, or restart every node in turn (chaos/brokers.py);
  stall    the next request's client stops reading for `stall_s` seconds mid-answer;
  freeze   stop one process of a role (SIGSTOP) for `freeze_s` seconds, longer than its session, then
           let it go on (SIGCONT): a member its supervisor sees alive, expelled by the broker, that
           wakes up believing it still owns its partitions (a long GC or VM pause).
The faults start once a first answer is complete. Each kill's stall is the longest wait for a next
token it caused (`_stalls`), beside the same measure over the quiet time before the first fault.
Afterwards (`verify.Verdict`): every admitted request must have ended for its client with [DONE]
and exactly the text the log holds, each position once, and whatever the client held when its
stream broke off must have been a prefix of that text; ts.tokens must hold one consistent answer
per request; every group's lag must return to zero, and no worker may still be generating.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tokenstream.chaos.brokers import broker_fault
from tokenstream.chaos.clients import Client, Outcome
from tokenstream.chaos.verify import Verdict, drained, judge, read_answers

ROLES = ("conversation", "safety", "router", "worker", "gateway")


@dataclass
class Fault:
    kind: str
    target: str
    at: float
    ended_at: float = 0.0  # when the fault was over (the broker back); recovery counts from here
    recovered_at: float | None = None  # the first answer in full of a request sent after it ended
    served_at: float | None = None  # the first first token of such a request: the pipeline serves again
    stall_s: float | None = None  # the longest wait it caused for a next token (drill._stalls)

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.ended_at

    @property
    def first_token_s(self) -> float | None:
        return None if self.served_at is None else self.served_at - self.ended_at


@dataclass
class Report:
    seconds: float
    faults: list[Fault] = field(default_factory=list)
    verdict: Verdict = field(default_factory=Verdict)
    refused: int = 0
    unacknowledged: int = 0
    resumes: int = 0
    lag_left: dict[str, int] = field(default_factory=dict)
    running_left: float = 0.0
    logs: str = ""
    every_s: float = 0.0  # the time between two faults
    baseline_stall_s: float | None = None  # the same wait measured without a fault (before the first)
    baseline_answer_s: float | None = None  # the longest whole answer without a fault (a recovery's own part)

    @property
    def ok(self) -> bool:
        v = self.verdict
        return (
            v.admitted > 0
            and not v.broken
            and not any(self.lag_left.values())
            and self.running_left == 0
            and all(f.recovered_at is not None for f in self.faults)
        )


def plan(
    kills_per_role: int, broker_restarts: int, stalls: int, roles: tuple[str, ...] = ROLES, freezes: int = 0
) -> tuple[str, ...]:
    """A schedule of exactly these faults: the kills (`roles` in turn), with the broker restarts, the
    client stalls and the freezes each at an even fraction of the run."""
    kills = ["kill"] * (kills_per_role * len(roles))
    marks = sorted(
        [((j + 0.5) / broker_restarts, "broker") for j in range(broker_restarts)]
        + [((j + 0.5) / stalls, "stall") for j in range(stalls)]
        + [((j + 0.5) / freezes, "freeze") for j in range(freezes)]
    )
    total, schedule = len(kills) + len(marks), []
    for fraction, kind in marks:
        while kills and len(schedule) < round(fraction * total):
            schedule.append(kills.pop())
        schedule.append(kind)
    return tuple(schedule + kills)


async def run(
    minutes: float,
    *,
    clients: int = 3,
    every_s: float = 20.0,
    stall_s: float = 8.0,
    freeze_s: float = 6.0,
    max_tokens: int = 24,
    deadline_s: float = 120.0,
    kinds: tuple[str, ...] = ("kill", "kill", "kill", "kill", "kill", "broker", "stall"),
    schedule: tuple[str, ...] | None = None,
    root: Path | None = None,
    brokers: int = 1,
    roles: tuple[str, ...] = ROLES,
    say=print,
) -> Report:
    """`kinds` cycle, one fault every `every_s`, for `minutes`; or, with `schedule`, exactly those faults
    spread evenly over `minutes`. Kills strike `roles` in turn."""
    from tokenstream.stack.local import LocalSystem

    root = root or Path(tempfile.mkdtemp(prefix="chaos-"))
    gateways = {
        "a": {"TOKENSTREAM_GATEWAY_CANCEL_GRACE_S": "30"},
        "b": {"TOKENSTREAM_GATEWAY_CANCEL_GRACE_S": "30"},
    }
    async with LocalSystem(root, "smollm2", gateways, instances=2, brokers=brokers) as system:
        from common import sealing

        sealing.install(system.stack.redis.address)  # the drill reads the roles' sealed answers back
        started = time.time()
        users = [
            Client([system.url(g) for g in gateways], "smollm2", max_tokens=max_tokens, deadline_s=deadline_s)
            for _ in range(clients)
        ]
        outcomes: list[Outcome] = []
        stop = asyncio.Event()
        if schedule is None:
            schedule = tuple(itertools.islice(itertools.cycle(kinds), int(minutes * 60 // every_s)))
        else:
            every_s = minutes * 60 / (len(schedule) + 1)
        say(
            f"chaos: {clients} clients, {len(schedule)} faults, one every {every_s:.1f} s "
            f"for {minutes:g} min (logs in {root})"
        )
        supervisor_stop = asyncio.Event()
        supervisor = asyncio.create_task(system.supervise(supervisor_stop))
        loads = [asyncio.create_task(_user(u, i, outcomes, stop, system.key)) for i, u in enumerate(users)]
        warm_at = await _first_answer(outcomes, deadline_s)
        probe = Client(
            [system.url(g) for g in gateways], "smollm2", max_tokens=max_tokens, deadline_s=deadline_s
        )
        probes: list[asyncio.Task] = []

        def send_probe() -> None:  # the next request after a fault, sent the moment it ends
            probes.append(asyncio.create_task(_probe(probe, len(probes), outcomes, system.key)))

        faults = await _inject(
            system, users, schedule, every_s, stall_s, roles, say, send_probe, freeze_s=freeze_s
        )
        await _until_recovered(faults, outcomes, deadline_s)
        stop.set()
        say("chaos: faults done; waiting for the requests in flight to end")
        await asyncio.gather(*loads, *probes)
        _recoveries(faults, outcomes)
        _stalls(faults, outcomes)
        # the same measure over the warm, quiet time before the first fault (1 s short of it: a wait
        # there may not run into the fault)
        quiet = bool(faults) and warm_at < faults[0].at
        window = (warm_at, faults[0].at - 1.0) if quiet else None
        baseline = worst_stall(outcomes, *window) if window else None
        answer = worst_answer(outcomes, *window) if window else None  # a whole answer's own time there
        say(f"chaos: load stopped after {time.time() - started:.0f} s; checking the log and the lag")
        _timeline(root / "timeline.jsonl", started, faults, outcomes)
        answers = await read_answers(system.stack.kafka.address, {o.rid for o in outcomes}, started - 5)
        senders = [*users, probe]
        report = Report(
            time.time() - started,
            faults,
            judge(outcomes, answers),
            every_s=every_s,
            refused=sum(c.refused for c in senders),
            unacknowledged=sum(c.unacknowledged for c in senders),
            resumes=sum(o.resumes for o in outcomes),
            logs=str(root),
            baseline_stall_s=baseline,
            baseline_answer_s=answer,
        )
        behind: list[str] = []
        report.lag_left = await drained(system.stack.kafka.address, _groups(), timeout=90, behind=behind)
        if behind:  # which partitions, for the logs' reader
            (root / "lag-left.txt").write_text("\n".join(behind) + "\n")
            say("chaos: partitions behind: " + "; ".join(behind))
        report.running_left = await _running(system)
        supervisor_stop.set()
        await supervisor
        return report


def _timeline(path: Path, started: float, faults: list[Fault], outcomes: list[Outcome]) -> None:
    """Every fault and every request on the drill's clock (seconds since its start), one JSON line each,
    beside the roles' logs: where a slow recovery's time went (sent, first frame, longest gap, end)."""

    def at(t: float | None) -> float | None:
        return None if t is None else round(t - started, 3)

    with path.open("w") as out:
        for f in faults:
            out.write(
                json.dumps({"fault": f.kind, "target": f.target, "at": at(f.at), "ended": at(f.ended_at)})
                + "\n"
            )
        for o in sorted(outcomes, key=lambda o: o.sent):
            gaps = [(b - a, a) for a, b in zip([o.sent, *o.arrivals], o.arrivals)]
            gap, gap_at = max(gaps) if gaps else (None, None)
            out.write(
                json.dumps(
                    {
                        "request": o.rid,
                        "sent": at(o.sent),
                        "first": at(o.arrivals[0] if o.arrivals else None),
                        "finished": at(o.finished_at),
                        "frames": len(o.arrivals),
                        "resumes": o.resumes,
                        "longest_wait": gap and round(gap, 3),
                        "waited_from": at(gap_at),
                    }
                )
                + "\n"
            )


def _http(key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(60, connect=5), headers={"Authorization": f"Bearer {key}"})


async def _user(client: Client, index: int, outcomes: list[Outcome], stop: asyncio.Event, key: str) -> None:
    async with _http(key) as http:
        for n in itertools.count():
            if stop.is_set():
                return
            outcome = await client.request(http, f"User {index}, question {n}: name a fruit and a colour.")
            if outcome is None:
                await asyncio.sleep(0.5)  # refused: back off a little, like a client honouring Retry-After
            else:
                outcomes.append(outcome)


async def _probe(client: Client, n: int, outcomes: list[Outcome], key: str) -> None:
    async with _http(key) as http:
        outcome = await client.request(http, f"Probe {n}: name a fruit and a colour.")
    if outcome is not None:
        outcomes.append(outcome)


async def _first_answer(outcomes: list[Outcome], timeout: float) -> float:
    """When the first answer completed (the faults' clock starts then: until the system is warm,
    a wait measures its start-up, not a fault)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [o.finished_at for o in outcomes if o.finished_at]
        if done:
            return min(done)
        await asyncio.sleep(0.25)
    return time.time()


async def _inject(
    system,
    users: list[Client],
    schedule: tuple[str, ...],
    every_s: float,
    stall_s: float,
    roles: tuple[str, ...],
    say,
    send_probe,
    *,
    freeze_s: float,
) -> list[Fault]:
    """Each fault of `schedule` in turn, one every `every_s` from the end of the one before: a broker
    restart that lasts (tens of seconds on a loaded host) moves the rest later rather than firing the
    faults it held up at once (three kills within a second right after the broker came back left
    both workers down together for over a minute, harsher than the cadence the drill states)."""
    faults: list[Fault] = []
    turn = itertools.cycle(roles)
    brokers_hit = 0
    next_at = time.monotonic() + every_s
    for kind in schedule:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        if kind == "kill":
            proc = random.choice(system.of_role(next(turn)))
            fault = Fault("kill -9", proc.name, time.time())
            system.kill9(proc.name)  # the supervisor starts it again
        elif kind == "freeze":
            proc = random.choice(system.of_role(next(turn)))
            fault = Fault("freeze", proc.name, time.time())
            await system.freeze(proc.name, freeze_s)
        elif kind == "broker":
            fault = Fault("broker", "kafka", time.time())
            fault.kind, fault.target = await broker_fault(system.stack.kafka, brokers_hit)
            brokers_hit += 1
        else:
            victim = random.choice(users)
            victim.stall_next_s = stall_s
            fault = Fault("client stall", f"{stall_s:.0f} s", time.time())
        fault.ended_at = time.time()
        send_probe()
        next_at = time.monotonic() + every_s
        faults.append(fault)
        lasted = f" (over after {fault.ended_at - fault.at:.0f} s)" if fault.ended_at - fault.at >= 1 else ""
        say(f"chaos: {fault.kind} {fault.target} at +{fault.at - faults[0].at:.0f} s{lasted}")
    return faults


async def _until_recovered(faults: list[Fault], outcomes: list[Outcome], timeout: float) -> None:
    """Keep the load on until every fault has been recovered from (a request sent after it ended
    was answered in full), or `timeout`: a fixed tail after the last fault (it was 15 s) left the
    last faults of a run on a loaded host without a request sent after them, so "not recovered"."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _recoveries(faults, outcomes)
        if all(f.recovered_at is not None for f in faults):
            return
        await asyncio.sleep(1.0)


def _recoveries(faults: list[Fault], outcomes: list[Outcome]) -> None:
    """A fault is recovered from when a request sent after it ended has been answered in full. The
    drill sends one the moment each fault ends (`_probe`): before it did, the figure also held however
    long the clients, all busy with answers in flight, took to send their next request (3.3 s of a
    7.3 s "recovery" from a router kill whose takeover was long over). The whole answer's time is
    in that figure too (3-5 s for 24 tokens on a loaded 2-core host), so the earliest first token of
    such a request is kept beside it: when the pipeline served again."""
    for fault in faults:
        after = [o for o in outcomes if o.sent >= fault.ended_at]
        done = [o.finished_at for o in after if o.done and o.finished_at]
        fault.recovered_at = min(done) if done else None
        firsts = [o.arrivals[0] for o in after if o.arrivals]
        fault.served_at = min(firsts) if firsts else None


def worst_stall(outcomes: list[Outcome], start: float, end: float) -> float | None:
    """The longest wait for a next frame of any request in flight at `start` or sent before `end`
    (each counted from `start` or from its sending, whichever is later); None when there was none."""
    waits = [w for o in outcomes if o.sent < end and (w := o.wait_from(start)) is not None]
    return max(waits) if waits else None


def _stalls(faults: list[Fault], outcomes: list[Outcome]) -> None:
    """Each kill's and broker fault's stall: the worst wait of a request in flight when it struck or
    sent before half the time from its end to the next fault has passed (a new request whose
    partition the dead process held waits for the takeover too)."""
    for i, fault in enumerate(faults):
        if fault.kind == "client stall":  # there the client itself stops reading
            continue
        until = faults[i + 1].at if i + 1 < len(faults) else time.time()
        fault.stall_s = worst_stall(outcomes, fault.at, fault.ended_at + (until - fault.ended_at) / 2)


def worst_answer(outcomes: list[Outcome], start: float, end: float) -> float | None:
    """The longest time from sending to the whole answer of a request sent at `start` or later and
    answered before `end`: what a recovery, counted to a whole answer, holds beside the fault's own."""
    times = [
        o.finished_at - o.sent
        for o in outcomes
        if o.done and o.finished_at and start <= o.sent and o.finished_at < end
    ]
    return max(times) if times else None


def _groups() -> list[tuple[str, str]]:
    """Every (consumer group, topic) the registry names for a system serving smollm2."""
    from topics.registry import all_topics

    return [(group, spec.name) for spec in all_topics(["smollm2"]) for group in spec.groups]


async def _running(system, timeout: float = 30.0) -> float:
    """Requests the workers are still generating, once it reaches 0 or after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        total = 0.0
        for proc in system.of_role("worker"):
            try:
                text = (await asyncio.to_thread(httpx.get, proc.probe, timeout=5)).text
            except httpx.HTTPError:
                total += 1  # a worker that does not answer may still hold requests
                continue
            for line in text.splitlines():
                if line.startswith("vllm:num_requests_running"):
                    total += float(line.rsplit(" ", 1)[1])
        if total == 0 or time.monotonic() > deadline:
            return total
        await asyncio.sleep(1.0)
