"""Redis from Debian's redis-server package, in two instances with different eviction rules.

`Redis` is the durable store (API keys, usage, uploaded files, vector stores, stored responses, the
once-per-effect ledgers, rate-limit counters): `noeviction`, so a full store refuses a write with an
error instead of silently dropping a key, and append-only persistence when `persistent`. `RedisCache`
holds only what may be lost at any moment (the exact response cache): `allkeys-lru` under a
`maxmemory` bound, no persistence. See docs/security.md ("Durable state").
"""

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

    def base_command(self) -> list[str]:
        return [
            "redis-server",
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.data_dir),
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
        ]

    def command(self) -> list[str]:
        cmd = [*self.base_command(), "--maxmemory-policy", "noeviction"]
        if self.persistent:
            return [*cmd, "--appendonly", "yes", "--appendfsync", "everysec", "--save", "60 1000"]
        return [*cmd, "--save", "", "--appendonly", "no"]

    def is_ready(self) -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(self.address, socket_timeout=1).ping())
        except redis.RedisError:
            return False


class RedisCache(Redis):
    """The evicting store: least recently used keys go first once `maxmemory` is reached."""

    name = "redis-cache"

    def __init__(self, *args, port: int = 6380, maxmemory: str = "256mb") -> None:
        super().__init__(*args, port=port, persistent=False)
        self.maxmemory = maxmemory

    def command(self) -> list[str]:
        return [
            *self.base_command(),
            "--maxmemory",
            self.maxmemory,
            "--maxmemory-policy",
            "allkeys-lru",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
