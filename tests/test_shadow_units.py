"""The shadow evaluation's figures and gate on hand-made answers (no broker: tests/test_shadow.py runs
it whole)."""

from __future__ import annotations

import pytest

from schemas import ChatMessage, Completion, FunctionCall, InferenceRequest, MessageToolCall
from schemas.tokens import Timings, Usage
from tokenstream.shadow.compare import figures
from tokenstream.shadow.gate import failed, new_gate, parse, refusal
from tokenstream.shadow.replay import Pair


def done(
    text: str, calls: list[tuple[str, str]] = (), ttft_s: float = 0.1, tokens: int = 11, decode_s: float = 1.0
) -> Completion:
    return Completion(
        request_id="r",
        seq=1,
        finish_reason="tool_calls" if calls else "stop",
        text=text,
        tool_calls=[
            MessageToolCall(id=f"c{i}", function=FunctionCall(name=n, arguments=a))
            for i, (n, a) in enumerate(calls)
        ],
        usage=Usage(prompt_tokens=5, completion_tokens=tokens),
        timings=Timings(queue_s=0.0, prefill_s=ttft_s, decode_s=decode_s),
    )


def pair(served: Completion, shadow: Completion) -> Pair:
    request = InferenceRequest(request_id="r", model="m", messages=[ChatMessage(role="user", content="hi")])
    return Pair(request, served, "s", shadow)


def test_figures_count_what_agrees_how_far_the_rest_is_and_the_speed():
    pairs = [
        pair(done("Blue."), done("Blue.", ttft_s=0.05, decode_s=0.5)),
        pair(done("A red apple."), done("A green apple.", ttft_s=0.05, decode_s=0.5)),
        pair(
            done("", [("get_weather", '{"city": "Oslo", "unit": "c"}')]),
            done("", [("get_weather", '{"unit": "c", "city": "Oslo"}')], ttft_s=0.05, decode_s=0.5),
        ),
        pair(done("", [("get_weather", '{"city": "Oslo"}')]), done("No.", ttft_s=0.05, decode_s=0.5)),
    ]
    blocked = {"A green apple.": True}
    got = figures(pairs, blocked=lambda texts: [blocked.get(t, False) for t in texts])
    assert got["agreement"] == 0.5  # the first, and the third (the same call: arguments as JSON values)
    assert got["tool_agreement"] == 0.5  # of the two where a side called a tool
    assert 0.5 < got["similarity"] < 1.0
    assert got["safety_changes"] == 1.0
    assert got["ttft_ratio"] == pytest.approx(0.5) and got["tokens_per_s_ratio"] == pytest.approx(2.0)


def test_a_gate_fails_on_a_condition_unmet_or_a_figure_missing_and_names_bad_conditions():
    assert parse("agreement >= 0.9") == ("agreement", ">=", 0.9)
    assert failed(["agreement>=0.9", "safety_changes<=0"], {"agreement": 0.95, "safety_changes": 0.0}) == []
    assert failed(["agreement>=0.9", "ttft_ratio<2"], {"agreement": 0.85}) == [
        "agreement>=0.9",
        "ttft_ratio<2",
    ]
    with pytest.raises(ValueError, match="no figure 'speed'"):
        parse("speed>=1")
    with pytest.raises(ValueError, match="expected FIGURE>=NUMBER"):
        parse("agreement=1")


def test_route_set_needs_a_passed_gate_against_the_requested_model_for_every_other_target():
    def gate(candidate: str, served: str, passed: bool):
        return new_gate(
            candidate=candidate,
            served=served,
            since=0.0,
            until=1.0,
            requests=10,
            figures={"agreement": 0.8},
            require=["agreement>=0.9"],
            passed=passed,
        )

    gates = {"v2": gate("v2", "m", True), "v3": gate("v3", "m", False), "v4": gate("v4", "other", True)}
    assert refusal("m", ["m", "v2"], gates) is None
    assert refusal("m", ["m"], {}) is None  # the model itself needs no gate
    assert "failed its gate (agreement>=0.9): agreement 0.8" in refusal("m", ["m", "v3"], gates)
    assert "was against other, not m" in refusal("m", ["v4"], gates)
    assert "no shadow evaluation" in refusal("m", ["v5"], gates)
