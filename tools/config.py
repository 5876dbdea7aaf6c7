"""Settings of the tool processor and its tools, from TOKENSTREAM_TOOLS_* environment variables."""

from __future__ import annotations

import os
import stat
from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.config import settings


class ToolSettings(BaseSettings):
    """Example: TOKENSTREAM_TOOLS_WEB_ALLOW_HOSTS='["docs.python.org"]'."""

    model_config = SettingsConfigDict(env_prefix="TOKENSTREAM_TOOLS_", extra="ignore")

    # The processor
    concurrency: int = Field(4, ge=1, description="calls run at once by one process")
    call_timeout_s: float = Field(
        90.0,
        gt=0,
        description="any call still running after this is stopped and "
        "answered with an error (each tool has its own, tighter limits)",
    )
    claim_lease_s: float = Field(
        15.0,
        gt=0,
        description="a running call's claim lapses this long after "
        "its processor stops renewing it (dies); the next processor then runs it",
    )

    # The code interpreter's sandbox
    sandbox_dir: Path | None = Field(None, description="working folders (default: <data_dir>/tools/sandbox)")
    sandbox_uid: int = Field(65534, description="unprivileged uid the sandbox runs as when started by root")
    sandbox_gid: int = Field(65534)
    cpu_s: int = Field(10, ge=1, description="CPU seconds per call (RLIMIT_CPU)")
    wall_s: float = Field(30.0, gt=0, description="wall-clock seconds per call")
    memory_mb: int = Field(512, ge=64, description="address space per process (RLIMIT_AS)")
    processes: int = Field(32, ge=1, description="processes of the sandbox user (RLIMIT_NPROC)")
    open_files: int = Field(64, ge=16, description="open file descriptors (RLIMIT_NOFILE)")
    file_mb: int = Field(16, ge=1, description="largest file the code may write (RLIMIT_FSIZE)")
    output_kb: int = Field(64, ge=1, description="stdout and stderr kept, each; more stops the run")
    folder_mb: int = Field(
        64,
        ge=1,
        description="a conversation's quota: its working folder (all its files) and, "
        "during a run, that run's /tmp and /dev/shm (tmp_mb, shm_mb); a call finding the folder "
        "full is refused, a run filling it is stopped and its writes undone",
    )
    folder_files: int = Field(
        10_000, ge=1, description="files and folders in a conversation's working folder"
    )
    tmp_mb: int = Field(
        8,
        ge=1,
        description="size of a run's /tmp (a tmpfs, emptied after each run); taken "
        "out of folder_mb for the run, at most a quarter of what the folder leaves free",
    )
    shm_mb: int = Field(
        4,
        ge=1,
        description="size of a run's /dev/shm (a tmpfs); taken out of folder_mb for the "
        "run like tmp_mb, at most an eighth of what the folder leaves free",
    )
    seccomp: bool = Field(
        True,
        description="a seccomp filter (tools/seccomp.py) on the sandboxed code; the "
        "processor refuses to start when it cannot be built",
    )
    files_listed: int = Field(50, ge=0, description="written files reported per call")
    file_preview_kb: int = Field(4, ge=0, description="text of each written file returned")

    # Weaviate (file search and ingestion)
    index_timeout_s: float = Field(
        5.0,
        gt=0,
        description="connecting to Weaviate and each search; a file_search "
        "call fails after this (and at once for a while after a failure)",
    )
    health_port: int | None = Field(None, description="port of /health/live and /health/ready (None: none)")
    broker_stale_s: float = Field(
        5.0, gt=0, description="not ready once the broker has not answered the group check for this long"
    )

    # File ingestion (ts.files.ingest)
    ingest_attempts: int = Field(
        5,
        ge=1,
        description="tries of a file that fails while Weaviate answers "
        "(1, 2, 4 ... s apart) before it is recorded as failed",
    )
    ingest_outage_s: float = Field(
        600.0,
        gt=0,
        description="how long an event is held while Weaviate does not "
        "answer (tried again 0.25 s doubling to 2 s apart) before the process exits "
        "for its supervisor to restart it (the event is read again)",
    )

    # Web fetch
    web_allow_hosts: list[str] = Field(default_factory=list, description="hosts the web tool may fetch")
    web_allow_private: list[str] = Field(
        default_factory=list,
        description="hosts that may resolve to "
        "private or loopback addresses (each must also be in web_allow_hosts)",
    )
    web_max_kb: int = Field(2048, ge=1, description="largest body read")
    web_timeout_s: float = Field(10.0, gt=0)
    web_max_redirects: int = Field(5, ge=0)
    web_text_kb: int = Field(64, ge=1, description="readable text returned")

    @property
    def sandbox_root(self) -> Path:
        """sandbox_dir, else <data_dir>/tools/sandbox; when that cannot be reached by the sandbox user (a
        data dir under root's private home), /var/tmp/tokenstream-sandbox instead."""
        if self.sandbox_dir is not None:
            return self.sandbox_dir
        default = settings().data_dir / "tools" / "sandbox"
        if os.geteuid() == 0 and not _passable(default):
            return Path("/var/tmp/tokenstream-sandbox")
        return default


def _passable(path: Path) -> bool:
    """Every existing folder on the way to `path` can be passed through by other users (o+x)."""
    for folder in [path, *path.parents]:
        try:
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return False
        except FileNotFoundError:
            continue
    return True


@lru_cache
def tool_settings() -> ToolSettings:
    return ToolSettings()
