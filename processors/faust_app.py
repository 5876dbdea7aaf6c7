"""What every processor shares: its faust app, registry topics as raw bytes, typed decode and send."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Callable

import faust
from faust.types import EventT

from common import kafka_auth, sealing, tracing
from common.config import settings
from processors import table_store
from processors.delivery import at_least_once
from processors.recovery_watch import watch_recovery
from processors.shares import headers_of, shares
from producers.membership import member_client_id
from producers.settings import FAUST, faust_liveness
from schemas import DecodeError, Erased, Event, TraceContext, decode, encode
from schemas.codec import decoder
from schemas.deadletter import letter_of
from schemas.headers import EVENT_TYPE as TYPE_HEADER
from schemas.sealing import SealingUnavailable
from schemas.steps import CHUNK_TYPE, is_step, unpack
from topics import DEAD_LETTER, TopicSpec, processor_group

log = logging.getLogger(__name__)


def _commit_nothing_revoked() -> None:
    """faust commits only the offsets of partitions still assigned; when a rebalance has just taken
    every one of them (a fellow member died: eager rebalancing revokes all), what is left is empty,
    and aiokafka's `commit({})` raises ValueError, which faust treats as fatal: the *surviving*
    member crashed and the role had no live member until its supervisor restarted both (the chaos
    drill's conversation takeover took 17-27 s). Committing nothing is what it should do."""
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

    commit = AIOKafkaConsumerThread._commit
    if getattr(commit, "keeps_empty_commits", False):
        return

    async def _commit(self, offsets):
        assigned = self.assignment()
        if not any(tp in assigned for tp in offsets):
            return False  # nothing of ours to commit; the next owner reads from the last commit
        return await commit(self, offsets)

    _commit.keeps_empty_commits = True
    AIOKafkaConsumerThread._commit = _commit


def _seek_unread_changelogs_from_the_start() -> None:
    """faust's table recovery seeks every standby changelog partition to the offset it read last, but
    builds those offsets only for the standby partitions assigned when recovery began: one in its
    set without an offset (a memory store persists none) is sought to None, aiokafka's seek raises
    ValueError('Offset must be a positive integer'), and the processor ended (seen once in a
    10-minute chaos drill: a safety processor right after its restart). faust's own word for
    "nothing read yet" is -1, which it seeks to 0 (the log's start; a start already compacted or
    deleted away is reset to the earliest offset by the consumer): the same for None."""
    from faust.tables.recovery import Recovery

    seek = Recovery._seek_offsets
    if getattr(seek, "unread_from_the_start", False):
        return

    async def _seek_offsets(self, consumer, tps, offsets, title):
        for tp in tps:
            if offsets.get(tp) is None or offsets[tp] < -1:
                offsets[tp] = -1
        return await seek(self, consumer, tps, offsets, title)

    _seek_offsets.unread_from_the_start = True
    Recovery._seek_offsets = _seek_offsets


def make_app(role: str, **overrides) -> faust.App:
    """A faust app whose id (and consumer group) is `ts-<role>`, processing at-least-once.

    Re-processing after a crash is made harmless by `processors.effects.Ledger` (see there
    why not faust's exactly_once).
    """
    _commit_nothing_revoked()
    _seek_unread_changelogs_from_the_start()
    sealing.install()  # tables and topics hold tenants' content sealed (common/sealing.py)
    cfg = settings()
    brokers = ";".join(f"kafka://{b.strip()}" for b in cfg.kafka_bootstrap.split(","))
    options = dict(
        broker=brokers,
        broker_client_id=member_client_id(role),  # its supervisor finds its members by it (membership.evict)
        processing_guarantee="at_least_once",
        store=table_store.register(),  # in memory, from the changelogs; a takeover reads only what is new
        web_enabled=False,
        consumer_auto_offset_reset="earliest",
        topic_replication_factor=cfg.kafka_replication,
        topic_partitions=12,
        stream_wait_empty=False,
        **FAUST,  # the Kafka client settings, beside every other role's (producers/settings.py)
        **faust_liveness(),
    )
    credentials = kafka_auth.faust_credentials()  # the role's own broker user (topics/access.py)
    if credentials is not None:
        options["broker_credentials"] = credentials
    options.update(overrides)
    app = faust.App(processor_group(role), **options)
    # faust would log "Agent ... Crashed" and go on as a live process that consumes nothing (and
    # commit what came before the failing record). An agent that cannot go on ends the process
    # instead, without committing: its supervisor restarts it and the record is read again.
    app._on_agent_error = _exit_on_agent_crash
    return app


EXIT_AGENT_CRASHED = 70
GIL_SWITCH_INTERVAL_S = 0.0005


async def _exit_on_agent_crash(agent, exc: BaseException) -> None:
    log.critical(
        "agent %s crashed (%s: %s): exiting with %d for the supervisor to restart this processor",
        getattr(agent, "name", agent),
        type(exc).__name__,
        exc,
        EXIT_AGENT_CRASHED,
    )
    logging.shutdown()
    os._exit(EXIT_AGENT_CRASHED)


def topic(app: faust.App, spec: TopicSpec) -> faust.TopicT:
    """A registry topic as faust sees it: raw bytes, decoded by `schemas` (not by faust)."""
    return app.topic(
        spec.name,
        key_type=bytes,
        value_type=bytes,
        key_serializer="raw",
        value_serializer="raw",
        partitions=spec.partitions,
    )


def table(app: faust.App, spec: TopicSpec, name: str) -> faust.Table:
    """A table whose changelog is the registry's `spec` (faust names it <app id>-<name>-changelog)."""
    assert spec.name == f"{app.conf.id}-{name}-changelog", f"registry name {spec.name} != faust's"
    return app.Table(name, partitions=spec.partitions, key_type=bytes, value_type=bytes)  # bytes: raw


def traced(raw: EventT, name: str, attributes: dict | None = None) -> tracing.Hop:
    """The span of this processor's handling of `raw`, a child of the hop that wrote it (its
    traceparent header; a step's entry's own); `.trace` is what the events written meanwhile carry. Use
    it with `with`."""
    message = raw.message
    group = raw.app.conf.id
    return tracing.hop(
        name,
        tracing.parent_of(headers_of(raw)),
        role=group.removeprefix("ts-"),
        attributes={
            **tracing.record_attributes(message.topic, message.partition, message.offset, group),
            **(attributes or {}),
        },
    )


def _header(headers, name: str) -> bytes | None:
    """A record header's value (faust hands them over as pairs, or as a mapping), None when absent."""
    if not headers:
        return None
    for key, value in headers.items() if isinstance(headers, dict) else headers:
        if key == name:
            return bytes(value)
    return None


async def typed(
    stream: faust.StreamT,
    specs: dict[str, TopicSpec],
    dead_letters: faust.TopicT,
    *,
    wants: tuple[type[Event], ...] | None = None,
) -> AsyncIterator[tuple[Event, EventT]]:
    """Yield (event, faust event) for each record; undecodable ones go to the dead-letter topic, erased
    ones (their content's key destroyed by `tokenstream erase`) are passed over.

    `wants`, the event types the agent uses: a record whose event-type header names another type is
    passed over unopened (neither unsealed nor decoded); one without the header is decoded (and
    dead-lettered when malformed) and passed over when of another type.
    A step record (schemas/steps.py) is one record to pass over unopened where `wants` lacks TokenChunk;
    otherwise each of its entries is read, in order, as the record it stands for, and yielded with a
    share of the faust event (processors/shares.py), which acknowledges the faust event once every
    entry is acknowledged; a step record whose body does not parse is dead-lettered whole.
    On a stream whose acks are manual (`stream.noack()`) every record (or entry) not yielded is
    acknowledged here; the agent acknowledges those it is given."""
    tags = None if wants is None else frozenset(t.__struct_config__.tag.encode() for t in wants)
    steps_wanted = tags is None or CHUNK_TYPE in tags
    manual = not stream.enable_acks
    openers: dict[str, Callable[[bytes], Event]] = {}

    async def read(record, value: bytes) -> Event | None:
        """The event `record` (a faust message, or a step's entry) holds; None: passed over (raises
        DecodeError for one that cannot be decoded)."""
        if tags is not None:
            tag = _header(record.headers, TYPE_HEADER)
            if tag is not None and tag not in tags:
                return None
        try:
            opener = openers.get(record.topic)
            if opener is None:
                opener = openers[record.topic] = decoder(*specs[record.topic].events)
            try:
                decoded = sealing.held_only(opener, value)  # no key fetch on the loop
            except SealingUnavailable:  # a key not held (fetched in a thread), or the keyring's Redis
                # away: ridden out, the input held meanwhile
                decoded = await sealing.patiently(functools.partial(opener, value), stream.app.conf.id)
        except Erased:
            log.info("passed over erased %s[%d]@%d", record.topic, record.partition, record.offset)
            return None
        return decoded if wants is None or isinstance(decoded, wants) else None

    async for event in stream.events():
        message = event.message
        if steps_wanted and is_step(message.headers):
            try:
                entries = unpack(message)
            except DecodeError as exc:
                await dead_letter(dead_letters, stream.app.conf.id, message, event.value or b"", exc)
                entries = []
            if not entries and manual:
                event.ack()
            records = [(share.record, share.value, share) for share in shares(event, entries)]
        else:
            records = [(message, event.value or b"", event)]
        for record, value, raw in records:
            try:
                decoded = await read(record, value)
            except DecodeError as exc:
                await dead_letter(dead_letters, stream.app.conf.id, record, value, exc)
                decoded = None
            if decoded is not None:
                yield decoded, raw
            elif manual:
                raw.ack()


async def dead_letter(dead_letters: faust.TopicT, group: str, record, value: bytes, exc: DecodeError) -> None:
    """Send what could not be decoded to the dead-letter topic: `record` (a faust message, or a step's
    entry, named by its step record's topic, partition and offset) with `value`."""
    log.warning("dead-lettered %s[%d]@%d: %s", record.topic, record.partition, record.offset, exc.reason)
    letter = letter_of(record, value, exc.reason, type(exc).__name__, group)
    await send(dead_letters, DEAD_LETTER, letter, key=letter.request_id)


async def send(
    target: faust.TopicT,
    spec: TopicSpec,
    event: Event,
    *,
    key: str,
    partition: int | None = None,
    trace: TraceContext | None = None,
) -> asyncio.Future:
    """Write a typed event and wait for the broker's acknowledgement: the send's future, resolved (its
    RecordMetadata says where the event lies)."""
    if not isinstance(event, spec.events):
        raise TypeError(f"{type(event).__name__} does not belong on topic {spec.name}")
    headers = [(TYPE_HEADER, type(event).__struct_config__.tag.encode())]
    if trace is not None:
        headers += trace.headers()
    value = await sealing.patiently(lambda: encode(event), target.app.conf.id)  # (a key held needs no store)
    ack = await target.send(key=key.encode(), value=value, partition=partition, headers=headers)
    await ack
    return ack


def get(tbl: faust.Table, key: str, kind: type[Event]) -> Event | None:
    """A table row, None when there is none or its content was erased (`tokenstream erase`)."""
    raw = tbl.get(key.encode())
    try:
        return decode(raw, kind) if raw else None
    except Erased:
        return None


def put(tbl: faust.Table, key: str, value: Event | None) -> None:
    """Store (or, with None, delete) a table row (its changelog record is written with it)."""
    if value is None:
        tbl.pop(key.encode(), None)
    else:
        tbl[key.encode()] = encode(value)


def run(app: faust.App, loglevel: str = "warn", warm_up: Callable[[], object] | None = None) -> None:
    """Run the app's worker in this process until SIGTERM/SIGINT (what `tokenstream processor X` does).

    `warm_up` loads what the agents need (tokenizers, classifier) *before* the consumer joins
    its group: loaded lazily, the first event blocked the event loop for seconds (heartbeats,
    commits and the rebalance all wait on it) and the first request paid the load.
    """
    from faust.worker import Worker

    tracing.setup(app.conf.id.removeprefix("ts-"))
    # faust reads the broker in a thread of its own and hands each batch to the agents' event loop:
    # a thread woken by a socket while the other runs Python waits for the GIL up to the switch
    # interval (5 ms by default). Measured with a socket reader thread beside a busy main thread:
    # p50 wait 4.9-7.1 ms at 5 ms, 0.8-1.9 ms at 0.5 ms. Both directions of the hand-over pay it.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    if warm_up is not None:
        started = time.monotonic()
        warm_up()
        log.info("%s warmed up in %.1fs", app.conf.id, time.monotonic() - started)
    at_least_once(app)
    watch_recovery(app, settings().recovery_stall_s)
    worker = Worker(app, loglevel=loglevel, quiet=True)
    # faust's progress spinner writes terminal escapes (cursor hide/show) even when its output is a log
    # file, not a terminal: a processor is never run for a person's screen, so it has none
    worker.spinner = None
    worker.execute_from_commandline()
