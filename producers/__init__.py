"""The one place every role gets its Kafka clients from.

producer = await start_producer()             # idempotent, acks=all, lz4, no linger (producers/settings.py)
await publish(producer, TOKENS, event, key=event.request_id)
consumer = await start_consumer(TOKENS, group="gateway")   # manual commits
await dead_letter(producer, record, exc, group="gateway")  # poison event -> ts.deadletter
"""

from producers.clients import commit_past, start_consumer, start_producer, stop_clients
from producers.consume import events
from producers.deadletter import dead_letter
from producers.publish import decode_record, publish

__all__ = [
    "commit_past",
    "dead_letter",
    "decode_record",
    "events",
    "publish",
    "start_consumer",
    "start_producer",
    "stop_clients",
]
