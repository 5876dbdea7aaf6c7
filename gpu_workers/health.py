"""What a worker's /health/ready and /health/live say (served on its metrics port, common/health.py).

Ready only while the worker can take work:
- its model is loaded and its consumer has joined the group once;
- the broker answered the group check (`producers.membership.GroupWatch`, every `health_interval_s`)
  within `broker_stale_s` (5 s);
- its consumer is a member of `worker.<model>`, holding a partition whenever the group is stable with
  no more members than partitions (an extra member, idle by design, stays ready);
- the engine loop is not stuck: with requests in the engine, a step ended within `stuck_s` (30 s).

Live unless the engine is stuck while the broker answers: the one fault a restart cures. (A step loop
waiting on a broker that is away, to publish its tokens, is not stuck by its own fault: it goes on when
the broker is back, and a restart would only lose its batch.)
"""

from __future__ import annotations

import time
from collections.abc import Callable

from common.health import Report
from gpu_workers.config import WorkerConfig
from producers.membership import Standing


class WorkerHealth:
    def __init__(self, cfg: WorkerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.clock = cfg, clock
        self.phase = "loading the model"
        self.engine = None  # set once built: has_work, queued, running
        self.standing: Standing | None = None  # set once the consumer has joined its group
        self.progress_at = clock()  # the step loop's last turn: a step ended, or it found no work

    def step_loop_turned(self) -> None:
        self.progress_at = self.clock()

    def stalled_s(self) -> float:
        """How long the engine has had work without a step ending (0 when it has none)."""
        engine = self.engine
        if engine is None or not engine.has_work:
            return 0.0
        return self.clock() - self.progress_at

    def report(self) -> Report:
        s = self.standing
        if s is None:
            return Report(ready=False, detail=[self.phase])
        detail = s.problems(self.cfg.broker_stale_s)
        stalled = self.stalled_s()
        stuck = stalled > self.cfg.stuck_s
        if stuck:
            detail.append(
                f"engine: no step for {stalled:.0f} s with {len(self.engine.running)} running and "
                f"{self.engine.queued} waiting"
            )
        age = s.broker_age_s()
        broker = s.broker_ok(self.cfg.broker_stale_s)
        return Report(
            ready=not detail,
            live=not (stuck and broker),
            detail=detail,
            checks={
                "broker": broker,
                "broker_age_s": None if age is None else round(age, 1),
                "group": s.group,
                "member": s.member,
                "partitions": s.partitions,
                "group_state": s.state,
                "members": s.members,
                "engine_stalled_s": round(stalled, 1),
            },
        )
