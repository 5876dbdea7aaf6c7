"""`tokenstream stack up | status | down` as a user runs it, on its own ports and data folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tokenstream.stack.service import ServiceError, free_port, maven_copy


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenstream.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def processes_under(folder: Path) -> list[psutil.Process]:
    """Processes whose command line or working directory lies in `folder`."""
    found = []
    for p in psutil.process_iter(["cmdline", "cwd"]):
        text = " ".join(p.info["cmdline"] or []) + " " + (p.info["cwd"] or "")
        if str(folder) in text:
            found.append(p)
    return found


@pytest.mark.heavy  # about 30 s: three Kafka, Redis and Weaviate starts (make test starts the stack once)
def test_stack_up_twice_is_harmless_and_down_leaves_nothing(tmp_path: Path):
    kafka = free_port()
    env = {
        # (not the session stack's broker passwords: this stack's are found in its own data folder)
        **{k: v for k, v in os.environ.items() if k != "TOKENSTREAM_KAFKA_CREDENTIALS_DIR"},
        "TOKENSTREAM_DATA_DIR": str(tmp_path / "data"),
        "TOKENSTREAM_KAFKA_BOOTSTRAP": f"127.0.0.1:{kafka}",
        "TOKENSTREAM_KAFKA_CONTROLLER_PORT": str(free_port()),
        "TOKENSTREAM_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        "TOKENSTREAM_CACHE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        "TOKENSTREAM_WEAVIATE_HTTP_PORT": str(free_port()),
        "TOKENSTREAM_WEAVIATE_GRPC_PORT": str(free_port()),
        "TOKENSTREAM_WEAVIATE_CLUSTER_PORTS": json.dumps([free_port() for _ in range(4)]),
        "COLUMNS": "200",
    }
    try:
        first = cli(env, "stack", "up")
        assert first.returncode == 0, first.stdout + first.stderr
        for name in ("kafka", "redis", "redis-cache", "weaviate"):
            assert f"{name}: ready" in first.stdout
        pids = {p.pid for p in processes_under(tmp_path)}
        assert len(pids) >= 4

        second = cli(env, "stack", "up")
        assert second.returncode == 0, second.stdout + second.stderr
        assert second.stdout.count("already running") == 4
        assert {p.pid for p in processes_under(tmp_path)} == pids  # nothing new, nothing restarted

        status = cli(env, "stack", "status")
        assert status.stdout.count("ready") == 4, status.stdout

        applied = cli(env, "topics", "apply")
        assert applied.returncode == 0 and "ts.tokens" in applied.stdout and "created" in applied.stdout
        described = cli(env, "topics", "describe")
        assert "ts.inference.smollm2" in described.stdout and "missing" not in described.stdout
    finally:
        down = cli(env, "stack", "down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert down.stdout.count("stopped") == 4
    assert processes_under(tmp_path) == []
    assert "stopped" in cli(env, "stack", "status").stdout


def test_system_up_without_regions_starts_the_stack_then_the_roles(tmp_path: Path, monkeypatch):
    """`make run`'s command: `system up` calls the stack's command as a function; without --regions it
    must start one stack, not take typer's option object for a list of regions (it did, and crashed).
    The stack and the roles are not started here (the test above starts a stack; make run the rest)."""
    from typer.testing import CliRunner

    from common.config import settings
    from tokenstream import cli as ts_cli
    from tokenstream.stack.stack import Stack

    monkeypatch.setenv("TOKENSTREAM_DATA_DIR", str(tmp_path / "data"))
    settings.cache_clear()
    done: list[str] = []
    monkeypatch.setattr(Stack, "up", lambda self, say=print: done.append("stack"))
    monkeypatch.setattr(ts_cli, "_system_up", lambda: done.append("roles"))
    try:
        result = CliRunner().invoke(ts_cli.app, ["system", "up"])
    finally:
        settings.cache_clear()
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert done == ["stack", "roles"]


def test_a_failed_jar_resolution_says_why_in_plain_text(tmp_path: Path):
    """Maven's output is kept back (it writes terminal escape codes even in batch mode) and shown only
    when it fails: as plain text inside the error, so an install log stays readable."""
    with pytest.raises(ServiceError) as failed:
        maven_copy(tmp_path / "missing.pom.xml", tmp_path / "libs", "kafka")
    assert "kafka: maven could not resolve its jars" in str(failed.value)
    assert "missing.pom.xml" in str(failed.value) and "\x1b" not in str(failed.value)
