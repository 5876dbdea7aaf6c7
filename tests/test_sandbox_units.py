"""The sandbox's seccomp program and folder quota, the file and store ids, and list pages, in pieces
(no broker; the escape suite in test_sandbox.py drives them through a real tool processor)."""

from __future__ import annotations

import json
import os
import time

from gateway.file_objects import page
from schemas import ToolResult
from schemas.files import file_kind
from schemas.ids import FILE_ID, VECTOR_STORE_ID, new_file_id, new_vector_store_id
from schemas.tools import notebook_logs
from tests.tool_support import sandbox_root
from tools import seccomp
from tools.config import ToolSettings
from tools.sandbox import Budget, Sandbox, budget, folder_usage, undo_writes


def test_the_seccomp_program_compiles_to_bpf():
    program = seccomp.program()
    assert program and len(program) % 8 == 0  # struct sock_filter is 8 bytes
    fd = seccomp.program_fd()
    try:
        assert os.read(fd, len(program) + 1) == program
    finally:
        os.close(fd)


def test_the_quota_is_shared_by_the_folder_tmp_and_shm():
    mib = 1 << 20
    assert budget(64 * mib, 0, 8 * mib, 4 * mib) == Budget(folder=52 * mib, tmp=8 * mib, shm=4 * mib)
    nearly = budget(64 * mib, 60 * mib, 8 * mib, 4 * mib)  # 4 MiB left: a quarter and an eighth of it
    assert nearly == Budget(folder=64 * mib - (1536 << 10), tmp=1 * mib, shm=512 << 10)
    assert nearly.folder > 60 * mib  # what the folder holds already always fits its share
    assert all(b % 4096 == 0 for b in (nearly.tmp, nearly.shm))  # whole pages: tmpfs rounds up
    assert budget(64 * mib, 64 * mib - 16 * 1024, 8 * mib, 4 * mib) is None  # too little left: full
    assert budget(64 * mib, 64 * mib, 8 * mib, 4 * mib) is None


def test_undo_removes_only_what_the_run_wrote(tmp_path):
    old = tmp_path / "kept.txt"
    old.write_bytes(b"k" * 10_000)
    os.utime(old, (time.time() - 60, time.time() - 60))
    since = time.time() - 0.05
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "a.bin").write_bytes(b"a" * 5000)
    (tmp_path / "b.bin").write_bytes(b"b")
    os.symlink("/etc/passwd", tmp_path / "link")
    used, entries = folder_usage(tmp_path)
    assert used >= 15_000 and entries == 5
    undo_writes(tmp_path, since)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt"] and os.path.exists("/etc/passwd")


async def test_a_full_folder_refuses_the_call_before_starting_a_sandbox(tmp_path):
    sandbox = Sandbox(ToolSettings(sandbox_dir=tmp_path, folder_mb=1))
    folder = sandbox.workdir("t", "conv")
    (folder / "blob").write_bytes(os.urandom(1 << 20))
    run = await sandbox.run("t", "conv", "print('never')")
    assert run.error.startswith("the working folder is full") and run.stdout == ""


def test_ids_and_kinds():
    assert FILE_ID.match(new_file_id()) and VECTOR_STORE_ID.match(new_vector_store_id())
    assert new_file_id() != new_file_id()
    assert [file_kind(n) for n in ("a.MD", "b.htm", "c.text", "d.pdf", "e.zip", "noext")] == [
        "md",
        "html",
        "txt",
        "pdf",
        None,
        None,
    ]


def test_list_pages_follow_openai_cursors():
    items = [{"id": f"x{i}"} for i in range(5)]  # oldest first
    first = page(items, limit=2, order="desc", after=None, before=None)
    assert [i["id"] for i in first["data"]] == ["x4", "x3"] and first["has_more"] and first["last_id"] == "x3"
    second = page(items, limit=2, order="desc", after="x3", before=None)
    assert [i["id"] for i in second["data"]] == ["x2", "x1"]
    last = page(items, limit=2, order="asc", after="x2", before=None)
    assert [i["id"] for i in last["data"]] == ["x3", "x4"] and not last["has_more"]
    assert page(items, limit=10, order="asc", after=None, before="x2")["data"] == items[:2]
    assert page(items, limit=10, order="asc", after="gone", before=None)["data"] == []


async def test_a_failing_runs_traceback_is_the_codes_own():
    """The traceback the code's failure prints starts at the code (as plain Python's does), not in the
    runner around it; a syntax error shows only where the code is wrong. What the model and the
    client read of the run (notebook_logs) says the reason once."""
    sandbox = Sandbox(ToolSettings(sandbox_dir=sandbox_root()))
    crash = await sandbox.run("t", "conv", "x = 1\n1 / (x - 1)")
    assert crash.stderr.splitlines() == [
        "Traceback (most recent call last):",
        '  File "<code>", line 2, in <module>',
        "ZeroDivisionError: division by zero",
    ], crash.stderr
    typo = await sandbox.run("t", "conv", "100 + 100 = 200")
    assert typo.stderr.startswith('  File "<code>", line 1\n') and "ast.py" not in typo.stderr, typo.stderr
    assert typo.error.startswith('File "<code>", line 1') and typo.error.endswith("instead of '='?")
    result = ToolResult(
        request_id="r",
        call_id="c",
        name="code_interpreter",
        ok=False,
        error=typo.error,
        output=json.dumps({"stdout": typo.stdout, "stderr": typo.stderr, "value": None}),
    )
    assert notebook_logs(result) == typo.stderr and notebook_logs(result).count("SyntaxError") == 1
