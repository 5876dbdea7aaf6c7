"""The benchmark's stand-in for a safety classifier on an accelerator: it judges every text allowed after
a set wait and does nothing else. It is never served.

`tokenstream bench tokens --judge stand-in` runs the real safety processor with it, to find what the
token path carries when the output check's model is not on the host's CPU (a deployment at GPU rates
runs its classifier on an accelerator, as it runs its engine): the processor still reads every chunk,
folds its window, batches the windows due, checkpoints and sends every verdict; only the forward pass
is replaced by a wait of TOKENSTREAM_BENCH_STAND_IN_JUDGE_MS per call (default 2 ms, in the thread
the real classifier runs in, holding no CPU), whatever the number of texts, as a batched forward on an
accelerator roughly costs.

The safety processor takes it only when TOKENSTREAM_BENCH_STAND_IN_JUDGE=1 is set (the benchmark sets
it for its own throwaway system): a deployment that set it by mistake would let everything through.
"""

from __future__ import annotations

import os
import time

from safety_model.classifier import Judgement
from safety_model.config import Policy, safety_settings

ENABLE_ENV = "TOKENSTREAM_BENCH_STAND_IN_JUDGE"  # "1": this safety processor is a benchmark's
CALL_MS_ENV = "TOKENSTREAM_BENCH_STAND_IN_JUDGE_MS"
DEFAULT_CALL_MS = 2.0


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV) == "1"


class StandInJudge:
    """SafetyClassifier's `judge` and `policy`, without a model: every text allowed, every score 0."""

    def __init__(self, policy: Policy, call_s: float) -> None:
        self.policy, self.call_s = policy, call_s
        self.categories = list(policy.categories)

    @classmethod
    def load(cls) -> StandInJudge:
        if not enabled():
            raise RuntimeError(f"the stand-in judge is the benchmark's only (set {ENABLE_ENV}=1 there)")
        call_ms = float(os.environ.get(CALL_MS_ENV, DEFAULT_CALL_MS))
        return cls(Policy.from_settings(safety_settings()), call_ms / 1000)

    def judge(self, texts: list[str]) -> list[Judgement]:
        time.sleep(self.call_s)
        scores = dict.fromkeys(self.categories, 0.0)
        return [Judgement(False, [], dict(scores), self.policy.version) for _ in texts]
