"""Pure pieces of the gateway, no broker: bounded buffers, coalescing, resumable ids and frames."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.fanout import SlowReader, Stream
from gateway.framing import Framer
from gateway.resume import NOTHING_SEEN, new_request_id, parse_last_event_id, parse_request_id
from schemas import Completion, TokenChunk, Usage, call_id


def parsed(frame: bytes) -> tuple[str | None, str]:
    """(id, data) of one SSE frame as gateway/sse.py writes it."""
    fields = dict(line.split(": ", 1) for line in frame.decode().split("\r\n") if ": " in line)
    return fields.get("id"), fields["data"]


def chunk(seq: int, text: str = "x") -> TokenChunk:
    return TokenChunk(request_id="r", seq=seq, text=text)


async def test_stream_is_bounded_and_coalesces_then_refuses_and_a_dropped_one_ends_after_its_events():
    s = Stream("r", capacity=3, coalesce_chars=5)
    assert all(s.offer(chunk(i, "ab")) for i in range(3))
    assert s.offer(chunk(3, "cd")) and s.offer(chunk(4, "ef"))  # merged into the tail: "abcdef"
    assert len(s.items) == 3 and s.items[-1].text == "abcdef" and s.items[-1].seq == 4
    assert not s.offer(chunk(5, "gh"))  # tail is full: refused, the fan-out drops the stream
    assert s.offer(Completion(request_id="r", seq=5, finish_reason="stop"))  # cannot merge: appended
    assert s.offer(chunk(0, "a")) and s.offer(chunk(1, "b"))  # a run's next step: appended, then merged
    assert s.offer(Completion(request_id="r", seq=2, finish_reason="stop"))
    assert len(s.items) == 6 and not s.offer(Completion(request_id="r", seq=3, finish_reason="stop"))
    batch = await s.take()
    assert [e.seq for e in batch] == [0, 1, 4, 5, 1, 2] and not s.items
    assert await s.take(timeout=0.01) == []
    waiting = asyncio.create_task(s.take(timeout=5))
    await asyncio.sleep(0)
    s.offer(chunk(5, "gh"))
    assert [e.seq for e in await waiting] == [5]  # a waiting reader wakes at an offer
    s.offer(chunk(6, "ij"))
    s.drop()
    assert [e.seq for e in await s.take()] == [6]  # what it held first
    with pytest.raises(SlowReader):
        await s.take()


async def test_a_full_stream_merges_calls_and_logprobs_into_frames_a_client_reads_alike():
    """A slow reader's merged chunks frame to the same content, calls and log probabilities as the
    chunks one by one, each call's first entry (id, type, name, arguments "") standing alone."""
    from tests.test_schemas import _tool_chunks

    chunks = _tool_chunks()
    s = Stream("r", capacity=2, coalesce_chars=4096)
    assert all(s.offer(c) for c in chunks) and len(s.items) == 2 and s.coalesced == len(chunks) - 2
    merged = Framer("r", "m", 0, False, NOTHING_SEEN).frames(await s.take())
    fast = Framer("r", "m", 0, False, NOTHING_SEEN)
    one_by_one = [f for c in chunks for f in fast.frames([c])]
    assert len(merged) == 1 and len(one_by_one) == 6
    assert parsed(merged[-1])[0] == parsed(one_by_one[-1])[0] == "r:5"
    assert _read(merged) == _read(one_by_one)
    assert _read(merged)[1] == {
        0: {"id": call_id("r", 0), "type": "function", "name": "weather", "arguments": '{"city": "Oslo"}'},
        1: {"id": call_id("r", 1), "type": "function", "name": "time", "arguments": "{}"},
    }


def _read(frames) -> tuple[str, dict, list]:
    """What an OpenAI client assembles from chunk frames: content, calls by index, log probabilities."""
    content, calls, logprobs = "", {}, []
    for f in frames:
        choice = json.loads(parsed(f)[1])["choices"][0]
        content += choice["delta"].get("content") or ""
        logprobs += (choice["logprobs"] or {}).get("content", [])
        for entry in choice["delta"].get("tool_calls", []):
            if "id" in entry:  # a call's first entry names it and holds no arguments
                assert entry["index"] not in calls and entry["function"]["arguments"] == ""
                calls[entry["index"]] = {
                    "id": entry["id"],
                    "type": entry["type"],
                    "name": entry["function"]["name"],
                    "arguments": "",
                }
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    return content, calls, logprobs


def test_request_ids_name_partition_and_time():
    rid = new_request_id(7, 1700000000.123)
    assert parse_request_id(rid) == (7, 1700000000123)
    with pytest.raises(ValueError):
        parse_request_id("chatcmpl-whatever")
    assert parse_last_event_id(None, rid) == NOTHING_SEEN
    assert parse_last_event_id(f"{rid}:12", rid) == 12
    with pytest.raises(ValueError):
        parse_last_event_id("other:3", rid)


