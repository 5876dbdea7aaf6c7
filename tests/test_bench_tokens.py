"""`tokenstream bench tokens`: its synthetic GPU, its figures, and (heavy) a short run of the whole chain.

The recorded figures (bench/RESULTS.md) come from a run of several stages; `make test` keeps what
needs no system: the synthetic backend's steps and refusal, and how a stage's figures are made from
what the log and the clients saw. The run through every real role is `heavy` (its system alone takes
a minute to start on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from bench.sse_clients import Received
from bench.token_meter import Chunk, Sample
from bench.tokens import _figures, _judge
from gpu_workers.backend_synthetic import ENABLE_ENV, VOCABULARY, SyntheticEngine, synthetic_engine
from gpu_workers.sequence import Sequence


def test_the_synthetic_backend_is_refused_unless_a_benchmark_enables_it(monkeypatch):
    monkeypatch.delenv(ENABLE_ENV, raising=False)
    with pytest.raises(SystemExit, match="never served"):
        synthetic_engine(SimpleNamespace(model="smollm2", max_running=4, max_model_len=None))


def test_the_stand_in_judge_is_refused_unless_a_benchmark_enables_it_and_allows_every_text(monkeypatch):
    from safety_model import stand_in

    monkeypatch.delenv(stand_in.ENABLE_ENV, raising=False)
    with pytest.raises(RuntimeError, match="benchmark's only"):
        stand_in.StandInJudge.load()
    monkeypatch.setenv(stand_in.ENABLE_ENV, "1")
    monkeypatch.setenv(stand_in.CALL_MS_ENV, "30")
    judge = stand_in.StandInJudge.load()
    started = time.perf_counter()
    verdicts = judge.judge(["one", "two", "three"])
    assert time.perf_counter() - started >= 0.03  # one wait per call, whatever the number of texts
    assert [v.blocked for v in verdicts] == [False] * 3
    assert set(verdicts[0].scores) == set(judge.policy.categories) and verdicts[0].categories == []


def test_the_synthetic_backend_steps_its_batch_at_its_step_time_to_max_tokens():
    from common.models import load_tokenizer

    engine = SyntheticEngine(load_tokenizer("smollm2"), max_running=2, step_s=0.01, max_model_len=4096)
    for i in range(3):
        engine.add(Sequence(f"r{i}", [1, 2, 3], max_tokens=4))
    engine.add(Sequence("gone", [1, 2, 3], max_tokens=4))
    engine.cancel("gone")
    outputs, started = [], time.monotonic()
    while engine.has_work:
        outputs += engine.step()
    took = time.monotonic() - started
    # two at a time (the batch), four tokens each: 4 steps for r0 and r1, 4 more for r2
    assert engine.steps == 8 and took >= 8 * 0.01
    text = {rid: "".join(o.text for o in outputs if o.seq.request_id == rid) for rid in ("r0", "r1", "r2")}
    assert set(text.values()) == {"".join(VOCABULARY[:4])}
    ends = {o.seq.request_id: o.finish_reason for o in outputs if o.finish_reason}
    assert ends == {"r0": "length", "r1": "length", "r2": "length", "gone": "cancelled"}
    for rid in ("r0", "r1", "r2"):  # gap-free chunk numbers, then the end
        numbers = [
            o.chunk_seq if o.finish_reason is None else o.completion_seq
            for o in outputs
            if o.seq.request_id == rid
        ]
        assert numbers == list(range(len(numbers)))


def test_a_stage_s_figures_from_the_log_and_the_clients():
    t0 = 1000.0
    start = Sample(
        t0, {"worker": 1.0, "gateway": 2.0}, {("ts.tokens", 0): 10, ("ts.x", 0): 5}, {"ts.tokens": 100}
    )
    end = Sample(
        t0 + 2, {"worker": 1.5, "gateway": 2.2}, {("ts.tokens", 0): 16, ("ts.x", 0): 5}, {"ts.tokens": 700}
    )
    chunks = [Chunk("a", s, t0 + 0.1 * s, 1, 100, (0, 10 + s)) for s in range(4)]  # a: seq 0-3
    chunks += [Chunk("b", 0, t0 + 0.5, 2, 120, (0, 14)), Chunk("b", 1, t0 + 0.6, 1, 80, (0, 15))]
    chunks.append(Chunk("a", 9, t0 + 2.5, 1, 100, (0, 16)))  # created after the window: not counted
    seen = Received(rid_of=["a", "b"])
    # a's frames 0 and 1 alone, then one frame for 2 and 3 (merged for a slow reader); b's 1 never came
    seen.received = {"a": {0: t0 + 0.01, 1: t0 + 0.12, 3: t0 + 0.35}, "b": {0: t0 + 0.52}}
    seen.statuses = {"200": 2}
    f = _figures(2, 0.02, 0.5, start, end, chunks, seen, {"ts-safety": 0.3})
    assert f["chunks_in_window"] == 6 and f["chunks_missing"] == 1
    assert f["delivered_tokens_per_s"] == (4 + 2) / 2 and f["written_tokens_per_s"] == 7 / 2
    assert f["lag_ms"]["p50"] == pytest.approx(20.0) and f["lag_ms"]["max"] == pytest.approx(150.0)
    assert f["cpu_us_per_token"] == {
        "worker": pytest.approx(0.5 / 6 * 1e6, rel=1e-3),
        "gateway": pytest.approx(0.2 / 6 * 1e6, rel=1e-3),
    }
    assert f["topics"] == {
        "ts.tokens": {"records": 6, "bytes": 600, "records_per_token": 1.0, "bytes_per_token": 100.0}
    }
    assert f["tokens_topic_record_bytes_mean"] == pytest.approx(600 / 6, rel=1e-3)
    # chunks of one step record (schemas/steps.py) share its bytes: the record counts once
    shared = [Chunk(c.request_id, c.seq, c.created_at, c.tokens, c.size, (0, 10)) for c in chunks]
    assert _figures(2, 0.02, 0.5, start, end, shared, seen, {})["tokens_topic_record_bytes_mean"] == 600
    held, why = _judge(f, 100.0, 10.0)
    assert not held and any("lag p99" in w for w in why) and any("never reached" in w for w in why)


@pytest.mark.heavy  # every role a real process on a throwaway Kafka and Redis (2-3 min): `make test-all`
def test_bench_tokens_delivers_every_token_in_order_and_reports_its_costs(tmp_path):
    out = tmp_path / "tokens.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenstream.cli",
            "bench",
            "tokens",
            "--streams",
            "2,4",
            "--window-s",
            "2",
            "--lag-limit-ms",
            "1000",
            "--perf-records",
            "5000",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    figures = json.loads(out.read_text())
    first = figures["stages"][0]
    assert first["streams_open"] == 2 and first["http_statuses"] == {"200": 2}
    assert (
        first["chunks_in_window"] > 0 and first["chunks_missing"] == 0 and first["frames_out_of_order"] == 0
    )
    assert first["delivered_tokens_per_s"] > 0 and first["lag_ms"]["p99"] < 1000
    assert {"worker", "gateway", "conversation", "safety", "router", "kafka"} <= set(
        first["cpu_us_per_token"]
    )
    assert first["topics"]["ts.tokens"]["records"] > 0 and first["topics"]["ts.tokens"]["bytes_per_token"] > 0
    assert figures["baseline"]["records"] == 5000 and figures["baseline"]["records_per_s"] > 0
    assert "stage 1/2" in run.stdout
