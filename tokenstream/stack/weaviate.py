"""Weaviate, built once from source with the Go toolchain and cached by version."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from tokenstream.stack.service import Service, ServiceError

WEAVIATE_VERSION = "1.39.0"
MODULE = "github.com/weaviate/weaviate/cmd/weaviate-server"


class Weaviate(Service):
    name = "weaviate"
    ready_timeout_s = 90.0

    def __init__(
        self,
        *args,
        port: int = 8080,
        grpc_port: int = 50051,
        gossip_port: int = 7946,
        data_port: int = 7947,
        raft_port: int = 8300,
        raft_rpc_port: int = 8301,
    ) -> None:
        super().__init__(*args)
        self.port, self.grpc_port = port, grpc_port
        self.gossip_port, self.data_port = gossip_port, data_port
        self.raft_port, self.raft_rpc_port = raft_port, raft_rpc_port

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port} (grpc {self.grpc_port})"

    @property
    def binary(self) -> Path:
        return self.cache_dir / f"weaviate-{WEAVIATE_VERSION}" / "bin" / "weaviate-server"

    def install(self, say) -> None:
        if self.binary.exists():
            return
        if shutil.which("go") is None:
            raise ServiceError("weaviate is built from source and needs the Go toolchain on PATH")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        build_log = self.log_dir / "weaviate-build.log"
        say(
            f"weaviate: building {MODULE}@v{WEAVIATE_VERSION} with Go (once; 5-15 min on 2 cores), "
            f"log {build_log}"
        )
        env = dict(os.environ, CGO_ENABLED="0", GOBIN=str(self.binary.parent))
        started = time.monotonic()
        with open(build_log, "ab") as log:
            proc = subprocess.Popen(
                ["go", "install", "-trimpath", f"{MODULE}@v{WEAVIATE_VERSION}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
            while proc.poll() is None:
                time.sleep(30)
                if proc.poll() is None:
                    say(f"weaviate: still building ({time.monotonic() - started:.0f}s)")
        if proc.returncode != 0 or not self.binary.exists():
            raise ServiceError(f"weaviate build failed; see {build_log}")
        say(f"weaviate: built in {time.monotonic() - started:.0f}s")

    def env(self) -> dict[str, str]:
        return dict(
            os.environ,
            PERSISTENCE_DATA_PATH=str(self.data_dir),
            AUTHENTICATION_ANONYMOUS_ACCESS_ENABLED="true",
            DEFAULT_VECTORIZER_MODULE="none",
            ENABLE_MODULES="",
            DISABLE_TELEMETRY="true",
            CLUSTER_HOSTNAME="node1",
            CLUSTER_ADVERTISE_ADDR="127.0.0.1",
            CLUSTER_BIND_ADDR="127.0.0.1",
            CLUSTER_GOSSIP_BIND_PORT=str(self.gossip_port),
            CLUSTER_DATA_BIND_PORT=str(self.data_port),
            RAFT_PORT=str(self.raft_port),
            RAFT_INTERNAL_RPC_PORT=str(self.raft_rpc_port),
            RAFT_JOIN=f"node1:{self.raft_port}",
            RAFT_BOOTSTRAP_EXPECT="1",
            GRPC_PORT=str(self.grpc_port),
            GO_PROFILING_DISABLE="true",
            PROMETHEUS_MONITORING_ENABLED="false",
            QUERY_DEFAULTS_LIMIT="25",
            LOG_LEVEL="warning",
        )

    def command(self) -> list[str]:
        return [str(self.binary), "--host", "127.0.0.1", "--port", str(self.port), "--scheme", "http"]

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/.well-known/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False
