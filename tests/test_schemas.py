"""Unit tests of the event contracts and the codec (no broker needed)."""

from __future__ import annotations

import base64
from functools import reduce

import msgspec
import pytest

from schemas import (
    ALL_EVENTS,
    Cancel,
    ChatMessage,
    ChatRequest,
    Checkpoint,
    Completion,
    ConversationHistory,
    DeadLetter,
    Erased,
    FileIngest,
    InferenceRequest,
    KeyHome,
    MalformedEvent,
    OutputWindow,
    PrefixHeld,
    RouteUpdate,
    SafetyVerdict,
    SamplingParams,
    ShadowGate,
    SpeakParams,
    SpeechAudio,
    SpeechDone,
    SpeechJob,
    Timings,
    TokenChunk,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    ToolResult,
    TopLogprob,
    TraceContext,
    TranscribeParams,
    Transcript,
    TranscriptDone,
    TranscriptSegment,
    TurnDeadline,
    UnsupportedVersion,
    Usage,
    WorkerLoad,
    call_id,
    decode,
    encode,
)
from schemas.codec import sealer, use_sealer
from schemas.speech import Word
from schemas.tokens import merge_chunks

MESSAGES = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hello")]


def sample_events() -> list:
    """One filled-in instance of every event type."""
    common = dict(request_id="req-1", conversation_id="conv-1", tenant="acme")
    return [
        ChatRequest(
            **common,
            model="smollm2",
            messages=MESSAGES,
            sampling=SamplingParams(
                max_tokens=5,
                temperature=0.0,
                stop=["\n"],
                seed=7,
                presence_penalty=0.5,
                frequency_penalty=-0.5,
                logit_bias={42: -100.0},
                logprobs=3,
            ),
            reply_partition=3,
            gateway_id="gw-0",
            screening="parallel",
        ),
        InferenceRequest(
            **common,
            model="smollm2",
            messages=MESSAGES,
            reply_partition=3,
            dropped_messages=2,
            screening="parallel",
        ),
        TokenChunk(
            **common,
            seq=4,
            text=" wor",
            token_ids=[101, 102],
            worker_id="w-1",
            logprobs=[
                TokenLogprob(
                    token=" wor",
                    bytes=[32, 119, 111, 114],
                    logprob=-0.5,
                    top_logprobs=[TopLogprob(token=" w", bytes=[32, 119], logprob=-1.5)],
                )
            ],
        ),
        SpeechJob(
            **common,
            kind="transcribe",
            model="whisper-tiny.en",
            reply_partition=3,
            audio_key="k",
            filename="q.wav",
            transcribe=TranscribeParams(language="en", prompt="names", word_timestamps=True),
        ),
        SpeechJob(
            **common,
            kind="speak",
            model="espeak-ng",
            reply_partition=3,
            speak=SpeakParams(text="Hello.", voice="nova", speed=1.5, format="opus"),
        ),
        TranscriptSegment(
            **common,
            seq=0,
            start=0.0,
            end=1.2,
            text=" Hello.",
            words=[Word(" Hello.", 0.0, 1.2)],
            seek=0,
            tokens=[50257, 123],
            temperature=0.2,
            avg_logprob=-0.3,
            compression_ratio=0.9,
            no_speech_prob=0.01,
        ),
        TranscriptDone(**common, seq=1, text="Hello.", language="en", duration_s=1.3, seconds=0.4),
        SpeechAudio(**common, seq=0, audio=b"\xff\xfb\x90", text="Hello."),
        SpeechDone(**common, seq=1, bytes_total=3, duration_s=0.5, error=None),
        Completion(
            **common,
            seq=5,
            finish_reason="length",
            usage=Usage(prompt_tokens=9, completion_tokens=5),
            timings=Timings(queue_s=0.1, prefill_s=0.2, decode_s=0.3, pipeline_s=0.05),
        ),
        Transcript(
            **common,
            question=MESSAGES[1:],
            answer=Completion(**common, seq=2, finish_reason="stop", text="Hello there."),
        ),
        ToolCall(**common, call_id="call-1", name="python", arguments='{"code": "1+1"}'),
        ToolResult(**common, call_id="call-1", name="python", ok=True, output="2", duration_s=0.05),
        SafetyVerdict(
            **common,
            stage="output",
            blocked=True,
            categories=["violence"],
            scores={"violence": 0.93},
            policy_version="p1",
            window_end_seq=12,
        ),
        Cancel(**common, reason="client_disconnected"),
        RouteUpdate(**common, model="smollm2", weights={"smollm2": 0.9, "smollm2-v2": 0.1}),
        ShadowGate(
            **common,
            candidate="smollm2-v2",
            served="smollm2",
            since=1.0,
            until=2.0,
            requests=3,
            figures={"agreement": 1.0},
            require=["agreement>=0.9"],
            passed=True,
        ),
        OutputWindow(**common, text="so far", last_seq=7, pending_tokens=3),
        ConversationHistory(
            **common,
            messages=MESSAGES,
            pending_request_id="req-0",
            parked=[ChatRequest(request_id="req-2", model="smollm2", messages=MESSAGES[1:])],
        ),
        TurnDeadline(**common),
        PrefixHeld(**common, model="smollm2", worker_id="w1", digest="0f" * 16),
        KeyHome(**common, digest="ab" * 32, region="eu"),
        WorkerLoad(
            **common, model="smollm2", worker_id="w1", partitions=[0, 3], running=2, waiting=1, max_running=32
        ),
        Checkpoint(
            **common,
            topic="ts.tokens",
            partition=3,
            first_offset=10,
            last_offset=11,
            offsets=[10, 11],
            record_digests=["ab" * 32, "cd" * 32],
            head="ef" * 32,
            signed_at=1.5,
            key_id="k1",
            signature="00" * 64,
        ),
        DeadLetter(
            **common,
            reason="bad",
            error_type="MalformedEvent",
            source_topic="t",
            source_partition=1,
            source_offset=42,
            payload=b"\x00\xff",
            key=b"k",
            headers=[("traceparent", b"00-x")],
        ),
        FileIngest(
            **common, vector_store_id="vs_1", file_id="file-1", action="add", filename="a.md", generation="g1"
        ),
    ]


