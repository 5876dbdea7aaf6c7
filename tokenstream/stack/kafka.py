"""Apache Kafka 4.x in KRaft mode, from Maven Central jars (no Docker): one node here, or one of a
cluster's nodes (tokenstream/stack/cluster.py).

Secure by default: clients authenticate with SASL/SCRAM-SHA-512 on the one client listener and
the StandardAuthorizer refuses whatever no ACL allows (the ACLs come from the registry, see
topics/access.py). `admin` (the operator's tools, and the broker itself between its listeners) is
the super user, created when the log folder is formatted; the controller listener takes SASL/PLAIN
from a user only this file names (KRaft controllers cannot check SCRAM). Passwords live in
`credentials/`, one file per user, mode 0600.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.kafka_auth import ensure_password, scram_options
from tokenstream.stack.service import Service, ServiceError, maven_copy, port_open

log = logging.getLogger(__name__)
KAFKA_VERSION = "4.4.0"
POM = Path(__file__).with_name("kafka.pom.xml")
MAIN = "kafka.Kafka"
SCRAM = "SCRAM-SHA-512"
ADMIN = "admin"  # the super user (the operator's tools; the broker itself on its client listener)
CONTROLLER_USER = "controller"  # the controller listener's only user (SASL/PLAIN)

# warnings only, but for the group coordinators: which member failed, joined or left, and when a
# group was loaded on another node, are what a slow takeover is read from (docs/operators.md)
LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.out.ref = out
logger.kafka.name = kafka
logger.kafka.level = warn
logger.org.name = org.apache.kafka
logger.org.level = warn
logger.state.name = state.change.logger
logger.state.level = warn
logger.groups.name = org.apache.kafka.coordinator.group
logger.groups.level = info
"""