def frames_after(last: int, include_usage: bool = True) -> list[tuple[str, str]]:
    f = Framer("rid", "m", 0, include_usage, last)
    events = [
        chunk(0, "a"),
        chunk(1, " b"),
        chunk(1, " b"),
        chunk(2, " c"),
        Completion(
            request_id="r", seq=3, finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=3)
        ),
    ]
    out = f.start() + f.frames(events[:2]) + f.frames(events[2:])
    return [parsed(e) for e in out]


def text(frames) -> str:
    out = ""
    for _, data in frames:
        if data != "[DONE]":
            out += "".join(c["delta"].get("content") or "" for c in json.loads(data)["choices"])
    return out


def test_framer_positions_make_resume_exact():
    full = frames_after(NOTHING_SEEN)
    assert [i for i, _ in full] == ["rid:-1", "rid:1", "rid:2", "rid:3", "rid:4", "rid:5"]
    assert text(full) == "a b c" and full[-1][1] == "[DONE]"
    assert json.loads(full[-2][1])["usage"]["completion_tokens"] == 3
    for cut in range(len(full)):  # resume after any frame: the rest, nothing twice
        last = int(full[cut][0].split(":")[1])
        rest = frames_after(last)
        assert [i for i, _ in full[: cut + 1] + rest] == [i for i, _ in full]
        assert text(full[: cut + 1] + rest) == "a b c"


def test_framer_reports_generation_errors_in_band():
    f = Framer("rid", "m", 0, False, NOTHING_SEEN)
    out = f.frames([chunk(0), Completion(request_id="r", seq=1, finish_reason="error", error="boom")])
    assert json.loads(parsed(out[1])[1])["error"]["message"] == "boom" and parsed(out[-1])[1] == "[DONE]"


async def _events(*batches):
    for batch in batches:
        yield list(batch)


async def _drain(source) -> list:
    return [e for batch in [b async for b in source] for e in batch]


async def test_parallel_screening_holds_the_answer_until_the_input_verdict():
    from gateway.screening import held_until_screened
    from schemas import REFUSAL, SafetyVerdict

    passed = SafetyVerdict(request_id="r", stage="input", blocked=False)
    out = await _drain(
        held_until_screened(
            _events(
                [chunk(0, "a"), chunk(1, "b")],
                [passed, chunk(2, "c")],
                [Completion(request_id="r", seq=3, finish_reason="stop")],
            )
        )
    )
    assert [(type(e).__name__, e.seq) for e in out] == [
        ("TokenChunk", 0),
        ("TokenChunk", 1),
        ("TokenChunk", 2),
        ("Completion", 3),
    ]

    blocked = SafetyVerdict(request_id="r", stage="input", blocked=True, categories=["violence"])
    out = await _drain(held_until_screened(_events([chunk(0, "harm")], [chunk(1, "ful"), blocked, chunk(2)])))
    assert [e.text for e in out] == [REFUSAL, REFUSAL]  # the refusal chunk, then its completion
    assert out[1].finish_reason == "content_filter" and out[1].seq == 1 and "violence" in out[1].error

    failed = Completion(request_id="r", seq=1, finish_reason="error", error="prompt too long")
    out = await _drain(held_until_screened(_events([chunk(0, "never judged")], [failed])))
    assert out == [failed]


def test_a_request_id_reveals_neither_its_partition_nor_its_admission_time():
    ids = [new_request_id(7, 1700000000.123) for _ in range(50)]
    assert len(set(ids)) == 50  # the same partition and millisecond, 50 different ids
    for rid in ids:
        assert len(rid) == 32 and "1700000000123" not in rid and "p7" not in rid
        assert parse_request_id(rid) == (7, 1700000000123)
    # A made-up id, or one sealed under another deployment's key, is refused, not misread.
    with pytest.raises(ValueError):
        parse_request_id("0" * 32)
    with pytest.raises(ValueError):
        parse_request_id(ids[0][:-1] + ("0" if ids[0][-1] != "0" else "1"))


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_content_frame_is_the_same_bytes_as_the_general_chunk_frame(include_usage):
    """The framer writes content-only chunks around a JSON made once; byte for byte what api.chunk
    and the SSE frame give, whatever the text holds."""
    from gateway import openai_api as api
    from gateway.sse import frame

    f = Framer("r", 'm"odel', 123, include_usage, NOTHING_SEEN)
    f.start()
    for seq, text in enumerate(['hé"llo\n', "", "\x00z", "😀", "\\u0000"]):
        body = api.chunk(f.cid, 123, 'm"odel', content=text, include_usage=include_usage)
        assert f.frames([chunk(seq, text)]) == [frame(json.dumps(body, separators=(",", ":")), id=f"r:{seq}")]