def test_every_event_type_has_a_sample():
    assert {type(e) for e in sample_events()} == set(ALL_EVENTS)


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: type(e).__name__)
def test_round_trip_through_codec(event):
    data = encode(event)
    assert decode(data) == event
    assert decode(data, type(event)) == event
    assert msgspec.json.decode(data)["type"] == type(event).__struct_config__.tag


def test_decode_restricted_to_a_topic_types_rejects_others():
    data = encode(Cancel(request_id="r"))
    with pytest.raises(MalformedEvent):
        decode(data, TokenChunk, Completion)


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        b"{}",
        b'{"type": "no_such_event", "request_id": "r"}',
        b'{"type": "token_chunk", "request_id": "r", "seq": "three", "text": "x"}',
        b'{"type": "token_chunk", "seq": 1, "text": "x"}',
        (
            b'{"type": "inference_request", "request_id": "r", "model": "m", "messages": [],'
            b' "sampling": {"max_tokens": 0}}'
        ),
    ],
)
def test_malformed_events_raise_typed_error(payload):
    with pytest.raises(MalformedEvent) as info:
        decode(payload)
    assert info.value.reason


def test_unknown_version_raises_unsupported_version():
    data = encode(TokenChunk(request_id="r", seq=0, text="a")).replace(b'"v":1', b'"v":99')
    with pytest.raises(UnsupportedVersion) as info:
        decode(data)
    assert info.value.version == 99


def test_trace_context_round_trips_through_headers():
    trace = TraceContext.new()
    parsed = TraceContext.from_headers(trace.headers())
    assert parsed == trace
    child = trace.child()
    assert child.trace_id == trace.trace_id and child.span_id != trace.span_id
    assert TraceContext.parse("garbage") is None


def _lp(token: str, logprob: float) -> TokenLogprob:
    return TokenLogprob(
        token=token,
        bytes=list(token.encode()),
        logprob=logprob,
        top_logprobs=[TopLogprob(token=token, bytes=list(token.encode()), logprob=logprob)],
    )


def _tool_chunks() -> list[TokenChunk]:
    """A worker's chunks of an answer with some content and two calls, one token each."""
    parts = [
        ("Sure", [], None),
        ("", [ToolCallDelta(index=0, id=call_id("r", 0), name="weather")], '<call>{"name":"weather"'),
        ("", [ToolCallDelta(index=0, arguments='{"city":')], ',"arguments":{"city":'),
        ("", [ToolCallDelta(index=0, arguments=' "Oslo"}')], ' "Oslo"}}'),
        ("", [ToolCallDelta(index=1, id=call_id("r", 1), name="time")], '<call>{"name":"time"'),
        ("", [ToolCallDelta(index=1, arguments="{}")], ',"arguments":{}}'),
    ]
    return [
        TokenChunk(
            request_id="r",
            seq=i,
            text=text,
            tool_calls=calls,
            raw=raw,
            token_ids=[i],
            logprobs=[_lp(str(i), -i)],
        )
        for i, (text, calls, raw) in enumerate(parts)
    ]


