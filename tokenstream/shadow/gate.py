"""The shadow gate: conditions on a shadow evaluation's figures, its record on ts.shadow.gates, and the
check `tokenstream route set` makes before a candidate gets any traffic.

A condition is `<figure><op><number>` with op one of >= <= > < (e.g. `agreement>=0.9`,
`safety_changes<=0`); a figure the evaluation could not compute fails its condition.
"""

from __future__ import annotations

import operator
import re
import uuid

from aiokafka.structs import TopicPartition

from producers import decode_record, publish, start_consumer, start_producer
from producers.consume import caught_up
from schemas import DecodeError, ShadowGate
from tokenstream.shadow.compare import FIGURES
from topics import SHADOW_GATES

CONDITION = re.compile(r"^\s*([a-z_]+)\s*(>=|<=|>|<)\s*(-?[0-9.]+)\s*$")
OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


def parse(condition: str) -> tuple[str, str, float]:
    """(figure, op, number) of a condition; ValueError naming what is wrong."""
    match = CONDITION.match(condition)
    if match is None:
        raise ValueError(f"{condition!r}: expected FIGURE>=NUMBER (or <=, >, <)")
    name, op, number = match.groups()
    if name not in FIGURES:
        raise ValueError(f"{condition!r}: no figure {name!r} (one of {', '.join(FIGURES)})")
    return name, op, float(number)


def failed(conditions: list[str], figures: dict[str, float]) -> list[str]:
    """The conditions the figures do not meet."""
    out = []
    for condition in conditions:
        name, op, number = parse(condition)
        if name not in figures or not OPS[op](figures[name], number):
            out.append(condition)
    return out


async def record(bootstrap: str, gate: ShadowGate) -> None:
    producer = await start_producer(bootstrap)
    try:
        await publish(producer, SHADOW_GATES, gate, key=gate.candidate)
    finally:
        await producer.stop()


def new_gate(**fields) -> ShadowGate:
    return ShadowGate(request_id=f"shadow-{uuid.uuid4().hex[:12]}", **fields)


async def latest(bootstrap: str | None = None) -> dict[str, ShadowGate]:
    """Each candidate's latest gate (the compacted topic read from its beginning to its end)."""
    consumer = await start_consumer(group=None, bootstrap=bootstrap, from_beginning=True)
    try:
        tps = [TopicPartition(SHADOW_GATES.name, p) for p in range(SHADOW_GATES.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends, gates = await consumer.end_offsets(tps), {}
        while not await caught_up(consumer, ends):
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for r in records:
                    try:
                        gate = decode_record(r, SHADOW_GATES)
                    except DecodeError:
                        continue
                    gates[gate.candidate] = gate
        return gates
    finally:
        await consumer.stop()


def refusal(model: str, targets: list[str], gates: dict[str, ShadowGate]) -> str | None:
    """Why a route of `model` to `targets` may not be set, or None: every target other than the requested
    model needs a passed gate of an evaluation against that model."""
    for target in targets:
        if target == model:
            continue
        gate = gates.get(target)
        if gate is None:
            return (
                f"{target} has no shadow evaluation: run `tokenstream shadow --model {target} "
                f"--served {model} --since ... --require agreement>=0.9` first"
            )
        if gate.served != model:
            return f"{target}'s latest shadow evaluation was against {gate.served}, not {model}"
        if not gate.passed:
            return (
                f"{target}'s latest shadow evaluation ({gate.request_id}) failed its gate "
                f"({', '.join(gate.require)}): " + ", ".join(f"{k} {v:.3g}" for k, v in gate.figures.items())
            )
    return None
