"""A consumer group whose events are handled one at a time, each to its end before the next is read:
file ingestion (tools/ingestion.py) and speech jobs (tools/speech/loop.py), whose work is CPU-bound
(embedding, a speech model) and would only slow each other if run side by side on these cores.

An event's offset is committed once `handle` returned (its outcome recorded or its results
acknowledged), so a process that dies mid-event leaves it to the next owner of the partition, which
handles it again from the start. An undecodable event goes to the dead-letter topic. One record per
poll, and a poll interval that outlasts the longest event, so a slow one never looks like a dead member.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka.structs import TopicPartition

from common.unblocked import unblocked
from producers import commit_past, dead_letter, decode_record, start_producer, stop_clients
from schemas import DecodeError, Event
from topics import TopicSpec

#: start_consumer's options for such a group: one record per poll, a poll interval that outlasts any event
ONE_AT_A_TIME = {"from_beginning": True, "max_poll_records": 1, "max_poll_interval_ms": 900_000}


class SerialConsumer:
    spec: TopicSpec
    group: str
    log: logging.Logger

    def __init__(self) -> None:
        self.producer = self.consumer = None

    async def subscribe(self):
        """The group's consumer: `start_consumer(<topic>, group=<group>, **ONE_AT_A_TIME)`."""
        raise NotImplementedError

    async def handle(self, event: Event) -> str:
        """Bring `event` to its outcome; returns what happened, for the log."""
        raise NotImplementedError

    def describe(self, event: Event) -> str:
        """The event in a log line."""
        return event.request_id

    async def close(self) -> None:
        await stop_clients(self.consumer, self.producer)

    async def _partition(self, tp: TopicPartition, records) -> None:
        for record in records:
            try:
                event = await unblocked(decode_record, record, self.spec)
            except DecodeError as exc:
                await dead_letter(self.producer, record, exc, group=self.group)
                event = None
            if event is not None:
                started = time.monotonic()
                what = await self.handle(event)
                self.log.info("%s: %s (%.2f s)", self.describe(event), what, time.monotonic() - started)
            if not await commit_past(self.consumer, tp, record.offset, self.log):
                return

    async def run(self, after: asyncio.Event | None = None) -> None:
        """Serve until cancelled; `after`: start once it is set (the tool processor is warm)."""
        if after is not None:
            await after.wait()
        self.producer = await start_producer()
        self.consumer = await self.subscribe()
        self.log.info(
            "%s serving %s (group %s)", self.log.name.rsplit(".", 1)[-1], self.spec.name, self.group
        )
        try:
            while True:
                batches = await self.consumer.getmany(timeout_ms=500)
                for tp, records in batches.items():
                    await self._partition(tp, records)
        finally:
            await self.close()
