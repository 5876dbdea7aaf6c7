"""A step record: one engine step's token chunks for every request on one ts.tokens partition, as ONE
Kafka record (vLLM's one output message per engine step, carried by the log).

Rule. A worker writes the chunks one engine step makes for the requests whose reply partition is p as
one record on p, its `event-type` header `token_step`, its key empty. Each entry is exactly the record a
chunk would be on its own: its key (the request id) and its value (the TokenChunk, its content sealed
with its own tenant's key, encoded as `schemas.codec.encode` makes it); an entry carries trace headers
only when its writer exports spans. The body is JSON like every event's, the entries' values set in it
verbatim: `{"v":1,"entries":[["<request id>",{<the chunk>}],...]}` (an entry with trace headers has
them third, as [name, value] pairs, the values as text). Completions, verdicts and every other event
stay records of their own, so a request's Completion follows its last chunk's step record on the
partition.

A reader takes a record apart with `unpack` before anything else: a step record gives one `Unpacked`
per entry, in order, each with the step record's topic, partition, offset and timestamp; any other
record is given back as it is. Every entry of a step shares its offset: a reader that remembers where
to go on reads from `resume_offset(record)`, which stays at the step's offset until its last entry
has been handled (the entries handled before are met again there, and dropped by `seq` as any replayed
chunk is). A step record whose body does not parse raises DecodeError, as a malformed event does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import msgspec

from schemas.base import SCHEMA_VERSION
from schemas.codec import MalformedEvent, UnsupportedVersion
from schemas.headers import EVENT_TYPE

STEP_TYPE = b"token_step"
CHUNK_TYPE = b"token_chunk"
STEP_HEADERS = [(EVENT_TYPE, STEP_TYPE)]
STEP_MAX_BYTES = 512 * 1024  # a step's entries beyond this go in a second record (brokers take 1 MiB)


class StepEntry(msgspec.Struct, array_like=True, omit_defaults=True):
    key: str  # the request id
    value: msgspec.Raw  # the TokenChunk, sealed and encoded as a record of its own would be
    headers: list[tuple[str, str]] = msgspec.field(default_factory=list)  # trace context, if any


class TokenStep(msgspec.Struct):
    v: int
    entries: list[StepEntry]


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(TokenStep)


def entry(key: str, value: bytes, headers: list[tuple[str, bytes]] | None = None) -> StepEntry:
    """The entry of a chunk whose own record would have had this key, value and trace headers."""
    if not headers:
        return StepEntry(key, msgspec.Raw(value))
    return StepEntry(key, msgspec.Raw(value), [(k, v.decode()) for k, v in headers])


def step_value(entries: list[StepEntry]) -> bytes:
    """The value of a step record holding `entries` (its header: STEP_HEADERS)."""
    return _encoder.encode(TokenStep(SCHEMA_VERSION, entries))


def is_step(headers) -> bool:
    """Whether a record's headers (pairs, or a mapping) name a step record."""
    if not headers:
        return False
    for key, value in headers.items() if isinstance(headers, dict) else headers:
        if key == EVENT_TYPE:
            return bytes(value) == STEP_TYPE
    return False


def entries_of(value: bytes) -> list[StepEntry]:
    """A step record's entries (raises DecodeError for a body that does not parse or a newer version)."""
    try:
        step = _decoder.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedEvent(f"not a token step: {exc}") from exc
    if step.v > SCHEMA_VERSION:
        raise UnsupportedVersion(
            f"token step version {step.v} (this reader knows up to {SCHEMA_VERSION})", step.v
        )
    return step.entries


@dataclass(slots=True)
class Unpacked:
    """One entry of a step record, read as the record it stands for (aiokafka's ConsumerRecord fields)."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    timestamp_type: int
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]
    last: bool  # the step's last entry: the reader is then past the step record

    checksum = None

    @property
    def serialized_key_size(self) -> int:
        return len(self.key)

    @property
    def serialized_value_size(self) -> int:
        return len(self.value)


_CHUNK_HEADERS = [(EVENT_TYPE, CHUNK_TYPE)]


def unpack(record) -> list:
    """The records `record` stands for: a step record's entries, else `record` itself."""
    if not is_step(record.headers):
        return [record]
    entries = entries_of(record.value or b"")
    last = len(entries) - 1
    return [
        Unpacked(
            record.topic,
            record.partition,
            record.offset,
            record.timestamp,
            record.timestamp_type,
            e.key.encode(),
            bytes(e.value),
            [*_CHUNK_HEADERS, *((k, v.encode()) for k, v in e.headers)] if e.headers else _CHUNK_HEADERS,
            i == last,
        )
        for i, e in enumerate(entries)
    ]


def unpack_all(records: Iterable) -> Iterator:
    """`unpack` over `records`, in order; a step record that does not parse is given back whole (its
    reader then fails to decode it as an event and treats it as it treats any malformed record)."""
    for record in records:
        try:
            yield from unpack(record)
        except (MalformedEvent, UnsupportedVersion):
            yield record


def resume_offset(record) -> int:
    """Where a reader that has handled `record` goes on: past it, except within a step record."""
    return record.offset if isinstance(record, Unpacked) and not record.last else record.offset + 1