def _calls(chunks: list[TokenChunk]) -> dict[int, dict]:
    """The calls a client assembles from the chunks' deltas (OpenAI's rule: by index)."""
    out: dict[int, dict] = {}
    for c in chunks:
        for d in c.tool_calls:
            call = out.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] = call["name"] or d.name
            call["arguments"] += d.arguments
    return out


def test_merging_chunks_keeps_text_raw_tokens_logprobs_and_calls():
    chunks = _tool_chunks()
    for start in range(len(chunks)):
        for end in range(start + 1, len(chunks) + 1):
            part = chunks[start:end]
            merged = reduce(merge_chunks, part)
            assert merged.seq == part[-1].seq
            assert merged.text == "".join(c.text for c in part)
            behind = merged.text if merged.raw is None else merged.raw  # a chunk without raw: its text
            assert behind == "".join(c.text if c.raw is None else c.raw for c in part)
            assert merged.token_ids == [i for c in part for i in c.token_ids]
            assert merged.logprobs == [lp for c in part for lp in c.logprobs]
            assert _calls([merged]) == _calls(part)
            # a call's first delta (its id and name) stands alone; its argument fragments are joined
            assert all(not d.arguments for d in merged.tool_calls if d.id)
            indexes = [d.index for d in merged.tool_calls if not d.id]
            assert len(indexes) == len(set(indexes))
    whole = reduce(merge_chunks, chunks)
    assert [(d.index, d.id != "", d.arguments) for d in whole.tool_calls] == [
        (0, True, ""),
        (0, False, '{"city": "Oslo"}'),
        (1, True, ""),
        (1, False, "{}"),
    ]
    assert chunks[2].tool_calls[0].arguments == '{"city":'  # the merged chunks are left as they were
    plain = merge_chunks(
        TokenChunk(request_id="r", seq=0, text="a"), TokenChunk(request_id="r", seq=1, text="b")
    )
    assert plain.raw is None and plain.text == "ab" and plain.tool_calls == [] and plain.logprobs == []


class _PlainSealer:
    """A keyring stand-in for unit tests: 'seals' by base64 (its key id 'k'), opens unless erased."""

    def __init__(self) -> None:
        self.erased = False

    def seal(self, tenant: str, scope: str, plaintext: bytes) -> str:
        return "s1.k." + base64.urlsafe_b64encode(plaintext).decode().rstrip("=")

    def open(self, token: str) -> bytes | None:
        body = token.split(".", 2)[2]
        return None if self.erased else base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))


@pytest.fixture
def plain_sealer():
    before, keys = sealer(), _PlainSealer()
    use_sealer(keys)
    yield keys
    use_sealer(before)


@pytest.fixture
def unsealed():
    before = sealer()  # a test before may have installed the roles' keyring in this process
    use_sealer(None)
    yield
    use_sealer(before)


def test_fields_at_their_default_are_not_written_but_created_at_and_v_are(unsealed):
    chunk = TokenChunk(request_id="r", seq=0, text="a")
    assert set(msgspec.json.decode(encode(chunk))) == {"type", "request_id", "seq", "text", "created_at", "v"}
    assert decode(encode(chunk)) == chunk
    cp = Checkpoint(request_id="t/0", topic="t", partition=0, first_offset=0, last_offset=0)
    written = msgspec.json.decode(encode(cp))  # signed as plain JSON: written whole
    assert written["prev_head"] == "00" * 32 and written["tenant"] == "default" and written["offsets"] == []


def test_a_sealed_event_writes_neither_part_s_defaults_and_reads_back_whole(plain_sealer):
    chunk = TokenChunk(request_id="r", conversation_id="c", seq=3, text="a", token_ids=[5])
    wire = encode(chunk)
    assert wire.startswith(b'{"sealed":"s1.k.') and decode(wire) == chunk
    clear = msgspec.json.decode(wire)
    assert set(clear) == {"sealed", "type", "request_id", "conversation_id", "seq", "created_at", "v"}
    assert msgspec.json.decode(plain_sealer.open(clear["sealed"])) == {"text": "a", "token_ids": [5]}
    done = Completion(request_id="r", seq=4, finish_reason="stop")  # no content: nothing to seal
    assert not encode(done).startswith(b'{"sealed"') and decode(encode(done)) == done
    for event in sample_events():
        assert decode(encode(event)) == event
    plain_sealer.erased = True
    with pytest.raises(Erased) as erased:
        decode(encode(TokenChunk(request_id="r2", seq=0, text="gone")))
    clear = erased.value.clear  # the base fields left out at their default read as that default
    assert (clear["request_id"], clear["conversation_id"], clear["tenant"]) == ("r2", "", "default")