class Kafka(Service):
    name = "kafka"
    ready_timeout_s = 120.0

    def __init__(
        self,
        *args,
        port: int = 9092,
        controller_port: int = 9093,
        heap: str = "512m",
        test_mode: bool = False,
        secure: bool = True,
        node_id: int = 1,
        voters: dict[int, int] | None = None,
        cluster_id: str | None = None,
        credentials_dir: Path | None = None,
    ) -> None:
        """One node; `voters` (node id -> controller port) makes it one of a cluster's nodes
        (tokenstream/stack/cluster.py), which share `cluster_id` and `credentials_dir`."""
        if voters:
            self.name = f"kafka-{node_id}"
        super().__init__(*args)
        self.port = port
        self.controller_port = controller_port
        self.heap = heap
        self.test_mode = test_mode
        self.secure = secure
        self.node_id, self.voters, self.cluster_id = node_id, voters or {}, cluster_id
        self._credentials_dir = credentials_dir

    @property
    def replication(self) -> int:
        """Copies of each partition: one per node, three at most."""
        return min(3, max(1, len(self.voters)))

    @property
    def credentials_dir(self) -> Path:
        """One password file per broker user (`topics apply` adds the roles')."""
        return self._credentials_dir or self.data_dir / "credentials"

    def secret(self, user: str) -> str:
        """The password of `user`, made on first use."""
        return ensure_password(self.credentials_dir, user)

    def environment(self) -> dict[str, str]:
        """TOKENSTREAM_* variables that point a client at this broker, as the user it names."""
        return {
            "TOKENSTREAM_KAFKA_BOOTSTRAP": self.address,
            "TOKENSTREAM_KAFKA_SECURITY": "sasl_plaintext" if self.secure else "plaintext",
            "TOKENSTREAM_KAFKA_CREDENTIALS_DIR": str(self.credentials_dir),
        }

    def client_options(self) -> dict:
        """aiokafka keyword arguments for this broker's super user (the stack's own checks)."""
        if not self.secure:
            return {}
        return scram_options(ADMIN, self.secret(ADMIN))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def libs(self) -> Path:
        return self.cache_dir / f"kafka-{KAFKA_VERSION}" / "libs"

    def install(self, say) -> None:
        stamp = self.libs / ".complete"
        if stamp.exists():
            return
        say(
            f"kafka: resolving kafka_2.13:{KAFKA_VERSION} and its runtime jars from Maven Central "
            f"into {self.libs}"
        )
        maven_copy(POM, self.libs, "kafka")
        stamp.write_text(KAFKA_VERSION)

    def _java(self, main: str, *args: str, heap: str = "256m", jvm: tuple[str, ...] = ()) -> list[str]:
        return [
            "java",
            f"-Xmx{heap}",
            *jvm,
            f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
            "-cp",
            f"{self.libs}/*",
            main,
            *args,
        ]

    @property
    def properties_file(self) -> Path:
        return self.data_dir / "server.properties"

    def properties(self) -> dict[str, str]:
        copies = str(self.replication)
        in_sync = str(min(2, self.replication))  # an acknowledged write is on two nodes: one may die
        quorum = (
            {
                "controller.quorum.voters": ",".join(
                    f"{n}@127.0.0.1:{p}" for n, p in sorted(self.voters.items())
                )
            }
            if self.voters
            else {"controller.quorum.bootstrap.servers": f"127.0.0.1:{self.controller_port}"}
        )
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            **quorum,
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            **(self._security() if self.secure else {}),
            "log.dirs": str(self.data_dir / "log"),
            "auto.create.topics.enable": "false",
            "offsets.topic.replication.factor": copies,
            "transaction.state.log.replication.factor": copies,
            "transaction.state.log.min.isr": in_sync,
            "share.coordinator.state.topic.replication.factor": copies,
            "share.coordinator.state.topic.min.isr": in_sync,
            "default.replication.factor": copies,
            "min.insync.replicas": in_sync,
            "group.initial.rebalance.delay.ms": "0",
            # members' session timeouts as short as TOKENSTREAM_KAFKA_SESSION_TIMEOUT_S may go
            # (producers/settings.py: the takeover time after a kill -9); Kafka's floor is 6 s
            "group.min.session.timeout.ms": "1000",
            # a node killed -9 is declared dead (its partitions led elsewhere, dropped from every ISR) after
            # 1.5 s without a heartbeat, not Kafka's 9 s: every write to a partition it led or followed waits
            # that long, the group coordinators' own writes too, and every heartbeat they answer meanwhile
            # (a classic group's heartbeat is answered after the coordinator's pending writes commit). So it
            # must stay well under the members' 3 s session (producers/settings.py), or a node kill expires
            # the members of groups coordinated on the surviving nodes too (docs/guarantees.md,
            # bench/RESULTS.md)
            "broker.session.timeout.ms": "1500",
            "broker.heartbeat.interval.ms": "250",
            # a dead active controller is replaced after 1 s without its fetch answers, not 2 s; the broker
            # session above only starts counting once a new controller leads
            "controller.quorum.fetch.timeout.ms": "1000",
            "controller.quorum.election.timeout.ms": "500",
            "num.partitions": "1",
        }
        if self.test_mode:
            props["offsets.topic.num.partitions"] = "6"
            props["transaction.state.log.num.partitions"] = "6"
        return props

    def _security(self) -> dict[str, str]:
        admin, controller = self.secret(ADMIN), self.secret(CONTROLLER_USER)
        return {
            "listeners": f"CLIENT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"CLIENT://127.0.0.1:{self.port}",
            "inter.broker.listener.name": "CLIENT",
            "listener.security.protocol.map": "CLIENT:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT",
            "sasl.mechanism.inter.broker.protocol": SCRAM,
            "sasl.mechanism.controller.protocol": "PLAIN",
            "listener.name.client.sasl.enabled.mechanisms": SCRAM,
            f"listener.name.client.{SCRAM.lower()}.sasl.jaas.config": (
                "org.apache.kafka.common.security.scram.ScramLoginModule required "
                f'username="{ADMIN}" password="{admin}";'
            ),
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config": (
                "org.apache.kafka.common.security.plain.PlainLoginModule required "
                f'username="{CONTROLLER_USER}" password="{controller}" user_{CONTROLLER_USER}="{controller}";'
            ),
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:{ADMIN};User:{CONTROLLER_USER}",
            "allow.everyone.if.no.acl.found": "false",
        }

    def prepare(self) -> None:
        (self.data_dir / "log4j2.properties").write_text(LOG4J2)
        fd = os.open(self.properties_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds passwords
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{k}={v}\n" for k, v in self.properties().items()))
        os.chmod(self.properties_file, 0o600)
        marker = self.data_dir / "log" / ".scram-admin"
        if (self.data_dir / "log" / "meta.properties").exists():
            if self.secure and not marker.exists():
                raise ServiceError(
                    f"kafka: {self.data_dir / 'log'} was formatted without SASL users (an older stack); "
                    f"keep it with TOKENSTREAM_KAFKA_SECURITY=plaintext, or start afresh: "
                    f"tokenstream stack down && rm -r {self.data_dir}"
                )
            return  # formatted before: keep the data
        cluster_id = self.cluster_id or new_cluster_id()
        scram = (
            ["--add-scram", f"{SCRAM}=[name={ADMIN},password={self.secret(ADMIN)}]"] if self.secure else []
        )
        # one node: a quorum of itself; a cluster's node: the static quorum of controller.quorum.voters
        alone = [] if self.voters else ["--standalone"]
        subprocess.run(
            self._java(
                "kafka.tools.StorageTool",
                "format",
                *alone,
                f"--cluster-id={cluster_id}",
                "-c",
                str(self.properties_file),
                *scram,
            ),
            check=True,
            stdout=subprocess.DEVNULL,
        )
        if self.secure:
            marker.write_text(ADMIN)

    def command(self) -> list[str]:
        # TieredStopAtLevel=1: the JVM's quick (C1) compiler only. This broker shares a small
        # machine's cores with everything it serves: serving a saturated worker on 2 cores it used
        # 1.3-1.6 CPU-s in a 13-s run, half of it in C2's compiler threads, and every step of the
        # engine next to it waited for the core it took. C1 only: 0.9-1.1 CPU-s in the same run,
        # 2.0 against 3.3 CPU-s to start, and the pipeline benchmark's hops within its run-to-run spread.
        return self._java(
            MAIN,
            str(self.properties_file),
            heap=self.heap,
            jvm=(
                "-XX:+UseG1GC",
                "-XX:MaxGCPauseMillis=20",
                "-XX:TieredStopAtLevel=1",
                "-Djava.awt.headless=true",
            ),
        )

    def is_ready(self) -> bool:
        return port_open(self.port) and bool(self.registered())

    def registered(self) -> set[int]:
        """The node ids this node lists as the cluster's brokers (empty when it does not answer)."""
        # A thread of its own, so the check also works when called from inside an event loop.
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, _brokers(self.address, self.client_options())).result()


def new_cluster_id() -> str:
    """The same form as `StorageTool random-uuid`: a URL-safe base64 UUID without padding."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


async def _brokers(bootstrap: str, options: dict) -> set[int]:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000, **options)
    try:
        await admin.start()
        cluster = await admin.describe_cluster()
        return {b["node_id"] for b in cluster.get("brokers") or ()}
    except Exception:  # not answering (yet): whatever the client raised, the node lists no broker
        log.debug("%s: no broker list", bootstrap, exc_info=True)
        return set()
    finally:
        await admin.close()
