"""Routing a record that cannot be processed to the dead-letter topic, and moving on."""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from producers.publish import publish
from schemas import DecodeError, Erased
from schemas.deadletter import letter_of
from topics import DEAD_LETTER

log = logging.getLogger(__name__)


async def dead_letter(
    producer: AIOKafkaProducer, record: ConsumerRecord, exc: BaseException, *, group: str = ""
) -> None:
    """Write `record` untouched to ts.deadletter with why it failed and where it came from.

    Waits for the broker's acknowledgement so the caller may then commit past the record. An erased
    record (its content's key destroyed by `tokenstream erase`) is not malformed: it is only passed over.
    """
    if isinstance(exc, Erased):
        log.info("passed over erased %s[%d]@%d", record.topic, record.partition, record.offset)
        return
    reason = exc.reason if isinstance(exc, DecodeError) else f"{type(exc).__name__}: {exc}"
    letter = letter_of(record, record.value or b"", reason, type(exc).__name__, group)
    log.warning("dead-lettered %s[%d]@%d: %s", record.topic, record.partition, record.offset, reason)
    await publish(producer, DEAD_LETTER, letter, key=letter.request_id)
