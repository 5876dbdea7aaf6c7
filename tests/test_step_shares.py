"""The processors' read of step records (schemas/steps.py): `typed` hands an agent each entry with a share
of the step record's faust event (processors/shares.py), acknowledged once its last entry is; an agent
that wants no chunk never opens one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from processors.faust_app import traced, typed
from processors.safety.held import HeldWindows
from processors.safety.windows import WindowSettings, fold
from processors.shares import Share, shares
from schemas import Completion, DeadLetter, TokenChunk, TraceContext, decode, encode
from schemas.headers import EVENT_TYPE
from schemas.steps import STEP_HEADERS, entry, step_value, unpack
from topics import TOKENS

APP = SimpleNamespace(conf=SimpleNamespace(id="ts-test"))


class Event:
    """A faust event as `typed` reads it: its message (a Kafka record) and value; counts its acks."""

    def __init__(self, value: bytes, headers=(), offset: int = 7) -> None:
        self.value, self.app, self.acks = value, APP, 0
        self.message = SimpleNamespace(
            topic=TOKENS.name,
            partition=3,
            offset=offset,
            timestamp=0,
            timestamp_type=0,
            key=b"",
            value=value,
            headers=list(headers),
            generation_id=5,
        )

    def ack(self) -> bool:
        self.acks += 1
        return True


def chunk(request_id: str, seq: int) -> TokenChunk:
    return TokenChunk(
        request_id=request_id, seq=seq, text=f"{request_id}{seq} ", token_ids=[1], created_at=1.0
    )


def step(*entries) -> Event:
    """A step record of `entries`: events, or (key, value bytes) pairs."""
    items = [entry(e.request_id, encode(e)) if hasattr(e, "request_id") else entry(*e) for e in entries]
    return Event(step_value(items), STEP_HEADERS)


def stream_of(events: list[Event], manual: bool = True):
    async def read():
        for event in events:
            yield event

    return SimpleNamespace(enable_acks=not manual, app=APP, events=read)


def dead_letters(letters: list[DeadLetter]):
    async def send(**kw):
        letters.append(decode(kw["value"], DeadLetter))
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    return SimpleNamespace(send=send, app=APP)


def test_a_step_is_acknowledged_once_after_its_last_entry_is():
    raw = step(chunk("a", 0), chunk("b", 0), chunk("c", 0))
    a, b, c = shares(raw, unpack(raw.message))
    assert not b.ack() and not a.ack() and raw.acks == 0
    assert not a.ack() and raw.acks == 0  # an entry acknowledged twice counts once
    assert c.ack() and raw.acks == 1  # the last: the faust event's own ack, what it returned
    assert not c.ack() and not b.ack() and raw.acks == 1
    assert a.message is raw.message and a.app is APP and a.message.generation_id == 5  # the step's own
    assert (a.key, b.key) == (b"a", b"b") and decode(b.value, TokenChunk) == chunk("b", 0)  # the entry's


async def test_typed_yields_each_entry_in_order_and_dead_letters_a_bad_one_by_its_step():
    trace = TraceContext.new()
    first = step(
        ("a", encode(chunk("a", 0)), trace.headers()),
        ("x", b'{"type": "nope"}'),  # JSON (as every entry is), not an event
        chunk("b", 0),
    )
    done = Event(
        encode(Completion(request_id="a", seq=1, finish_reason="stop", created_at=1.0)),
        [(EVENT_TYPE, b"completion")],
    )
    broken = Event(b"[not a step", STEP_HEADERS, offset=9)
    newer = Event(b'{"v": 99, "entries": []}', STEP_HEADERS, offset=10)
    letters: list[DeadLetter] = []
    wants = (TokenChunk, Completion)
    got = [
        pair
        async for pair in typed(
            stream_of([first, done, broken, newer]), {TOKENS.name: TOKENS}, dead_letters(letters), wants=wants
        )
    ]
    assert [e for e, _ in got] == [chunk("a", 0), chunk("b", 0), decode(done.value, Completion)]
    (_, a), (_, b), (_, end) = got
    assert isinstance(a, Share) and isinstance(b, Share) and end is done
    with traced(a, "screen_output") as span:  # a child of the entry's own trace, at the step's place
        assert span.trace.trace_id == trace.trace_id
    bad, whole, unknown = letters
    assert (bad.source_topic, bad.source_partition, bad.source_offset) == (TOKENS.name, 3, 7)
    assert bad.key == b"x" and bad.payload == b'{"type": "nope"}' and bad.request_id == "x"
    assert (whole.source_offset, whole.payload) == (9, b"[not a step")  # a step that does not parse: whole
    assert unknown.error_type == "UnsupportedVersion" and unknown.source_offset == 10
    assert (
        broken.acks == newer.acks == 1 and first.acks == 0
    )  # the bad entry counts as acknowledged; two wait
    a.ack()
    assert first.acks == 0
    b.ack()
    assert first.acks == 1


async def test_an_agent_that_wants_no_chunk_passes_a_step_over_unopened():
    never = Event(b"not even json", STEP_HEADERS)  # opened, it would be dead-lettered
    done = Completion(request_id="a", seq=1, finish_reason="stop", created_at=1.0)
    letters: list[DeadLetter] = []
    records = [never, Event(encode(done), [(EVENT_TYPE, b"completion")])]
    stream = stream_of(records)
    got = [
        e async for e, _ in typed(stream, {TOKENS.name: TOKENS}, dead_letters(letters), wants=(Completion,))
    ]
    assert got == [done] and not letters and never.acks == 1


async def test_a_step_is_acknowledged_only_once_every_answer_in_it_is_checkpointed():
    """The safety processor's rule (processors/safety/held.py) over a step holding two answers' chunks:
    one checkpointed does not acknowledge the step while the other's window is held in memory only."""
    cfg = WindowSettings(every_tokens=100, checkpoint_chunks=100)
    table: dict = {}
    windows = HeldWindows(table, cfg, lambda: 1)
    raw = step(chunk("a", 0), chunk("b", 0))
    records = [pair async for pair in typed(stream_of([raw]), {TOKENS.name: TOKENS}, dead_letters([]))]
    for event, share in records:
        held = await windows.take(event)
        held.window = fold(held.window, event, cfg)
        await windows.hold(event.request_id, held, share, event.seq)
    await windows.checkpoint("a", windows.held["a"])
    assert b"a" in table and raw.acks == 0  # b's chunk is in memory only: the step is not committed past
    await windows.checkpoint("b", windows.held["b"])
    assert b"b" in table and raw.acks == 1
