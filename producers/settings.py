"""Every Kafka client setting in one place: the aiokafka producers and consumers of every role and
the faust processors' own clients. Why each value is what it is:

A request crosses five broker hops before its first token reaches the client (gateway ->
conversation -> router -> worker -> gateway, plus safety in series or beside them), so no client on
that path may hold a record back to batch it:

- linger 0 everywhere. aiokafka keeps at most one produce request in flight per broker, so while
  one is in flight the records that follow gather in the next batch anyway: under load batching
  happens by itself, and an idle path pays no linger (the worker's publish hop went from 6.3 to
  1.8 ms p50 when its 5 ms linger went; the gateway's 1 ms linger is gone too).
- acks=all and (for aiokafka producers) idempotence: an acknowledged event survives the loss of
  a broker and a retried send is never written twice. Not traded for latency: the path's own hop
  time is the send, the acknowledgement is awaited only where a guarantee needs it.
- lz4: cheap to compress and to check on the broker; token batches and long prompts shrink.
- consumers commit by hand, after the effect is durable (`enable_auto_commit=False`), and read
  committed data only.
- fetch_max_wait: a fetch waits on the broker at most this long when there is no data; data
  arriving ends the wait at once, so it costs nothing on a busy path. It bounds instead how long a
  partition assigned, resumed or seeked while a fetch is in flight waits for the next fetch (the
  gateway's fan-out pauses and resumes its tokens partitions; a search result reader assigns one).
"""

from __future__ import annotations

from common.config import settings

PRODUCER = dict(
    acks="all",
    enable_idempotence=True,
    compression_type="lz4",
    linger_ms=0,
    max_batch_size=256 * 1024,
    request_timeout_ms=30_000,
)

CONSUMER = dict(
    enable_auto_commit=False,
    isolation_level="read_committed",
    max_poll_records=500,
)

# group-less readers that follow a partition as it is written (fan-out, result readers, benchmarks)
FOLLOW_FETCH_MAX_WAIT_MS = 100

# the faust processors (conversation, safety, router): their producer is faust's own aiokafka
# producer; the same choices in faust's terms. faust does not enable idempotence outside its
# exactly_once mode (rejected, see processors/effects.py); re-sends are absorbed by the ledgers. Its
# records are single small events, left uncompressed (faust's default).
FAUST = dict(
    producer_acks=-1,  # all
    producer_linger=0.0,
    broker_commit_every=100,
    broker_commit_interval=0.2,  # what a crash makes the processors redo, at most (effects.Ledger)
)


def liveness() -> dict[str, int]:
    """How a consumer group member shows it is alive (aiokafka's terms); faust's in `faust_liveness`.

    The session timeout is the takeover time after a death no supervisor sees (a host lost, a
    process frozen): the classic group protocol only notices a silent member when its heartbeats
    stop for that long. A clean stop leaves at once, and so, in effect, does a process killed under
    a supervisor, which sends its LeaveGroup for it (membership.evict). 3 s (Kafka's client default
    is 45 s, aiokafka's 10): heartbeats every 0.5 s, six a session, so a member must miss six in a
    row, which an event loop busy for a moment does not do (the worker's steps run on a thread of
    their own, faust's consumer too). 2 s was tried: on three brokers a controller kill then expired
    the survivors too, whose heartbeats the coordinator answers only after its pending writes, which
    wait while the dead node is still counted in sync (docs/guarantees.md, "A standby takes over").
    """
    session_ms = int(settings().kafka_session_timeout_s * 1000)
    return dict(session_timeout_ms=session_ms, heartbeat_interval_ms=max(100, session_ms // 6))


def faust_liveness() -> dict[str, float]:
    ms = liveness()
    return dict(
        broker_session_timeout=ms["session_timeout_ms"] / 1000,
        broker_heartbeat_interval=ms["heartbeat_interval_ms"] / 1000,
    )
