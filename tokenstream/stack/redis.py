"""Redis from Debian's redis-server package: caches, rate limits, small shared state."""

from __future__ import annotations

import shutil

from tokenstream.stack.service import Service, ServiceError


class Redis(Service):
    name = "redis"
    ready_timeout_s = 20.0

    def __init__(self, *args, port: int = 6379, persistent: bool = True) -> None:
        super().__init__(*args)
        self.port = port
        self.persistent = persistent

    @property
    def address(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def install(self, say) -> None:
        if shutil.which("redis-server") is None:
            raise ServiceError("redis-server not found: apt-get install redis-server")

    def command(self) -> list[str]:
        cmd = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.data_dir),
               "--daemonize", "no", "--protected-mode", "yes", "--maxmemory-policy", "allkeys-lru"]
        if self.persistent:
            return [*cmd, "--appendonly", "yes", "--save", "60 1000"]
        return [*cmd, "--save", "", "--appendonly", "no"]

    def is_ready(self) -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(self.address, socket_timeout=1).ping())
        except redis.RedisError:
            return False
