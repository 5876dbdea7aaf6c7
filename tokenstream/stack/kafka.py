"""Apache Kafka 4.x, single node in KRaft mode, from Maven Central jars (no Docker)."""

from __future__ import annotations

import asyncio
import base64
import shutil
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenstream.stack.service import Service, ServiceError, port_open

KAFKA_VERSION = "4.4.0"
POM = Path(__file__).with_name("kafka.pom.xml")
MAIN = "kafka.Kafka"

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
"""


class Kafka(Service):
    name = "kafka"
    ready_timeout_s = 120.0

    def __init__(self, *args, port: int = 9092, controller_port: int = 9093,
                 heap: str = "512m", test_mode: bool = False) -> None:
        super().__init__(*args)
        self.port = port
        self.controller_port = controller_port
        self.heap = heap
        self.test_mode = test_mode

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
        if shutil.which("mvn") is None or shutil.which("java") is None:
            raise ServiceError("kafka needs java (17+) and maven on PATH: apt-get install default-jdk-headless maven")
        say(f"kafka: resolving kafka_2.13:{KAFKA_VERSION} and its runtime jars from Maven Central into {self.libs}")
        self.libs.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mvn", "-q", "-B", "-f", str(POM),
             "org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies",
             "-DincludeScope=runtime", f"-DoutputDirectory={self.libs}"],
            check=True,
        )
        stamp.write_text(KAFKA_VERSION)

    def _java(self, main: str, *args: str, heap: str = "256m", jvm: tuple[str, ...] = ()) -> list[str]:
        return ["java", f"-Xmx{heap}", *jvm, f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
                "-cp", f"{self.libs}/*", main, *args]

    @property
    def properties_file(self) -> Path:
        return self.data_dir / "server.properties"

    def properties(self) -> dict[str, str]:
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.data_dir / "log"),
            "auto.create.topics.enable": "false",
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "min.insync.replicas": "1",
            "group.initial.rebalance.delay.ms": "0",
            "num.partitions": "1",
        }
        if self.test_mode:
            props["offsets.topic.num.partitions"] = "6"
            props["transaction.state.log.num.partitions"] = "6"
        return props

    def prepare(self) -> None:
        (self.data_dir / "log4j2.properties").write_text(LOG4J2)
        self.properties_file.write_text("".join(f"{k}={v}\n" for k, v in self.properties().items()))
        if (self.data_dir / "log" / "meta.properties").exists():
            return  # formatted before: keep the data
        # The same form as `StorageTool random-uuid`: a URL-safe base64 UUID without padding.
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        subprocess.run(
            self._java("kafka.tools.StorageTool", "format", "--standalone", f"--cluster-id={cluster_id}",
                       "-c", str(self.properties_file)),
            check=True, stdout=subprocess.DEVNULL,
        )

    def command(self) -> list[str]:
        # TieredStopAtLevel=1: the JVM's quick (C1) compiler only. This broker shares a small
        # machine's cores with everything it serves: serving a saturated worker on 2 cores it used
        # 1.3-1.6 CPU-s in a 13-s run, half of it in C2's compiler threads, and every step of the
        # engine next to it waited for the core it took. C1 only: 0.9-1.1 CPU-s in the same run,
        # 2.0 against 3.3 CPU-s to start, and the pipeline benchmark's hops within its run-to-run spread.
        return self._java(MAIN, str(self.properties_file), heap=self.heap,
                          jvm=("-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:TieredStopAtLevel=1",
                               "-Djava.awt.headless=true"))

    def is_ready(self) -> bool:
        if not port_open(self.port):
            return False
        # A thread of its own, so the check also works when called from inside an event loop.
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, _cluster_answers(self.address)).result()


async def _cluster_answers(bootstrap: str) -> bool:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000)
    try:
        await admin.start()
        cluster = await admin.describe_cluster()
        return bool(cluster.get("brokers"))
    except Exception:
        return False
    finally:
        await admin.close()
