"""Python in a bubblewrap sandbox: no network, read-only system, one working folder per conversation.

    run = await Sandbox(tool_settings()).run(tenant, conversation_id, code)

The chain started for each call:

    setpriv --reuid/--regid <nobody>   (only when this process is root: RLIMIT_NPROC does not bind root)
      bwrap --unshare-all ...          (new user, pid, net, ipc, uts and mount namespaces)
        /usr/bin/python3 -I -c <runner>  (sets the rlimits, then runs the code; see sandbox_runner.py)

setpriv and bwrap start with an environment of PATH alone: the sandbox's pid 1 is bwrap, and its
/proc/1/environ is readable inside, so nothing of this process's environment may reach it.

Inside, the filesystem is /usr read-only, /tmp and /dev/shm as tmpfs of a fixed size (taken out of
the conversation's quota for the run: folder + /tmp + /dev/shm never exceed folder_mb), a minimal
read-only /dev and /proc, and the conversation's folder at /work (read-write): bwrap binds it as
the sandbox user, so the sandbox root and every folder above it must be searchable (x) by that
user (see tools/README.md). The wall-clock limit is enforced from here by killing bwrap's process
group; --die-with-parent takes the sandbox's pid namespace down with it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools import seccomp
from tools.config import ToolSettings

RUNNER_SOURCE = Path(__file__).with_name("sandbox_runner.py").read_text()
PYTHON = "/usr/bin/python3"
WATCH_S = 0.1  # how often a running call's folder is measured against its quota
PAGE = 4096
ENV = {"PATH": "/usr/bin:/bin"}  # all setpriv and bwrap are started with (bwrap is the sandbox's pid 1)


@dataclass(frozen=True)
class Budget:
    """How a run shares the conversation's quota: its folder may grow to `folder` bytes, and its /tmp
    and /dev/shm are tmpfs of `tmp` and `shm` bytes (memory, gone when the run ends)."""

    folder: int
    tmp: int
    shm: int


def budget(quota: int, used: int, tmp_max: int, shm_max: int) -> Budget | None:
    """/tmp gets up to a quarter and /dev/shm an eighth of what is left, the folder the rest; None when
    too little is left for either (a tmpfs of size 0 would have no limit at all)."""
    left = quota - used
    tmp, shm = min(tmp_max, left // 4) // PAGE * PAGE, min(shm_max, left // 8) // PAGE * PAGE
    if tmp <= 0 or shm <= 0:
        return None
    return Budget(folder=quota - tmp - shm, tmp=tmp, shm=shm)


@dataclass
class Run:
    stdout: str = ""
    stderr: str = ""
    value: str | None = None
    error: str | None = None  # why the code failed or was stopped; None when it ran to the end
    exit_code: int | None = None
    files: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float | None = None
    max_rss_kb: int | None = None
    truncated: bool = False


def folder_name(tenant: str, conversation_id: str) -> str:
    """A conversation's folder: a hash, so no id can name a path (.., /) or collide across tenants."""
    return hashlib.sha256(f"{tenant}\0{conversation_id}".encode()).hexdigest()[:32]


