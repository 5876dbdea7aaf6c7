"""`tokenstream system status` (and `stack status`) written to a file or a pipe, as `make run > log 2>&1`
writes it: every row whole on one line, not cut to rich's 80 columns, and no aiokafka INFO lines."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from tokenstream import cli, stack_cli
from tokenstream.stack.service import Status

LOG = Path("/home/operator/.local/share/tokenstream/regions/eu/logs/processor-conversation-2.log")
DETAIL = "broker: no answer for 7 s; degraded: weaviate: no answer (circuit open for 30 s)"


def test_the_status_table_printed_to_a_file_keeps_every_row_whole(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(stack_cli, "console", Console(file=out))  # not a terminal: rich's 80 columns
    assert not stack_cli.console.is_terminal and stack_cli.console.width == 80
    rows = [
        Status("eu: processor-conversation-2", True, False, 4242, "127.0.0.1:18080", LOG, DETAIL),
        Status("eu: kafka", False, False, None, "127.0.0.1:19092", LOG.with_name("kafka.log")),
    ]
    stack_cli.print_status("process", rows)
    lines = out.getvalue().splitlines()
    first = next((line for line in lines if "eu: processor-conversation-2" in line), "")
    for cell in ("4242", "127.0.0.1:18080", DETAIL, str(LOG), "not ready"):
        assert cell in first, out.getvalue()
    second = next((line for line in lines if "eu: kafka" in line), "")
    assert "stopped" in second and str(LOG.with_name("kafka.log")) in second, out.getvalue()
    assert "…" not in out.getvalue() and len({len(line) for line in lines}) == 1  # nothing cut or folded


def test_a_table_that_fits_is_printed_as_before(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(stack_cli, "console", Console(file=out))
    stack_cli.print_status("service", [Status("redis", False, False, None, "127.0.0.1:6379", Path("r.log"))])
    assert max(len(line) for line in out.getvalue().splitlines()) < 80


def test_an_operators_command_shows_aiokafkas_warnings_only():
    """`system status` asks the broker about each role's group as admin: aiokafka's INFO line for each
    connection ("Authenticated as admin via SCRAM-SHA-512") no longer lands between the table's lines."""
    logger = logging.getLogger("aiokafka")
    before = logger.level
    try:
        cli.quiet_kafka_clients()
        assert not logging.getLogger("aiokafka.conn").isEnabledFor(logging.INFO)
        assert logging.getLogger("aiokafka.admin").isEnabledFor(logging.WARNING)
    finally:
        logger.setLevel(before)
    assert cli._broker_user(["system", "status"]) == "admin"  # quieted: an operator's command
    assert cli._broker_user(["worker", "--model", "smollm2"]) == "worker"  # a role keeps its INFO lines


def test_system_status_with_nothing_running_prints_whole_rows_into_a_pipe(tmp_path: Path):
    """The command itself, its stdout a pipe (not a terminal, no COLUMNS): a table of stopped processes,
    each row on one line with its whole log path."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TOKENSTREAM_KAFKA_BOOTSTRAP")}
    env["TOKENSTREAM_DATA_DIR"] = str(tmp_path / "a-data-folder-with-a-long-name-as-operators-have" / "x")
    done = subprocess.run(
        [sys.executable, "-m", "tokenstream.cli", "system", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if "stopped" in line]
    assert len(rows) >= 4, done.stdout  # the stack's services and the roles
    whole = re.compile(re.escape(env["TOKENSTREAM_DATA_DIR"]) + r"/logs/[\w.-]+\.log +│$")
    assert all(whole.search(row.rstrip()) for row in rows), done.stdout
    assert "Authenticated as" not in done.stdout + done.stderr
