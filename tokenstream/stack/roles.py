"""The tokenstream roles as local background processes, managed like the stack's services.

`tokenstream system up` starts the stack, applies the topics, then these: the three
processors, workers and gateways (one of each unless `tokenstream ops scale` asked for more, see
tokenstream/stack/scale.py), each with a pid file and a log in the stack's folders.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tokenstream.ops.probe import describe, group_ready, json_body
from tokenstream.stack.service import Service, Status


class Role(Service):
    """One `tokenstream <args>` process. Ready when `probe_url` answers 200, or after `settle_s` alive.
    `status()` also asks the broker about a processor's `group` (as `ops probe --group` does)."""

    ready_timeout_s = 300.0  # a first worker start converts SmolLM2 to safetensors
    stop_timeout_s = 20.0

    def __init__(
        self,
        name: str,
        args: list[str],
        folders: tuple[Path, Path, Path, Path],
        *,
        probe_url: str | None = None,
        settle_s: float = 3.0,
        group: str | None = None,
    ) -> None:
        self.name = name
        super().__init__(*folders)
        self.args, self.probe_url, self.settle_s, self.group = args, probe_url, settle_s, group
        self._started = 0.0

    @property
    def address(self) -> str:
        return self.probe_url or " ".join(self.args)

    def install(self, say) -> None:
        pass

    @property
    def args_file(self) -> Path:
        return self.run_dir / f"{self.name}.args"

    def recorded_args(self) -> list[str] | None:
        """The arguments the running process was started with (None when unknown)."""
        try:
            return json.loads(self.args_file.read_text())
        except (OSError, ValueError):
            return None

    def prepare(self) -> None:
        self._started = time.monotonic()
        self.args_file.write_text(json.dumps(self.args))

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tokenstream.cli", *self.args]

    def is_ready(self) -> bool:
        if self.probe_url is None:
            return self.pid() is not None and time.monotonic() - self._started >= self.settle_s
        return self.probe()[0]

    def probe(self) -> tuple[bool, dict]:
        """(200?, the JSON body) of the role's readiness endpoint; (False, {}) when it does not answer."""
        try:
            with urllib.request.urlopen(self.probe_url, timeout=2) as response:
                return response.status == 200, json_body(response.read())
        except urllib.error.HTTPError as error:  # 503: not ready, and the body says why
            return False, json_body(error.read())
        except OSError:
            return False, {}

    def status(self) -> Status:
        pid = self.pid()
        if pid is not None and self.probe_url is not None:
            ok, body = self.probe()
            return Status(self.name, True, ok, pid, self.address, self.log_file, detail=describe(body))
        if pid is not None and self.group is not None and self.is_ready():
            ok, why = group_ready(self.group, "127.0.0.1")  # a local process, as the broker sees it
            return Status(self.name, True, ok, pid, self.address, self.log_file, detail="" if ok else why)
        return super().status()


def shared_host_worker_args(workers: int) -> list[str]:
    """The `worker` options for `workers` workers on a host they share with the other roles (the
    local stacks): each its share of the cores, and OpenMP threads that sleep rather than spin.

    A worker's kernels run on an OpenMP team of one thread per core, whose threads spin at every
    barrier before they sleep. Two such teams on the same cores spun against each other: on 2 cores
    two workers serving 3 streams between them took 84% of a core each and several seconds per
    answer (`tokenstream chaos`, 2026-12-06). One team alone spins against the broker, the
    processors and the gateway on the request's path: `bench pipeline`'s overhead p50 was 35.4-35.6
    ms with spinning threads and 25.3-30.4 ms with sleeping ones (bench/RESULTS.md)."""
    share = ["--threads", str(max(1, (os.cpu_count() or 1) // workers))] if workers > 1 else []
    return [*share, "--no-spin-wait"]