class Sandbox:
    def __init__(self, cfg: ToolSettings) -> None:
        self.cfg = cfg
        self.root = cfg.sandbox_root

    def workdir(self, tenant: str, conversation_id: str) -> Path:
        path = self.root / folder_name(tenant, conversation_id)
        if not path.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            os.chmod(self.root, 0o711)  # the sandbox user passes through to its folder, never lists
            path.mkdir(mode=0o700)
            if os.geteuid() == 0:
                os.chown(path, self.cfg.sandbox_uid, self.cfg.sandbox_gid)
        return path

    def budget(self, used: int) -> Budget | None:
        return budget(self.cfg.folder_mb << 20, used, self.cfg.tmp_mb << 20, self.cfg.shm_mb << 20)

    def command(
        self,
        workdir: Path,
        report_fd: int,
        seccomp_fd: int | None = None,
        file_bytes: int | None = None,
        share: Budget | None = None,
    ) -> list[str]:
        cfg = self.cfg
        share = share or self.budget(0)
        limits = {
            "cpu_s": cfg.cpu_s,
            "memory_mb": cfg.memory_mb,
            "processes": cfg.processes,
            "open_files": cfg.open_files,
            "file_bytes": file_bytes or cfg.file_mb << 20,
            "value_chars": cfg.output_kb * 1024,
        }
        bwrap = _program("bwrap", "bubblewrap")
        drop = (
            [
                _program("setpriv", "util-linux"),
                f"--reuid={cfg.sandbox_uid}",
                f"--regid={cfg.sandbox_gid}",
                "--clear-groups",
                "--",
            ]
            if os.geteuid() == 0
            else []
        )
        return [
            *drop,
            bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--ro-bind",
            "/usr",
            "/usr",
            "--ro-bind-try",
            "/etc/alternatives",
            "/etc/alternatives",  # links into /usr (Debian's BLAS)
            "--ro-bind-try",
            "/etc/matplotlibrc",
            "/etc/matplotlibrc",  # where Debian's matplotlib reads it
            "--ro-bind-try",
            "/etc/fonts",
            "/etc/fonts",  # fontconfig's configuration (charts' text)
            "--symlink",
            "usr/lib",
            "/lib",
            "--symlink",
            "usr/lib64",
            "/lib64",
            "--symlink",
            "usr/bin",
            "/bin",
            "--proc",
            "/proc",
            # /dev: null, zero, full, random, urandom, tty (and pts); read-only but for its shm
            "--dev",
            "/dev",
            "--size",
            str(share.shm),
            "--tmpfs",
            "/dev/shm",
            "--remount-ro",
            "/dev",
            "--size",
            str(share.tmp),
            "--tmpfs",
            "/tmp",
            "--bind",
            str(workdir),
            "/work",
            "--chdir",
            "/work",
            "--setenv",
            "HOME",
            "/work",
            "--setenv",
            "PATH",
            "/usr/bin",
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--remount-ro",
            "/",  # bwrap's own root tmpfs: only /work, /tmp and /dev/shm are writable
            "--setenv",
            "PYTHONDONTWRITEBYTECODE",
            "1",
            "--setenv",
            "OPENBLAS_NUM_THREADS",
            "1",
            # matplotlib's font cache in the run's /tmp, not among the conversation's files; no display
            "--setenv",
            "MPLCONFIGDIR",
            "/tmp/matplotlib",
            "--setenv",
            "MPLBACKEND",
            "Agg",
            "--setenv",
            "XDG_CACHE_HOME",
            "/tmp/cache",
            *(["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []),
            "--",
            PYTHON,
            "-I",
            "-c",
            RUNNER_SOURCE,
            json.dumps(limits),
            str(report_fd),
        ]

    async def run(self, tenant: str, conversation_id: str, code: str) -> Run:
        workdir = self.workdir(tenant, conversation_id)
        used, entries = await asyncio.to_thread(folder_usage, workdir)
        share = self.budget(used)
        if share is None or entries >= self.cfg.folder_files:
            return Run(
                error=f"the working folder is full ({used >> 10:,} KiB in {entries:,} entries; the quota is "
                f"{self.cfg.folder_mb} MiB and {self.cfg.folder_files:,} entries): delete files first"
            )
        report_r, report_w = os.pipe()
        seccomp_fd = seccomp.program_fd() if self.cfg.seccomp else None
        started = time.monotonic()
        since = time.time() - 0.05  # file times are a few ms coarse
        try:
            # no single file may be larger than what is left of the folder's share of the quota
            command = self.command(
                workdir, report_w, seccomp_fd, min(self.cfg.file_mb << 20, share.folder - used), share
            )
            proc = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(report_w,) + ((seccomp_fd,) if seccomp_fd else ()),
                start_new_session=True,
                env=ENV,
            )
        except OSError as exc:
            os.close(report_r)
            raise RuntimeError(f"the sandbox cannot start (is bubblewrap installed?): {exc}") from exc
        finally:
            os.close(report_w)
            if seccomp_fd is not None:
                os.close(seccomp_fd)
        run = Run()
        full = asyncio.Event()
        watcher = asyncio.ensure_future(self._watch(workdir, proc.pid, full, share.folder))
        cap = self.cfg.output_kb * 1024
        over = asyncio.Event()

        async def read(stream: asyncio.StreamReader) -> bytes:
            # past the cap, keep draining (and dropping) until EOF: a pipe left unread pauses the
            # transport, which then never sees EOF, and asyncio's wait() waits for the pipes too
            kept = bytearray()
            while chunk := await stream.read(65536):
                room = cap - len(kept)
                if room > 0:
                    kept += chunk[:room]
                if len(chunk) > room:
                    over.set()
            return bytes(kept)

        async def report() -> bytes:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, _read_all, report_r)

        readers = asyncio.gather(read(proc.stdout), read(proc.stderr))
        reporter = asyncio.ensure_future(report())
        try:
            proc.stdin.write(code.encode())
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass
        waiter = asyncio.ensure_future(proc.wait())
        over_wait = asyncio.ensure_future(over.wait())
        try:
            done, _ = await asyncio.wait(
                {waiter, over_wait}, timeout=self.cfg.wall_s, return_when=asyncio.FIRST_COMPLETED
            )
            if waiter not in done:
                run.error = (
                    f"output limit exceeded ({self.cfg.output_kb} KiB); the run was stopped"
                    if over.is_set()
                    else f"wall-clock limit exceeded ({self.cfg.wall_s:g} s); the run was stopped"
                )
                run.truncated = over.is_set()
                _kill(proc.pid)
            await waiter
        finally:
            over_wait.cancel()
            watcher.cancel()
            if proc.returncode is None:
                _kill(proc.pid)
                await proc.wait()
        out, err = await readers
        try:
            trailer = json.loads(await asyncio.wait_for(reporter, 5) or b"null")
        except (TimeoutError, ValueError):
            trailer = None
        run.wall_s = time.monotonic() - started
        run.stdout, run.stderr = out.decode(errors="replace"), err.decode(errors="replace")
        run.exit_code = proc.returncode
        if isinstance(trailer, dict):
            run.value, run.cpu_s, run.max_rss_kb = (
                trailer.get("value"),
                trailer.get("cpu_s"),
                trailer.get("max_rss_kb"),
            )
            run.error = run.error or trailer.get("error")
        elif run.error is None:
            run.error = _death(proc.returncode, self.cfg)
        used, entries = await asyncio.to_thread(folder_usage, workdir)
        if full.is_set() or used > share.folder or entries > self.cfg.folder_files:
            await asyncio.to_thread(undo_writes, workdir, since)
            run.error = (
                f"working folder quota exceeded ({self.cfg.folder_mb} MiB, {self.cfg.folder_files:,} "
                "entries): the run was stopped and the files it wrote were removed"
            )
        run.files = self.written(workdir, since)
        return run

    async def _watch(self, workdir: Path, pid: int, full: asyncio.Event, quota: int) -> None:
        """Stop the run as soon as its folder passes its share of the quota (each file is held below what
        was left by RLIMIT_FSIZE; this catches many files, each under it)."""
        while True:
            await asyncio.sleep(WATCH_S)
            used, entries = await asyncio.to_thread(folder_usage, workdir)
            if used > quota or entries > self.cfg.folder_files:
                full.set()
                _kill(pid)
                return

    def written(self, workdir: Path, since: float) -> list[dict]:
        """Regular files changed since `since`, never following a link the code may have planted."""
        found: list[dict] = []
        preview = self.cfg.file_preview_kb * 1024
        for top, dirs, names in os.walk(workdir, followlinks=False):
            for name in sorted(names):
                path = Path(top, name)
                st = path.lstat()
                if not stat.S_ISREG(st.st_mode) or st.st_mtime < since:
                    continue
                entry = {"path": str(path.relative_to(workdir)), "bytes": st.st_size}
                if preview:
                    try:
                        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                    except OSError:
                        continue
                    with os.fdopen(fd, "rb") as f:
                        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                            continue
                        head = f.read(preview)
                    try:
                        entry["text"] = head.decode()
                    except UnicodeDecodeError:
                        pass
                found.append(entry)
                if len(found) >= self.cfg.files_listed:
                    return found
        return found


