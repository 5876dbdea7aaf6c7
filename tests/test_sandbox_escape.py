"""Trust between the sandbox and everything around it: each attempt runs through the real sandbox
(tools.sandbox.Sandbox.run, as the code interpreter runs it: setpriv, bubblewrap, the seccomp allow
list, the launcher) and must be refused. No broker: each case is one or two sandbox runs."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import select
import socket
import uuid
from pathlib import Path

import pytest

from tests.tool_support import sandbox_root
from tools.config import ToolSettings
from tools.sandbox import Sandbox, folder_name

QUOTA_MB = 8
LIBC = (
    "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
    "def call(nr, *args):\n    rc = libc.syscall(nr, *args)\n"
    "    return 'ok' if rc >= 0 else os.strerror(ctypes.get_errno())\n"
)


@pytest.fixture
def sandbox() -> Sandbox:
    return Sandbox(
        ToolSettings(
            sandbox_dir=sandbox_root(),
            cpu_s=5,
            wall_s=20,
            memory_mb=256,
            processes=16,
            file_mb=QUOTA_MB,
            folder_mb=QUOTA_MB,
        )
    )


def conv() -> str:
    return f"conv-{uuid.uuid4().hex[:8]}"


async def run_json(sandbox: Sandbox, code: str, conversation: str | None = None) -> dict:
    """Run code whose last expression is a dict; return it (the run must have ended normally)."""
    run = await sandbox.run("t-escape", conversation or conv(), code)
    assert run.error is None and run.value is not None, (run.error, run.stderr[-2000:])
    import ast

    return ast.literal_eval(run.value)


async def test_no_trace_of_the_parent_environment_anywhere_inside(sandbox, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("TS_ESCAPE_SECRET", secret)  # the tool processor's environment (keys, URLs)
    code = (
        "import os\nseen = {}\n"
        "names = [n for n in os.listdir('/proc') if n.isdigit()] + ['self', 'thread-self']\n"
        "for n in names:\n"
        "    for part in ('environ', 'cmdline'):\n"
        "        try:\n"
        "            seen[f'/proc/{n}/{part}'] = open(f'/proc/{n}/{part}', 'rb').read()"
        ".decode(errors='replace')\n"
        "        except OSError as e:\n"
        "            seen[f'/proc/{n}/{part}'] = f'refused: {e}'\n"
        "seen['os.environ'] = repr(dict(os.environ))\nseen"
    )
    seen = await run_json(sandbox, code)
    assert seen["/proc/1/environ"] == "PATH=/usr/bin:/bin\0"  # read: bubblewrap (pid 1) has PATH alone
    assert "HOME=/work" in seen["/proc/self/environ"]  # the code's own, set by bubblewrap
    leaked = [where for where, text in seen.items() if secret in text or "TS_ESCAPE_SECRET" in text]
    assert not leaked, leaked


async def test_tmpfs_and_dev_cannot_hold_more_than_the_quota(sandbox):
    code = (
        "import errno, os\nwritten, stopped = {}, {}\n"
        "def fill(path, limit):\n"
        "    n = 0\n"
        "    try:\n"
        "        with open(path, 'wb', buffering=0) as f:\n"
        "            while n < limit:\n"
        "                n += f.write(b'x' * (256 << 10))\n"
        "    except OSError as e:\n"
        "        stopped[path] = errno.errorcode[e.errno]\n"
        "    written[path] = os.stat(path).st_size if os.path.exists(path) else 0\n"
        f"limit = {3 * QUOTA_MB} << 20\n"
        "for path in ('/tmp/fill', '/dev/shm/fill', '/dev/fill', '/work/fill'):\n"
        "    fill(path, limit)\n"
        "os.unlink('/work/fill')\n"
        "{'written': written, 'stopped': stopped}"
    )
    result = await run_json(sandbox, code)
    written, stopped = result["written"], result["stopped"]
    assert stopped == {
        "/tmp/fill": "ENOSPC",
        "/dev/shm/fill": "ENOSPC",
        "/dev/fill": "EROFS",
        "/work/fill": "EFBIG",
    }, result
    assert written["/tmp/fill"] > 0 and written["/dev/shm/fill"] > 0 and written["/work/fill"] > 0
    assert sum(written.values()) <= QUOTA_MB << 20, written  # folder + /tmp + /dev/shm within one quota


async def test_no_other_process_memory_fds_or_ptrace(sandbox):
    host = os.getpid()  # this process stands for the tool processor
    code = LIBC + (
        f"host = {host}\nr = {{}}\n"
        "for what in ('mem', 'fd', 'environ', 'root'):\n"
        "    try:\n"
        "        p = f'/proc/{host}/{what}'\n"
        "        r[what] = os.listdir(p) if what in ('fd', 'root') else open(p, 'rb').read(16)\n"
        "    except OSError as e:\n"
        "        r[what] = type(e).__name__\n"
        "r['ptrace_attach'] = call(101, 16, host, 0, 0)\n"  # PTRACE_ATTACH to a host pid
        "r['ptrace_traceme'] = call(101, 0, 0, 0, 0)\n"  # PTRACE_TRACEME
        "buf = ctypes.create_string_buffer(8)\n"
        "iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)\n"
        "r['process_vm_readv'] = call(310, 1, iov, 1, iov, 1, 0)\n"  # another process's memory (pid 1)
        "r['pidfd_open'] = call(434, 1, 0)\n"
        "r"
    )
    if platform.machine() != "x86_64":
        pytest.skip("system call numbers are x86-64's")
    r = await run_json(sandbox, code)
    assert {k: r[k] for k in ("mem", "fd", "environ", "root")} == dict.fromkeys(
        ("mem", "fd", "environ", "root"), "FileNotFoundError"
    ), r  # host pids do not exist inside
    assert {
        k: r[k] for k in ("ptrace_attach", "ptrace_traceme", "process_vm_readv", "pidfd_open")
    } == dict.fromkeys(
        ("ptrace_attach", "ptrace_traceme", "process_vm_readv", "pidfd_open"), "Operation not permitted"
    ), r


def _host_pid_of(workdir: Path) -> int | None:
    """The host pid of the sandboxed python whose /work is `workdir` (its mount table names the folder)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if Path(f"/proc/{name}/comm").read_text().strip() != "python3":
                continue
            if f"/{workdir.name} /work " in Path(f"/proc/{name}/mountinfo").read_text():
                return int(name)
        except OSError:
            continue
    return None


