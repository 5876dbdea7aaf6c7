"""The processors' decisions: history merging, trimming with the real tokenizer, routing, windows, the
acknowledgements held windows hold back, and the records an agent passes over unopened."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from types import SimpleNamespace

import pytest

from common.models import load_tokenizer
from processors.conversation.history import bounded, carries_full_history, merge, with_answer
from processors.conversation.presets import apply_preset
from processors.conversation.presets import presets as configured_presets
from processors.conversation.window import PromptTooLong, prompt_counter, trim
from processors.faust_app import typed
from processors.router.config import Route
from processors.router.policy import decide, weighted_pick
from processors.safety.batch import batches
from processors.safety.held import HeldWindows
from processors.safety.watch import OutputWatch
from processors.safety.windows import WindowSettings, due, fold, judged
from safety_model.classifier import Judgement
from schemas import (
    ChatMessage,
    Completion,
    DeadLetter,
    FunctionSpec,
    OutputSpec,
    OutputWindow,
    SamplingParams,
    TokenChunk,
    ToolSpec,
    decode,
    encode,
)
from schemas.headers import EVENT_TYPE
from topics import TOKENS


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


def bot(text: str) -> ChatMessage:
    return ChatMessage(role="assistant", content=text)


SYSTEM = ChatMessage(role="system", content="Be brief.")


def test_new_turn_is_appended_to_the_stored_history():
    history = [SYSTEM, user("a"), bot("b")]
    assert merge(history, [user("c")]) == [SYSTEM, user("a"), bot("b"), user("c")]
    new_system = ChatMessage(role="system", content="Be verbose.")
    assert merge(history, [new_system, user("c")]) == [new_system, user("a"), bot("b"), user("c")]


def test_a_full_history_replaces_what_is_stored():
    full = [user("x"), bot("y"), user("z")]
    assert carries_full_history(full) and not carries_full_history([SYSTEM, user("z")])
    assert merge([SYSTEM, user("a"), bot("b")], full) == full


def test_an_answer_is_appended_or_the_unanswered_turn_dropped():
    done = Completion(request_id="r", seq=3, finish_reason="stop", text="hi")
    assert with_answer([user("a")], done) == [user("a"), bot("hi")]
    empty = Completion(request_id="r", seq=0, finish_reason="error")
    assert with_answer([SYSTEM, user("a")], empty) == [SYSTEM]
    assert bounded([SYSTEM, *[user(str(i)) for i in range(10)]], 3) == [
        SYSTEM,
        user("7"),
        user("8"),
        user("9"),
    ]


def test_presets_set_system_prompt_and_sampling():
    presets = configured_presets()
    messages, model, sampling = apply_preset(
        presets["coder"], [SYSTEM, user("sort a list")], "smollm2", SamplingParams(temperature=1.0)
    )
    assert (
        messages[0].role == "system"
        and "Python" in messages[0].content
        and messages[1:] == [user("sort a list")]
    )
    assert model == "smollm2" and sampling.temperature == 0.0 and sampling.max_tokens == 512


@pytest.fixture(scope="module")
def count():
    return prompt_counter(load_tokenizer("smollm2"), OutputSpec())


def test_trim_keeps_system_and_newest_turns_within_budget(count):
    turns = []
    for i in range(20):
        turns += [user(f"question number {i} about something"), bot(f"answer number {i} " * 5)]
    messages = [SYSTEM, *turns, user("last")]
    full = count(messages)
    kept, dropped = trim(messages, count, full // 2)
    assert count(kept) <= full // 2 and dropped > 0
    assert kept[0] == SYSTEM and kept[-1] == user("last") and kept[1].role == "user"
    assert kept[1:] == messages[1 + dropped :]
    assert count([SYSTEM, *messages[1 + dropped - 2 :]]) > full // 2  # the cut is as late as it must be
    assert trim(messages, count, full) == (messages, 0)


def test_trim_counts_no_tokens_when_the_bytes_prove_the_prompt_fits(count):
    def never(_messages):
        raise AssertionError("a chat-template pass for a prompt that surely fits")

    messages = [SYSTEM, user("What is the capital of France?")]
    assert trim(messages, never, 200) == (messages, 0)
    assert count(messages) < 200


def test_trim_refuses_when_even_the_newest_message_does_not_fit(count):
    with pytest.raises(PromptTooLong):
        trim([SYSTEM, user("word " * 500)], count, 50)


def test_trim_counts_the_tools_the_worker_renders_into_the_prompt(count):
    tools = OutputSpec(
        tools=[
            ToolSpec(function=FunctionSpec(name=f"tool_{i}", description="does a thing " * 10))
            for i in range(3)
        ]
    )
    with_tools = prompt_counter(load_tokenizer("smollm2"), tools)
    turns = [m for i in range(10) for m in (user(f"question {i} about something"), bot(f"answer {i} " * 5))]
    messages = [SYSTEM, *turns, user("last")]
    budget = count(messages)  # fits without the tools, not with them
    assert with_tools(messages) > budget and trim(messages, count, budget) == (messages, 0)
    kept, dropped = trim(messages, with_tools, budget)
    assert dropped > 0 and with_tools(kept) <= budget and kept[-1] == user("last")
    with pytest.raises(PromptTooLong, match="tools"):
        trim([SYSTEM, user("last")], with_tools, count([SYSTEM, user("last")]))


def test_weighted_pick_is_deterministic_and_follows_the_weights():
    weights = {"stable": 0.9, "canary": 0.1}
    ids = [uuid.uuid4().hex for _ in range(4000)]
    picks = Counter(weighted_pick(i, weights) for i in ids)
    assert 0.08 < picks["canary"] / len(ids) < 0.12
    assert [weighted_pick(i, weights) for i in ids[:50]] == [weighted_pick(i, weights) for i in ids[:50]]
    assert {weighted_pick(i, {"only": 1.0, "off": 0.0}) for i in ids[:100]} == {"only"}


def test_decide_tier_first_then_weights_then_overflow():
    route = Route(weights={"big": 1.0}, fallback="small", tiers={"free": "small"})
    assert decide("r", "big", route, "free", {}, 5).target == "small"
    assert decide("r", "big", route, "standard", {"big": 1, "small": 1}, 5).reason == "weights"
    over = decide("r", "big", route, "standard", {"big": 50, "small": 1}, 5)
    assert (over.target, over.reason) == ("small", "overflow")
    both = decide("r", "big", route, "standard", {"big": 50, "small": 50}, 5)
    assert both.target == "big"  # the fallback is no better: stay
    assert decide("r", "m", None, "standard", {}, 5).target == "m"


def test_overflow_keeps_the_fallbacks_last_room_for_higher_tiers():
    route = Route(fallback="small")
    waits = {"big": 50, "small": 3}  # primary over the 5 s budget, fallback more than half full
    assert decide("r", "big", route, "paid", waits, 5, priority=1).target == "small"
    assert decide("r", "big", route, "free", waits, 5, priority=0).target == "big"
    assert decide("r", "big", route, "free", {"big": 50, "small": 1}, 5, priority=0).target == "small"


def test_output_window_folds_each_chunk_once_and_judges_every_n_tokens():
    cfg = WindowSettings(every_tokens=4, overlap_chars=5)
    w = OutputWindow(request_id="r")
    for seq, text in enumerate(["ab", "cd", "ef"]):
        w = fold(w, TokenChunk(request_id="r", seq=seq, text=text, token_ids=[1]), cfg)
    assert fold(w, TokenChunk(request_id="r", seq=1, text="cd", token_ids=[1]), cfg) is None  # replay
    assert not due(w, cfg) and due(w, cfg, final=True)
    w = fold(w, TokenChunk(request_id="r", seq=3, text="gh", token_ids=[1]), cfg)
    assert due(w, cfg) and w.text == "abcdefgh"
    after = judged(w, cfg, blocked=False, scores={"violence": 0.2, "hate": 0.1})
    assert after.text == "defgh" and after.pending_tokens == 0
    later = judged(after, cfg, blocked=False, scores={"violence": 0.05, "hate": 0.3})
    assert later.peak == {"violence": 0.2, "hate": 0.3}  # each category's highest, for a moderated answer
    assert not due(judged(w, cfg, blocked=True), cfg, final=True)


class Record:
    """A faust event as an agent sees it: a message (topic, partition, offset, key, headers), a value,
    and an acknowledgement."""

    def __init__(self, value: bytes, headers=(), offset: int = 0) -> None:
        self.value, self.acked = value, False
        self.message = SimpleNamespace(
            topic=TOKENS.name, partition=0, offset=offset, key=b"r", headers=list(headers)
        )

    def ack(self) -> bool:
        self.acked = True
        return True


async def test_a_held_window_is_acknowledged_only_once_its_checkpoint_covers_it():
    cfg = WindowSettings(every_tokens=100, checkpoint_chunks=3, checkpoint_s=2.0, held_windows=2)
    table: dict = {}
    generation = [1]
    windows = HeldWindows(table, cfg, lambda: generation[0])

    def chunk(request_id: str, seq: int) -> tuple[TokenChunk, Record]:
        return TokenChunk(request_id=request_id, seq=seq, text=f"{seq} ", token_ids=[1]), Record(b"")

    async def feed(request_id: str, seq: int) -> Record:
        event, raw = chunk(request_id, seq)
        held = await windows.take(event)
        folded = fold(held.window, event, cfg)
        if folded is not None:
            held.window = folded
        await windows.hold(request_id, held, raw, seq)
        return raw

    first = [await feed("a", 0), await feed("a", 1)]
    assert not any(r.acked for r in first) and b"a" not in table  # in memory only, nothing acknowledged
    await windows.checkpoint("a", await windows.take(chunk("a", 1)[0]))  # as after a judgement
    assert all(r.acked for r in first) and decode(table[b"a"], OutputWindow).text == "0 1 "
    assert (await feed("a", 1)).acked  # a replay the checkpoint covers: at once
    pending = await feed("a", 2)
    replayed = await feed("a", 2)
    assert not replayed.acked and not pending.acked  # a replay of what only memory holds: held back
    assert await windows.overdue(now=windows.held["a"].since + 1.0) == 0
    assert await windows.overdue(now=windows.held["a"].since + 2.0) == 1 and pending.acked  # the time bound
    three = [await feed("b", seq) for seq in range(3)]
    assert all(r.acked for r in three) and decode(table[b"b"], OutputWindow).last_seq == 2  # the count bound
    held_c = await feed("c", 0)  # a third window: the least recently used ("a") is checkpointed and let go
    assert list(windows.held) == ["b", "c"] and not held_c.acked
    done = Record(b"")
    await windows.end("c", await windows.take(Completion(request_id="c", seq=1, finish_reason="stop")), done)
    assert held_c.acked and done.acked and b"c" not in table  # the answer's end deletes its row
    stale = await feed("b", 3)
    generation[0] = 2  # a rebalance: the window held in generation 1 is dropped unwritten
    assert (await windows.take(chunk("b", 4)[0])).window.last_seq == 2 and not stale.acked
    assert decode(table[b"b"], OutputWindow).last_seq == 2


async def test_a_checkpoint_waiting_for_its_key_never_writes_over_a_later_one(monkeypatch):
    from processors.safety import held as held_module

    cfg = WindowSettings(every_tokens=100, checkpoint_chunks=100, checkpoint_s=1.0)
    table: dict = {}
    windows = HeldWindows(table, cfg, lambda: 1)
    sealed, gate, waiting = held_module._sealed, asyncio.Event(), []

    async def slowly(window: OutputWindow) -> bytes:  # the first row's key is fetched slowly
        if not waiting:
            waiting.append(window)
            await gate.wait()
        return await sealed(window)

    monkeypatch.setattr(held_module, "_sealed", slowly)
    held = await windows.take(TokenChunk(request_id="a", seq=0, text="x", token_ids=[1]))
    raws = [Record(b""), Record(b"")]
    for seq in (0, 1):
        held.window = fold(
            held.window, TokenChunk(request_id="a", seq=seq, text=f"{seq} ", token_ids=[1]), cfg
        )
        await windows.hold("a", held, raws[seq], seq)
        if seq == 0:
            timer = asyncio.create_task(windows.overdue(now=held.since + 1.0))
            while not waiting:
                await asyncio.sleep(0)
            assert b"a" not in table and not raws[0].acked  # the timer's checkpoint waits for its key
    await windows.checkpoint("a", held)  # asked for later, written first
    gate.set()
    assert await timer == 1
    assert decode(table[b"a"], OutputWindow).text == "0 1 " and held.checkpointed_seq == 1
    assert all(r.acked for r in raws) and not held.pending


async def test_typed_passes_over_records_of_unwanted_types_unopened():
    letters: list[bytes] = []

    async def send(**kw):
        letters.append(kw["value"])
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    app = SimpleNamespace(conf=SimpleNamespace(id="ts-test"))
    dead_letters = SimpleNamespace(send=send, app=app)
    completion = Completion(request_id="r", seq=1, finish_reason="stop")
    records = [
        Record(b"not an event", [(EVENT_TYPE, b"token_chunk")]),  # named another type: never opened
        Record(encode(completion), [(EVENT_TYPE, b"completion")]),
        Record(encode(TokenChunk(request_id="r", seq=0, text="x"))),  # no header: decoded, passed over
        Record(b"not an event either"),  # no header, malformed: dead-lettered as before
    ]

    async def events():
        for record in records:
            yield record

    stream = SimpleNamespace(enable_acks=False, app=app, events=events)
    got = [e async for e, _ in typed(stream, {TOKENS.name: TOKENS}, dead_letters, wants=(Completion,))]
    assert got == [completion]
    assert letters and decode(letters[0], DeadLetter).payload == b"not an event either"
    assert [r.acked for r in records] == [True, False, True, True]  # the agent acknowledges what it is given


class Output:
    """The output check's effects as a unit sees them: a classifier that counts its calls, the verdicts
    sent, the answers ended."""

    def __init__(self, cfg: WindowSettings, current=lambda raw: True) -> None:
        self.table: dict = {}
        self.calls: list[list[str]] = []
        self.sent: list[tuple[str, int, str, bool]] = []  # (answer, last chunk, window text, blocked)
        self.ended: list[str] = []
        windows = HeldWindows(self.table, cfg, lambda: 1)
        self.watch = OutputWatch(windows, cfg, self.judge, self.screen, self.end, current)

    async def judge(self, texts: list[str]) -> list[Judgement]:
        self.calls.append(texts)
        flagged = [["violence"] if "bad" in t else [] for t in texts]
        return [Judgement(bool(f), f, {"violence": float(bool(f))}, "p1") for f in flagged]

    async def screen(self, event, window: OutputWindow, raw, result: Judgement) -> None:
        self.sent.append((event.request_id, window.last_seq, window.text, result.blocked))

    async def end(self, done: Completion, window: OutputWindow, raw) -> None:
        self.ended.append(done.request_id)


def answers(*chunks: tuple[str, int, str]) -> list[tuple[TokenChunk | Completion, Record]]:
    """(answer, seq, text) in order; text None: the answer's Completion."""
    return [
        (
            Completion(request_id=r, seq=seq, finish_reason="stop")
            if text is None
            else TokenChunk(request_id=r, seq=seq, text=text, token_ids=[1]),
            Record(b"", offset=i),
        )
        for i, (r, seq, text) in enumerate(chunks)
    ]


