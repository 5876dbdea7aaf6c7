"""What the tool processor's /health/ready says (with --health-port; common/health.py serves it).

Ready while its tool-call consumer can take work: started (sandbox tried, embedder loaded), the broker
answered the group check within `broker_stale_s` (5 s), and it is a member of `ts-tools` holding a
partition when it should (producers/membership.py). Weaviate is optional (common/vectordb.py):
while it does not answer, the process stays ready and `degraded` says what waits on it: file_search
calls answer an error at once, ingestion holds its event (and says for how long).
"""

from __future__ import annotations

from common import vectordb
from common.health import Report
from tools.config import tool_settings


def report(processor, ingestor) -> Report:
    """Called in the health server's thread: reads what the loops recorded, and asks Weaviate."""
    weaviate = vectordb.ready(timeout_s=0.5)
    degraded = (
        []
        if weaviate
        else ["weaviate: no answer (file_search calls answer an error at once; ingestion holds its event)"]
    )
    held = ingestor.holding()
    if held:
        degraded.append(held)
    watch = processor.watch
    if watch is None:
        return Report(
            ready=False,
            detail=["starting: trying the sandbox and loading the embedder"],
            degraded=degraded,
            checks={"weaviate": weaviate},
        )
    s, stale = watch.standing, tool_settings().broker_stale_s
    return Report(
        ready=not (detail := s.problems(stale)),
        detail=detail,
        degraded=degraded,
        checks={
            "broker": s.broker_ok(stale),
            "group": s.group,
            "member": s.member,
            "partitions": s.partitions,
            "weaviate": weaviate,
        },
    )