async def test_one_sandbox_cannot_signal_another(sandbox):
    a_conv = conv()
    a_dir = sandbox.workdir("t-escape", a_conv)
    waiting = (
        "import os, time\ndeadline = time.monotonic() + 15\n"
        "while not os.path.exists('go') and time.monotonic() < deadline: time.sleep(0.02)\n"
        "'survived' if os.path.exists('go') else 'no go'"
    )
    a = asyncio.ensure_future(sandbox.run("t-escape", a_conv, waiting))
    try:
        pid = None
        for _ in range(500):
            if (pid := await asyncio.to_thread(_host_pid_of, a_dir)) is not None or a.done():
                break
            await asyncio.sleep(0.02)
        assert pid is not None, "the first sandbox's python never appeared"
        b = await sandbox.run(
            "t-escape", conv(), f"import os, signal\nfor sig in (0, signal.SIGKILL):\n    os.kill({pid}, sig)"
        )
        assert b.error and "ProcessLookupError" in b.error, (b.error, b.stderr)
        b2 = await sandbox.run(
            "t-escape",
            conv(),
            "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\n"
            "except ProcessLookupError:\n    pass\n'alive'",
        )
        assert b2.value == "'alive'", (b2.error, b2.stderr)  # kill(-1) reaches only its own sandbox
        (a_dir / "go").write_text("")
        run = await a
        assert run.error is None and run.value == "'survived'", (run.error, run.stderr)
    finally:
        (a_dir / "go").touch()
        await a


