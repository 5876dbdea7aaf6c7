"""The services together, in start order: Kafka (one node or a cluster), the durable Redis, the cache
Redis, Weaviate."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from common.config import Settings, settings
from tokenstream.stack.cluster import KafkaCluster
from tokenstream.stack.kafka import Kafka
from tokenstream.stack.redis import Redis, RedisCache
from tokenstream.stack.service import Service, Status, free_port
from tokenstream.stack.weaviate import Weaviate


@dataclass
class Stack:
    kafka: Kafka | KafkaCluster
    redis: Redis
    weaviate: Weaviate
    cache: RedisCache

    @property
    def services(self) -> list[Service]:
        return [self.kafka, self.redis, self.cache, self.weaviate]

    @classmethod
    def default(cls, cfg: Settings | None = None) -> Stack:
        """The stack `tokenstream stack up` manages: data under cfg.data_dir, kept across restarts."""
        cfg = cfg or settings()
        kafka_port = int(cfg.kafka_bootstrap.rsplit(":", 1)[1])
        redis_port, cache_port = (
            int(url.rsplit(":", 1)[1].split("/")[0]) for url in (cfg.redis_url, cfg.cache_redis_url)
        )
        folders = _folders(cfg.data_dir, cfg.cache_dir)
        secure = cfg.kafka_security != "plaintext"
        if cfg.kafka_brokers > 1:  # node n: client port base + 2(n-1), its controller the port after
            kafka = KafkaCluster(
                *folders,
                secure=secure,
                ports=[(kafka_port + 2 * n, kafka_port + 2 * n + 1) for n in range(cfg.kafka_brokers)],
            )
        else:
            kafka = Kafka(
                *folders,
                port=kafka_port,
                controller_port=cfg.kafka_controller_port or kafka_port + 1,
                secure=secure,
            )
        return cls(
            kafka,
            Redis(*folders, port=redis_port, persistent=True),
            Weaviate(
                *folders,
                port=cfg.weaviate_http_port,
                grpc_port=cfg.weaviate_grpc_port,
                **dict(
                    zip(
                        ("gossip_port", "data_port", "raft_port", "raft_rpc_port"),
                        cfg.weaviate_cluster_ports,
                        strict=True,
                    )
                ),
            ),
            RedisCache(*folders, port=cache_port, maxmemory=cfg.cache_redis_maxmemory),
        )

    @classmethod
    def ephemeral(cls, root: Path, cache_dir: Path | None = None, brokers: int = 1) -> Stack:
        """A throwaway stack on free ports under `root` (tests, benchmarks); Kafka on `brokers` nodes."""
        folders = _folders(root, cache_dir or settings().cache_dir)
        secure = settings().kafka_security != "plaintext"
        if brokers > 1:
            kafka = KafkaCluster(
                *folders,
                ports=[(free_port(), free_port()) for _ in range(brokers)],
                test_mode=True,
                secure=secure,
            )
        else:
            kafka = Kafka(
                *folders, port=free_port(), controller_port=free_port(), test_mode=True, secure=secure
            )
        return cls(
            kafka,
            # the durable store keeps its files, as `stack up`'s does: the keys that seal tenants' content
            # (common/sealing.py) must outlive a restart of it, or everything written before is erased
            Redis(*folders, port=free_port(), persistent=True),
            Weaviate(
                *folders,
                port=free_port(),
                grpc_port=free_port(),
                gossip_port=free_port(),
                data_port=free_port(),
                raft_port=free_port(),
                raft_rpc_port=free_port(),
            ),
            RedisCache(*folders, port=free_port(), maxmemory="32mb"),
        )

    def up(self, say=print) -> None:
        for service in self.services:
            service.start(say)

    def down(self, say=print) -> None:
        for service in reversed(self.services):
            if not service.stop(say):
                say(f"{service.name}: not running")

    def status(self) -> list[Status]:
        return [s.status() for s in self.services]

    @property
    def folders(self) -> tuple[Path, Path, Path, Path]:
        return self.kafka.data_dir.parent, self.kafka.run_dir, self.kafka.log_dir, self.kafka.cache_dir

    def environment(self) -> dict[str, str]:
        """TOKENSTREAM_* variables that point a role at this stack."""
        return {
            **self.kafka.environment(),
            "TOKENSTREAM_REDIS_URL": self.redis.address,
            "TOKENSTREAM_CACHE_REDIS_URL": self.cache.address,
            "TOKENSTREAM_WEAVIATE_HTTP_PORT": str(self.weaviate.port),
            "TOKENSTREAM_WEAVIATE_GRPC_PORT": str(self.weaviate.grpc_port),
        }


def use(environment: dict[str, str]) -> None:
    """Point this process's own clients at a stack it started (`Stack.environment()`, or one service's):
    a benchmark's in-process worker or checks then reach that broker, authenticated as it expects."""
    import os

    os.environ.update(environment)
    settings.cache_clear()


@contextlib.contextmanager
def used(environment: dict[str, str]):
    """`use(environment)` for the duration of the block, then the variables it named as they were."""
    import os

    before = {k: os.environ.get(k) for k in environment}
    use(environment)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        settings.cache_clear()


def _folders(root: Path, cache_dir: Path) -> tuple[Path, Path, Path, Path]:
    return root / "data", root / "run", root / "logs", cache_dir
