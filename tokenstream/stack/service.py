"""A local server process: install once, start detached, wait until ready, stop cleanly.

Each service keeps a pid file and a log file in the stack's folders, so `stack up`
from another shell finds what is already running and leaves it alone.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from abc import ABC, abstractmethod
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port free on loopback right now (for tests that start their own stack), never one this
    process was given before: ports asked for one after another are bound only later, so the kernel
    may offer the same free port twice (a broker's client and controller listeners then collide)."""
    while True:
        with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) is not alive.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        return state != "Z"
    except OSError:
        return True


@dataclass
class Status:
    name: str
    running: bool
    ready: bool
    pid: int | None
    address: str
    log: Path
    detail: str = ""  # why not ready, or what is degraded (from a role's /health/ready)


class ServiceError(RuntimeError):
    pass


ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def maven_copy(pom: Path, folder: Path, what: str) -> None:
    """Resolve the runtime jars `pom` names from Maven Central into `folder`. Maven's own output is
    kept back (Maven 3.8 writes terminal escape codes even with -q -B) and shown, as plain text, only
    when it fails."""
    if shutil.which("mvn") is None or shutil.which("java") is None:
        raise ServiceError(
            f"{what} needs java (17+) and maven on PATH: apt-get install default-jdk-headless maven"
        )
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [
            "mvn",
            "-q",
            "-B",
            "-f",
            str(pom),
            "org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={folder}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        tail = ESCAPE.sub("", done.stdout + done.stderr).strip()[-2000:]
        raise ServiceError(f"{what}: maven could not resolve its jars (exit {done.returncode}):\n{tail}")


class Service(ABC):
    """Subclasses say how to install, launch and probe one server."""

    name: str = "service"
    ready_timeout_s: float = 60.0
    stop_timeout_s: float = 30.0

    def __init__(self, data_dir: Path, run_dir: Path, log_dir: Path, cache_dir: Path) -> None:
        self.data_dir = data_dir / self.name
        self.run_dir = run_dir
        self.log_dir = log_dir
        self.cache_dir = cache_dir

    # -- what a subclass provides -------------------------------------------------
    @abstractmethod
    def install(self, say) -> None:
        """Make the server's files available (idempotent; `say` reports progress)."""

    @abstractmethod
    def command(self) -> list[str]: ...

    @abstractmethod
    def is_ready(self) -> bool: ...

    @property
    @abstractmethod
    def address(self) -> str: ...

    def prepare(self) -> None:
        """Per-start preparation (config files, formatting storage)."""

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    # -- lifecycle -----------------------------------------------------------------
    @property
    def pid_file(self) -> Path:
        return self.run_dir / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    def status(self) -> Status:
        pid = self.pid()
        return Status(
            self.name, pid is not None, pid is not None and self.is_ready(), pid, self.address, self.log_file
        )

    def start(self, say=print, wait: bool = True) -> bool:
        """Start unless already running. Returns True when this call started it.

        wait=False returns once the process is launched (a supervisor probes it later).
        """
        if self.pid() is not None:
            if wait:
                self.wait_ready()
            say(f"{self.name}: already running at {self.address}")
            return False
        for folder in (self.data_dir, self.run_dir, self.log_dir):
            folder.mkdir(parents=True, exist_ok=True)
        self.install(say)
        self.prepare()
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env(),
                cwd=self.data_dir,
                start_new_session=True,
            )
        self.pid_file.write_text(str(proc.pid))
        say(f"{self.name}: starting (pid {proc.pid}, log {self.log_file})")
        if not wait:
            return True
        try:
            self.wait_ready(proc)
        except ServiceError:
            self.stop(say=lambda _msg: None)
            raise
        say(f"{self.name}: ready at {self.address}")
        return True

    def wait_ready(self, proc: subprocess.Popen | None = None) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise ServiceError(
                    f"{self.name} exited with {proc.returncode}; see {self.log_file}:\n" + self.log_tail()
                )
            if self.is_ready():
                return
            time.sleep(0.25)
        raise ServiceError(
            f"{self.name} not ready after {self.ready_timeout_s:.0f}s; see {self.log_file}:\n"
            + self.log_tail()
        )

    def stop(self, say=print) -> bool:
        """SIGTERM the process group, SIGKILL after stop_timeout_s. True when something stopped."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + self.stop_timeout_s
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if pid_alive(pid):
            say(f"{self.name}: did not stop in {self.stop_timeout_s:.0f}s, killing")
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            while pid_alive(pid):
                time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)
        say(f"{self.name}: stopped")
        return True

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