async def test_windows_due_in_one_batch_are_judged_in_one_call_each_on_its_own_text_in_order():
    cfg = WindowSettings(every_tokens=4, overlap_chars=3, checkpoint_chunks=100)
    chunks = [("a", s, f"{s}a ") for s in range(4)] + [("b", s, f"{s}b ") for s in range(4)]
    chunks += [("a", 2, "2a "), ("a", 4, "4a "), ("b", 4, None)] + [("a", s, f"{s}a ") for s in range(5, 9)]
    chunks += [("a", 9, None)]  # "a" due at chunks 3 and 7, and at its end; "b" at chunk 3
    batched, serial = Output(cfg), Output(cfg)
    records = answers(*chunks)
    await batched.watch.batch(records)
    for event, _ in answers(*chunks):
        await serial.watch.batch([(event, Record(b""))])
    assert batched.sent == [
        ("a", 3, "0a 1a 2a 3a ", False),
        ("b", 3, "0b 1b 2b 3b ", False),
        ("a", 7, "3a 4a 5a 6a 7a ", False),  # the overlap kept from the window before, then its own text
        ("a", 8, "7a 8a ", False),
    ]
    assert batched.calls == [[text for _, _, text, _ in batched.sent]] and batched.watch.calls == 1
    assert serial.sent == batched.sent and len(serial.calls) == 4  # the same verdicts as one at a time
    assert batched.ended == serial.ended == ["b", "a"] and batched.table == serial.table == {}
    assert all(raw.acked for _, raw in records)


