"""Three Kafka nodes on loopback, each broker and controller: a cluster that loses nothing when one dies.

Every node votes in a static KRaft quorum (controller.quorum.voters) and serves as a broker; every
partition has three copies and `min.insync.replicas` 2, so an acknowledged write (acks=all) is on
at least two nodes and any one node may die, the active controller included, without losing it or
stopping writes. The nodes share one cluster id, one set of passwords (`credentials/`) and the
same ACLs (the metadata log is the quorum's, not a node's). The cluster answers to what the stack
asks of its broker (`address`, `environment()`, `start`, `stop`, `status`), and keeps its nodes in
`nodes` for what a drill does to one of them.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenstream.stack.kafka import Kafka, new_cluster_id
from tokenstream.stack.service import ServiceError, Status


class KafkaCluster:
    name = "kafka"
    ready_timeout_s = 180.0

    def __init__(
        self,
        data_dir: Path,
        run_dir: Path,
        log_dir: Path,
        cache_dir: Path,
        *,
        ports: list[tuple[int, int]],
        heap: str = "384m",
        test_mode: bool = False,
        secure: bool = True,
    ) -> None:
        """`ports`: (client port, controller port) of each node, node ids 1, 2, ... in that order."""
        if len(ports) < 3:
            raise ValueError("a cluster has three nodes or more (one node: tokenstream/stack/kafka.py)")
        self.data_dir, self.run_dir, self.log_dir, self.cache_dir = (
            data_dir / self.name,
            run_dir,
            log_dir,
            cache_dir,
        )
        voters = {n: controller for n, (_, controller) in enumerate(ports, start=1)}
        self.nodes = [
            Kafka(
                data_dir,
                run_dir,
                log_dir,
                cache_dir,
                port=port,
                controller_port=controller,
                heap=heap,
                test_mode=test_mode,
                secure=secure,
                node_id=n,
                voters=voters,
                cluster_id=self._cluster_id(),
                credentials_dir=self.credentials_dir,
            )
            for n, (port, controller) in enumerate(ports, start=1)
        ]
        self.secure = secure

    def _cluster_id(self) -> str:
        """The cluster's id, made once and kept beside its nodes' folders."""
        path = self.data_dir / "cluster-id"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(new_cluster_id())
        return path.read_text().strip()

    # -- what the stack and the clients ask of a broker ------------------------------
    @property
    def credentials_dir(self) -> Path:
        return self.data_dir / "credentials"

    @property
    def replication(self) -> int:
        return self.nodes[0].replication

    @property
    def address(self) -> str:
        """Every node's client address: a client starting while one node is down still finds the others."""
        return ",".join(node.address for node in self.nodes)

    def secret(self, user: str) -> str:
        return self.nodes[0].secret(user)

    def client_options(self) -> dict:
        return self.nodes[0].client_options()

    def environment(self) -> dict[str, str]:
        """The clients' variables (as one node's), with every node's address and the cluster's replication."""
        return {
            **self.nodes[0].environment(),
            "TOKENSTREAM_KAFKA_BOOTSTRAP": self.address,
            "TOKENSTREAM_KAFKA_REPLICATION": str(self.replication),
        }

    def install(self, say) -> None:
        self.nodes[0].install(say)

    def pid(self) -> int | None:
        """A live node's pid (None when every node is down)."""
        return next((pid for pid in (node.pid() for node in self.nodes) if pid is not None), None)

    def start(self, say=print, wait: bool = True) -> bool:
        """Launch every node that is down, then wait until each is a registered broker.

        The nodes start together: one alone cannot elect a controller (a quorum needs two of three)."""
        started = [node.start(say, wait=False) for node in self.nodes]
        if wait:
            self.wait_ready()
            say(f"{self.name}: {len(self.nodes)} nodes ready at {self.address}")
        return any(started)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            down = [node.name for node in self.nodes if node.pid() is None]
            if down:
                raise ServiceError(
                    f"{', '.join(down)} exited; see {self.nodes[0].log_file.parent}:\n"
                    + "\n".join(n.log_tail(8) for n in self.nodes if n.name in down)
                )
            if self.brokers() == {node.node_id for node in self.nodes}:
                return
            time.sleep(0.5)
        raise ServiceError(
            f"{self.name}: not every node registered after {self.ready_timeout_s:.0f}s; see "
            f"{self.nodes[0].log_file.parent}"
        )

    def brokers(self) -> set[int]:
        """The node ids the cluster lists as brokers now (asked of any node that answers)."""
        for node in self.nodes:
            found = node.registered() if node.pid() is not None else set()
            if found:
                return found
        return set()

    def active_controller(self) -> int | None:
        """The node id of the quorum's leader, the active controller, as every live node's quorum-state
        file says it (None while they disagree, or none leads)."""
        leaders = set()
        for node in self.nodes:
            if node.pid() is None:
                continue
            try:
                leaders.add(
                    json.loads((node.data_dir / "log" / "__cluster_metadata-0" / "quorum-state").read_text())[
                        "leaderId"
                    ]
                )
            except (OSError, ValueError, KeyError):
                return None
        return leaders.pop() if len(leaders) == 1 and -1 not in leaders else None

    async def under_replicated(self) -> list[str]:
        """Every partition (topic-partition) with a copy out of sync, or with the cluster unable to answer."""
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(
            bootstrap_servers=self.address, request_timeout_ms=5000, **self.client_options()
        )
        try:
            await admin.start()
            topics = await admin.describe_topics()
        except Exception as exc:  # noqa: BLE001 - a cluster that cannot answer is not in sync
            return [f"(no answer: {type(exc).__name__})"]
        finally:
            await admin.close()
        return [
            f"{t['topic']}-{p['partition']}"
            for t in topics
            for p in t["partitions"]
            if len(p["isr"]) < len(p["replicas"]) or p["leader"] < 0
        ]

    async def wait_in_sync(self, timeout_s: float = 180.0) -> None:
        """Wait until every node is a broker and every partition has all its copies in sync: the moment a
        rolling restart may take the next node down (earlier, a partition could fall below
        min.insync.replicas and refuse writes)."""
        import asyncio

        deadline = time.monotonic() + timeout_s
        while True:
            registered = await asyncio.to_thread(self.brokers)
            lagging = (
                await self.under_replicated() if len(registered) == len(self.nodes) else ["(a node is down)"]
            )
            if not lagging:
                return
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"{self.name}: not in sync after {timeout_s:.0f} s: brokers {sorted(registered)}, "
                    f"behind: {', '.join(lagging[:5])}"
                )
            await asyncio.sleep(0.5)

    def node(self, node_id: int) -> Kafka:
        return self.nodes[node_id - 1]

    def stop(self, say=print) -> bool:
        """Stop every node at once: a node stopped last, alone, waits in vain for a quorum to let it go."""
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            return any(list(pool.map(lambda node: node.stop(say), self.nodes)))

    def status(self) -> Status:
        up = [node for node in self.nodes if node.pid() is not None]
        listed = self.brokers() if up else set()
        detail = ", ".join(
            f"{node.name} {'broker' if node.node_id in listed else 'down' if node not in up else 'starting'}"
            for node in self.nodes
        )
        return Status(
            self.name,
            bool(up),
            len(listed) == len(self.nodes),
            self.pid(),
            self.address,
            self.nodes[0].log_file,
            detail=detail,
        )
