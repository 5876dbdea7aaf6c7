"""Re-judging stored requests and answers under another safety policy (`tokenstream audit rescreen`).

Every request admitted in the range is read back from the log (audit.run: the prepared input as
the safety processor judged it, the live verdicts, the whole answer from the tokens topic or the
transcript), judged again with the same classifier under the named policy, and its new verdicts are
written to ts.audit.rescreen.verdicts, stamped with that policy's version; the live verdict topic
is never written. At the end the scanned offsets are committed in the group
ts-audit-rescreen.<policy>, so `ops lag` shows how far each policy's re-screening has come. The
report counts, per stage and category, what would now be blocked or allowed differently.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer
from aiokafka.structs import OffsetAndMetadata

from audit.fold import Audit, _short
from audit.run import Auditor
from producers import publish, start_consumer
from schemas import SafetyVerdict
from topics.registry import RESCREEN_GROUP_PREFIX, RESCREENED

BATCH = 32  # texts judged per classifier call
EXAMPLES = 3  # examples kept per stage, change and category


@dataclass
class StageReport:
    judged: int = 0
    blocked_now: int = 0
    newly_blocked: Counter = field(default_factory=Counter)  # category -> requests
    newly_allowed: Counter = field(default_factory=Counter)
    examples: dict[tuple[str, str], list[tuple[str, str]]] = field(default_factory=dict)

    def example(self, change: str, category: str, request_id: str, text: str) -> None:
        kept = self.examples.setdefault((change, category), [])
        if len(kept) < EXAMPLES:
            kept.append((request_id, _short(text, 100)))


@dataclass
class Report:
    policy_version: str
    requests: int = 0
    stages: dict[str, StageReport] = field(
        default_factory=lambda: {"input": StageReport(), "output": StageReport()}
    )
    written: int = 0


class Rescreener:
    def __init__(self, classifier, producer: AIOKafkaProducer) -> None:
        self.classifier = classifier
        self.producer = producer
        self.report = Report(classifier.policy.version)
        self.pending: list[tuple[Audit, str, str]] = []  # (audit, stage, text)

    async def add(self, audit: Audit) -> None:
        self.report.requests += 1
        if audit.input_text:
            self.pending.append((audit, "input", audit.input_text))
        if audit.answer:
            self.pending.append((audit, "output", audit.answer))
        if len(self.pending) >= BATCH:
            await self.flush()

    async def flush(self) -> None:
        batch, self.pending = self.pending, []
        if not batch:
            return
        judgements = await asyncio.to_thread(self.classifier.judge, [text for _, _, text in batch])
        for (audit, stage, text), new in zip(batch, judgements, strict=True):
            live = audit.live_input if stage == "input" else audit.live_output
            live_blocked = bool(live and live.blocked)
            stats = self.report.stages[stage]
            stats.judged += 1
            stats.blocked_now += new.blocked
            if new.blocked and not live_blocked:
                for c in new.categories:
                    stats.newly_blocked[c] += 1
                    stats.example("newly blocked", c, audit.request_id, text)
            elif live_blocked and not new.blocked:
                for c in live.categories or ["(none named)"]:
                    stats.newly_allowed[c] += 1
                    stats.example("newly allowed", c, audit.request_id, text)
            await publish(
                self.producer,
                RESCREENED,
                SafetyVerdict(
                    request_id=audit.request_id,
                    conversation_id=audit.conversation_id,
                    tenant=audit.tenant or "default",
                    stage=stage,
                    blocked=new.blocked,
                    categories=new.categories,
                    scores=new.scores,
                    policy_version=new.policy_version,
                ),
                wait=False,
            )
            self.report.written += 1
        await self.producer.flush()


def group_of(policy_name: str) -> str:
    return RESCREEN_GROUP_PREFIX + policy_name


async def commit_progress(auditor: Auditor, bootstrap: str, policy_name: str) -> None:
    """Record the offsets just re-judged in the policy's own consumer group."""
    spans = getattr(auditor, "last_spans", [])
    if not spans:
        return
    consumer = await start_consumer(group=group_of(policy_name), bootstrap=bootstrap)
    try:
        consumer.assign([s.tp for s in spans])
        await consumer.commit({s.tp: OffsetAndMetadata(s.stop, "") for s in spans})
    finally:
        await consumer.stop()
