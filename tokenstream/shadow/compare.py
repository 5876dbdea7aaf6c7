"""A candidate's answers against what was served: the figures `tokenstream shadow` reports and gates on.

agreement          share of requests answered exactly as served (the same text and the same tool calls)
similarity         mean of difflib's ratio between the two texts (1.0: the same; a measure of how far
                   apart the answers that differ are)
tool_agreement     of the requests where either side called a tool, the share with the same calls (name
                   and arguments, as JSON values); 1.0 when no side called any
safety_changes     requests whose answer the safety classifier (the safety processor's model and policy)
                   judges otherwise than the served one (blocked on one side only)
ttft_ratio         the candidate's median time to first token at its worker (queue + prefill) over the
                   served one's; below 1 is faster
tokens_per_s_ratio the candidate's median decode rate (tokens after the first over decode time) over the
                   served one's; above 1 is faster
"""

from __future__ import annotations

import json
import statistics
from difflib import SequenceMatcher

from schemas import Completion
from tokenstream.shadow.replay import Pair

FIGURES = ("agreement", "similarity", "tool_agreement", "safety_changes", "ttft_ratio", "tokens_per_s_ratio")


def calls(done: Completion) -> list[tuple[str, object]]:
    out = []
    for call in done.tool_calls:
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except ValueError:
            arguments = call.function.arguments
        out.append((call.function.name, arguments))
    return out


def ttft(done: Completion) -> float:
    return done.timings.queue_s + done.timings.prefill_s


def decode_rate(done: Completion) -> float | None:
    after_first = done.usage.completion_tokens - 1
    return after_first / done.timings.decode_s if after_first > 0 and done.timings.decode_s > 0 else None


def figures(pairs: list[Pair], blocked=None) -> dict[str, float]:
    """The figures over the pairs the candidate answered; `blocked(texts) -> [bool]` judges safety
    (default: the safety processor's classifier, loaded here)."""
    answered = [p for p in pairs if p.shadow is not None]
    if not answered:
        return {}
    same = [p.served.text == p.shadow.text and calls(p.served) == calls(p.shadow) for p in answered]
    with_tools = [p for p in answered if p.served.tool_calls or p.shadow.tool_calls]
    if blocked is None:
        blocked = _classifier()
    served_blocked = blocked([p.served.text for p in answered])
    shadow_blocked = blocked([p.shadow.text for p in answered])
    out = {
        "agreement": sum(same) / len(answered),
        "similarity": statistics.fmean(
            SequenceMatcher(None, p.served.text, p.shadow.text).ratio() for p in answered
        ),
        "tool_agreement": (
            sum(calls(p.served) == calls(p.shadow) for p in with_tools) / len(with_tools)
            if with_tools
            else 1.0
        ),
        "safety_changes": float(sum(a != b for a, b in zip(served_blocked, shadow_blocked, strict=True))),
    }
    served_ttft = statistics.median(ttft(p.served) for p in answered)
    if served_ttft > 0:
        out["ttft_ratio"] = statistics.median(ttft(p.shadow) for p in answered) / served_ttft
    rates = [(decode_rate(p.served), decode_rate(p.shadow)) for p in answered]
    rates = [(a, b) for a, b in rates if a and b]
    if rates:
        out["tokens_per_s_ratio"] = statistics.median(b for _, b in rates) / statistics.median(
            a for a, _ in rates
        )
    return out


def _classifier():
    from safety_model.classifier import SafetyClassifier

    classifier = SafetyClassifier.load()
    return lambda texts: [j.blocked for j in classifier.judge(texts)]
