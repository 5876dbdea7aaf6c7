"""The capacity planner's arithmetic, from given figures and from bench/results."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenstream.plan import Measured, plan

GIVEN = Measured(
    tokens_per_s=100.0,
    output_tokens_per_s=40.0,
    ttft_p99_s=2.0,
    itl_p50_s=0.05,
    utilisation=0.8,
    streams_per_gateway=1000,
    source="given",
)


def test_workers_follow_demand_over_capacity_with_headroom():
    p = plan(rps=10, prompt_tokens=100, output_tokens=100, ttft_slo_s=10, m=GIVEN, target_utilisation=0.5)
    assert p.utilisation == 0.5  # the SLO allows more (0.8 x 10 / 2 = 4), the target caps it
    assert p.workers == 40  # ceil(2000 / (100 x 0.5))
    assert p.partitions == 80 and p.gateways == 1  # 10 x (2 + 100 x 0.05) = 70 streams


def test_a_tight_ttft_lowers_the_utilisation_and_adds_workers():
    loose = plan(10, 100, 100, 10, GIVEN, 0.7)
    tight = plan(10, 100, 100, 1.0, GIVEN, 0.7)  # 0.8 x 1 / 2 = 0.4 allowed
    assert tight.utilisation == pytest.approx(0.4)
    assert tight.workers == 50 > loose.workers == 29


def test_cost_per_million_requests():
    p = plan(10, 100, 100, 10, GIVEN, 0.5, price_per_worker_hour=2.0)
    assert p.hourly_cost == 80.0
    assert p.cost_per_million == pytest.approx(80.0 / 36000 * 1e6)


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        plan(0, 100, 100, 1, GIVEN)


def test_the_command_uses_the_measured_figures_and_shows_the_arithmetic():
    m = Measured.from_bench()
    assert m.tokens_per_s > m.output_tokens_per_s > 0 and 0 < m.utilisation <= 1
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenstream.cli",
            "plan",
            "--rps",
            "10",
            "--prompt-tokens",
            "200",
            "--output-tokens",
            "150",
            "--ttft-slo",
            "5",
            "--price",
            "2.5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    assert out.returncode == 0, out.stderr
    expected = plan(10, 200, 150, 5, m, 0.7, 2.5)
    assert f"ceil(3,500.0 / ({m.tokens_per_s:,.1f} x {expected.utilisation:.2f}))" in out.stdout
    assert str(expected.workers) in out.stdout and "cost per million requests" in out.stdout
