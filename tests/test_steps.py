"""Step records (schemas/steps.py): one engine step's chunks of every request on a ts.tokens partition as
one record, read back as the records its entries stand for (unit)."""

from __future__ import annotations

import pytest
from aiokafka.structs import ConsumerRecord

from producers.publish import decode_record, trace_of
from schemas import Completion, DecodeError, TokenChunk, encode
from schemas.headers import EVENT_TYPE
from schemas.steps import (
    CHUNK_TYPE,
    STEP_HEADERS,
    Unpacked,
    entry,
    is_step,
    resume_offset,
    step_value,
    unpack,
    unpack_all,
)
from schemas.tracing import TraceContext
from topics import TOKENS


def record(offset: int, value: bytes, key: bytes | None = None, headers=(), timestamp: int = 1_000):
    return ConsumerRecord(
        TOKENS.name, 3, offset, timestamp, 1, key, value, None, len(key or b""), len(value), list(headers)
    )


def chunk(rid: str, seq: int, text: str) -> TokenChunk:
    return TokenChunk(request_id=rid, seq=seq, text=text, token_ids=[seq])


def step(offset: int, *entries) -> ConsumerRecord:
    return record(offset, step_value(list(entries)), None, STEP_HEADERS, timestamp=2_000)


def test_a_step_gives_back_each_chunk_as_its_own_record_would_be_with_and_without_trace_headers():
    trace = TraceContext.new()
    a, b = chunk("req-a", 0, "Hello"), chunk("req-b", 4, ' "quoted" \\ text')
    # encoded once each: where a keyring is installed, sealing draws a fresh nonce every time
    values = {"req-a": encode(a), "req-b": encode(b)}
    rec = step(41, entry("req-a", values["req-a"]), entry("req-b", values["req-b"], trace.headers()))
    assert is_step(rec.headers) and is_step(dict(rec.headers)) and not is_step([]) and not is_step(None)
    first, second = unpack(rec)
    for one, event in ((first, a), (second, b)):
        assert isinstance(one, Unpacked) and decode_record(one, TOKENS) == event
        assert one.key == event.request_id.encode() and one.value == values[event.request_id]
        assert (one.topic, one.partition, one.offset, one.timestamp) == (TOKENS.name, 3, 41, 2_000)
        assert one.serialized_value_size == len(one.value) and one.serialized_key_size == len(one.key)
    assert first.headers == [(EVENT_TYPE, CHUNK_TYPE)] and trace_of(first) is None
    assert trace_of(second) == trace and dict(second.headers)[EVENT_TYPE] == CHUNK_TYPE
    assert (first.last, second.last) == (False, True)


def test_any_other_record_is_given_back_as_it_is():
    done = Completion(request_id="req-a", seq=1, finish_reason="stop")
    plain = record(7, encode(done), b"req-a", [(EVENT_TYPE, b"completion")])
    assert unpack(plain) == [plain] and not is_step(plain.headers)
    assert resume_offset(plain) == 8
    assert list(unpack_all([plain])) == [plain]


@pytest.mark.parametrize(
    "value",
    [b"not json", b'{"v":1}', b'{"v":1,"entries":[["req-a"]]}', b'{"v":1,"entries":{"a":1}}', b""],
)
def test_a_malformed_step_raises_a_decode_error_and_unpack_all_passes_it_on_whole(value):
    bad = record(9, value, None, STEP_HEADERS)
    with pytest.raises(DecodeError):
        unpack(bad)
    good = step(10, entry("req-a", encode(chunk("req-a", 0, "x"))))
    out = list(unpack_all([bad, good]))
    assert out[0] is bad and len(out) == 2 and out[1].key == b"req-a"
    with pytest.raises(DecodeError):
        decode_record(bad, TOKENS)  # its reader then treats it as any malformed record


def test_a_newer_step_version_is_refused():
    newer = record(11, b'{"v":2,"entries":[]}', None, STEP_HEADERS)
    with pytest.raises(DecodeError, match="version 2"):
        unpack(newer)


def test_the_resume_offset_stays_on_the_step_until_its_last_entry():
    entries = [entry(f"req-{i}", encode(chunk(f"req-{i}", 0, str(i)))) for i in range(3)]
    one = step(20, *entries)
    after = record(21, encode(Completion(request_id="req-0", seq=1, finish_reason="stop")), b"req-0")
    read = list(unpack_all([one, after]))
    assert [resume_offset(r) for r in read] == [20, 20, 21, 22]
    assert [r.offset for r in read] == [20, 20, 20, 21]