async def test_no_host_network_not_even_loopback(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        code = (
            "import socket\nr = {'interfaces': [n for _, n in socket.if_nameindex()],\n"
            "     'dev': [l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]]}\n"
            "for host in ('127.0.0.1', '::1', 'localhost'):\n"
            "    try:\n"
            f"        socket.create_connection((host, {port}), timeout=2); r[host] = 'connected'\n"
            "    except OSError as e:\n"
            "        r[host] = type(e).__name__\n"
            "r"
        )
        r = await run_json(sandbox, code)
        assert r["interfaces"] == ["lo"] and r["dev"] == ["lo"], r
        assert r["127.0.0.1"] == "ConnectionRefusedError" and r["::1"] in (
            "ConnectionRefusedError",
            "OSError",
        ), r
        assert r["localhost"] in ("gaierror", "ConnectionRefusedError", "OSError"), r
        assert select.select([listener], [], [], 0)[0] == []  # the run ended: nothing ever reached the host
    finally:
        listener.close()


async def test_a_conversation_cannot_write_where_another_reads(sandbox):
    a_conv, b_conv = conv(), conv()
    assert (await sandbox.run("t-escape", a_conv, "open('notes.txt', 'w').write('mine')")).error is None
    a_dir = sandbox.root / folder_name("t-escape", a_conv)
    b = await run_json(
        sandbox,
        (
            "import os\nr = {'root': sorted(os.listdir('/')), 'up': sorted(os.listdir('/work/..'))}\n"
            f"for path in ('{a_dir}/notes.txt', '/work/../{a_dir.name}/notes.txt', "
            f"'/tmp/../{a_dir.name}/notes.txt'):\n"
            "    try:\n"
            "        open(path, 'w').write('theirs'); r[path] = 'written'\n"
            "    except OSError as e:\n"
            "        r[path] = type(e).__name__\n"
            f"os.symlink('{a_dir}/notes.txt', 'link')\n"
            "try:\n    open('link', 'w').write('theirs'); r['link'] = 'written'\n"
            "except OSError as e:\n    r['link'] = type(e).__name__\n"
            "r"
        ),
        b_conv,
    )
    assert "work" in b["root"] and a_dir.name not in b["root"] + b["up"], b
    assert all(
        v in ("FileNotFoundError", "PermissionError", "OSError")
        for k, v in b.items()
        if k not in ("root", "up")
    ), b
    a = await sandbox.run("t-escape", a_conv, "import os\nsorted(os.listdir('.')), open('notes.txt').read()")
    assert a.value == "(['notes.txt'], 'mine')", (a.value, a.error)


SYSCALLS = {  # x86-64 numbers, with arguments that would succeed were the call allowed
    "unshare(CLONE_NEWUSER)": "call(272, 0x10000000)",
    "mount": "call(165, b'none', b'/tmp', b'tmpfs', 0, 0)",
    "keyctl": "call(250, 0, -3, 0)",  # KEYCTL_GET_KEYRING_ID, the session keyring
    "bpf": "call(321, 0, 0, 0)",
    "perf_event_open": "call(298, ctypes.create_string_buffer(128), 0, -1, -1, 0)",
    "userfaultfd": "call(323, 0)",
    "io_uring_setup": "call(425, 4, ctypes.create_string_buffer(120))",
    "memfd_create": "call(319, b'x', 0)",  # memory outside every rlimit
    "shmget": "call(29, 0, 1 << 20, 0o1600)",  # IPC_PRIVATE | IPC_CREAT: the same
    "personality": "call(135, -1)",  # 0xffffffff: a query
    "setns": "call(308, 0, 0)",
    "socket(AF_PACKET)": "call(41, 17, 3, 0)",
    "socket(AF_ALG)": "call(41, 38, 5, 0)",
    "ioctl(TIOCSTI)": "call(16, 0, 0x5412, ctypes.byref(ctypes.c_char(b'x')))",
    "clone(CLONE_NEWNS)": "call(56, 0x00020000 | 17, 0, 0, 0, 0)",
}


async def test_system_calls_off_the_allow_list_are_refused(sandbox):
    if platform.machine() != "x86_64":
        pytest.skip("system call numbers are x86-64's")
    lines = [LIBC, "r = {'getpid': call(39)}"]  # an allowed call, through the same path, succeeds
    lines += [f"r[{name!r}] = {expr}" for name, expr in SYSCALLS.items()]
    r = await run_json(sandbox, "\n".join(lines) + "\nr")
    assert r.pop("getpid") == "ok"
    refused = {name: got for name, got in r.items() if got != "Operation not permitted"}
    assert not refused, refused


async def test_ordinary_python_keeps_working_under_the_allow_list(sandbox):
    code = (
        "import asyncio, concurrent.futures, multiprocessing, os, sqlite3, subprocess, tempfile, threading\n"
        "def square(x): return x * x\n"
        "with multiprocessing.Pool(2) as pool: pooled = pool.map(square, range(5))\n"
        "with concurrent.futures.ThreadPoolExecutor(2) as ex: threaded = list(ex.map(square, range(5)))\n"
        "echoed = subprocess.run(['echo', 'hi'], capture_output=True, text=True).stdout\n"
        "db = sqlite3.connect('db.sqlite'); db.execute('create table t(x)'); db.commit()\n"
        "with tempfile.TemporaryFile() as f: f.write(b'x' * 100000); f.seek(0); tmp = len(f.read())\n"
        "from multiprocessing import shared_memory\n"
        "sm = shared_memory.SharedMemory(create=True, size=4096); sm.buf[0] = 7; shm = sm.buf[0]; "
        "sm.close(); sm.unlink()\n"
        "async def main():\n"
        "    p = await asyncio.create_subprocess_exec('true'); return await p.wait()\n"
        "{'pool': pooled, 'threads': threaded, 'echo': echoed, 'tmp': tmp, 'shm': shm, "
        "'async': asyncio.run(main())}"
    )
    r = await run_json(sandbox, code)
    assert r == {
        "pool": [0, 1, 4, 9, 16],
        "threads": [0, 1, 4, 9, 16],
        "echo": "hi\n",
        "tmp": 100000,
        "shm": 7,
        "async": 0,
    }, r


async def test_numpy_works_under_the_allow_list(sandbox):
    probe = await sandbox.run(
        "t-escape", conv(), "import importlib.util\nimportlib.util.find_spec('numpy') is not None"
    )
    if probe.value != "True":
        pytest.skip("numpy is not installed for the sandbox's python (Debian: python3-numpy)")
    code = (
        "import numpy as np\na = np.random.default_rng(0).standard_normal((200, 200))\n"
        "b = a @ a.T + np.eye(200)\nx = np.linalg.solve(b, a[:, 0])\n"
        "{'close': bool(np.allclose(b @ x, a[:, 0])), 'fft': int(np.fft.fft(np.ones(8))[0].real)}"
    )
    assert json.dumps(await run_json(sandbox, code)) == json.dumps({"close": True, "fft": 8})
