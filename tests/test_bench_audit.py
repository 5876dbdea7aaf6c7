"""`tokenstream bench audit` end to end on a small run (the recorded figures use 1,000,000 events)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.heavy  # a benchmark's own broker and 20,000 events (20 s): `make test-all`
def test_bench_audit_replays_every_event_and_reports_its_figures(tmp_path):
    out = tmp_path / "audit.json"
    run = subprocess.run(
        [sys.executable, "-m", "tokenstream.cli", "bench", "audit", "--events", "20000", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    figures = json.loads(out.read_text())
    assert figures["events_written"] >= 20000
    assert (
        figures["audit"]["records"]
        == figures["events_written"]
        == figures["baseline_bare_consumer"]["records"]
    )
    assert (
        figures["audit"]["requests_checked"] == figures["requests"]
        and figures["audit"]["requests_failing"] == 0
    )
    assert figures["audit"]["events_per_s"] > 0 and figures["ratio_audit_vs_bare"] > 0
    assert figures["audit"]["rss_mib_peak"] >= figures["audit"]["rss_mib_before"]