async def test_a_window_after_a_block_in_the_same_batch_gets_no_verdict():
    cfg = WindowSettings(every_tokens=2, overlap_chars=0, checkpoint_chunks=100)
    out = Output(cfg, current=lambda raw: raw.message.offset != 4)  # the 5th: of an earlier generation
    records = answers(("c", 0, "bad "), ("c", 1, "x "), ("c", 2, "y "), ("c", 3, "z "), ("d", 0, "ok "))
    await out.watch.batch(records)
    assert out.calls == [["bad x ", "y z "]]  # judged ahead as if allowed
    assert out.sent == [("c", 1, "bad x ", True)]  # as one at a time: a blocked answer is judged no more
    held = out.watch.windows.held["c"]
    assert held.window.blocked and held.window.text == "y z " and held.checkpointed_seq == 1
    assert [raw.acked for _, raw in records] == [True, True, False, False, True]  # the rule (held.py)
    assert "d" not in out.watch.windows.held  # the stale record: acknowledged unhandled (delivery refuses it)


async def test_batches_hand_over_what_was_read_meanwhile_then_an_error():
    feed: asyncio.Queue = asyncio.Queue()

    async def items():
        while (item := await feed.get()) != "boom":
            yield item
        raise RuntimeError("boom")

    async with contextlib.aclosing(batches(items(), 3)) as read:
        each = aiter(read)
        feed.put_nowait(1)
        assert await anext(each) == [1]  # the first waited for
        for item in (2, 3, 4, 5):
            feed.put_nowait(item)
        while not feed.empty():  # the reader runs ahead while the batch is handled
            await asyncio.sleep(0)
        assert await anext(each) == [2, 3, 4]  # at most 3
        assert await anext(each) == [5]
        feed.put_nowait("boom")
        with pytest.raises(RuntimeError, match="boom"):
            await anext(each)
