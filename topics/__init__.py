"""The single registry of Kafka topics: names, partitions, retention, keys and event types.

Every role asks this package for a topic name; no other module spells one out.
"""

from topics.registry import (
    CHAT_REQUESTS,
    CONTROL,
    CONVERSATION_TURNS,
    CONVERSATIONS,
    DEAD_LETTER,
    FILE_INGEST,
    PREPARED,
    REGISTRY,
    RESCREENED,
    ROUTES,
    SAFETY_WINDOWS,
    SCREENED,
    TOKENS,
    TOOL_CALLS,
    TOOL_RESULTS,
    TRANSCRIPTS,
    VERDICTS,
    TopicSpec,
    inference_topic,
    processor_group,
    spec_for,
    worker_group,
)

__all__ = [
    "CHAT_REQUESTS",
    "CONTROL",
    "CONVERSATION_TURNS",
    "CONVERSATIONS",
    "DEAD_LETTER",
    "FILE_INGEST",
    "PREPARED",
    "REGISTRY",
    "RESCREENED",
    "ROUTES",
    "SAFETY_WINDOWS",
    "SCREENED",
    "TOKENS",
    "TOOL_CALLS",
    "TOOL_RESULTS",
    "TRANSCRIPTS",
    "VERDICTS",
    "TopicSpec",
    "inference_topic",
    "processor_group",
    "spec_for",
    "worker_group",
]