def folder_usage(workdir: Path) -> tuple[int, int]:
    """(bytes the folder's files take on disk, entries), never following a link."""
    used = entries = 0
    for top, dirs, names in os.walk(workdir, followlinks=False):
        for name in dirs + names:
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:
                continue
            entries += 1
            used += st.st_blocks * 512  # allocated: a sparse file counts what it holds
    return used, entries


def undo_writes(workdir: Path, since: float) -> None:
    """Remove what a run wrote (entries changed since `since`; folders left empty by that)."""
    for top, dirs, names in os.walk(workdir, topdown=False, followlinks=False):
        for name in names:
            path = os.path.join(top, name)
            try:
                if os.lstat(path).st_mtime >= since:
                    os.unlink(path)
            except OSError:
                pass
        for name in dirs:
            path = os.path.join(top, name)
            try:
                if os.lstat(path).st_mtime >= since:
                    os.rmdir(path)  # only when empty
            except OSError:
                pass


def _program(name: str, package: str) -> str:
    """The absolute path (found on this process's PATH: the sandbox chain is started with PATH alone)."""
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed (Debian package {package})")
    return found


def _read_all(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as f:
        return f.read(1 << 20)


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _death(code: int | None, cfg: ToolSettings) -> str:
    if code is not None and code < 0:
        sig = signal.Signals(-code).name
        if -code == signal.SIGXCPU or -code == signal.SIGKILL:
            return f"stopped by {sig} (CPU limit {cfg.cpu_s} s exceeded, or killed)"
        return f"stopped by {sig}"
    return (
        f"the sandbox exited ({code}) before the code finished (a limit was hit: memory "
        f"{cfg.memory_mb} MiB, CPU {cfg.cpu_s} s, processes {cfg.processes}, or its parent was killed)"
    )
