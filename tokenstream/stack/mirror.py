"""MirrorMaker 2 between the regions' clusters: the one path by which anything crosses a region.

It copies the mirrored topics of the registry (`TopicSpec.mirrored`: ts.key.homes, the API keys' home
regions) from every region's cluster to every other's, where they appear as `<region>.<topic>` (its
default replication policy, which also keeps a copy from coming back where it came from). Nothing
else is copied: a tenant's requests, tokens and files stay on their home region's cluster (the
gateways send a key's requests home, gateway/home_region.py).

One process (MirrorMaker's dedicated mode, `org.apache.kafka.connect.mirror.MirrorMaker`), as the
user `mirror` of each cluster, whose ACLs allow what it does there and nothing more
(topics/access.py, `_mirroring`; made by each region's `topics apply`). Its passwords stay in a file
of their own (mode 0600) that the properties name through Kafka's FileConfigProvider: the connector
configurations MirrorMaker stores on the target clusters hold placeholders, never a password.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import secret_files
from tokenstream.stack.kafka import SCRAM
from tokenstream.stack.service import Service, maven_copy
from topics.access import MIRROR

MIRROR_VERSION = "4.3.1"  # connect-mirror: the newest the registry here resolves; it speaks to 4.4 brokers
POM = Path(__file__).with_name("mirror.pom.xml")
MAIN = "org.apache.kafka.connect.mirror.MirrorMaker"


def libs(cache_dir: Path) -> Path:
    return cache_dir / f"kafka-mirror-{MIRROR_VERSION}" / "libs"


class MirrorMaker(Service):
    name = "mirrormaker"
    ready_timeout_s = 120.0

    def __init__(self, *folders: Path, clusters: dict, topics: tuple[str, ...]) -> None:
        """`clusters`: region -> its Kafka (a node or a KafkaCluster); `topics`: the topics to copy."""
        super().__init__(*folders)
        if len(clusters) < 2:
            raise ValueError("MirrorMaker copies between two regions or more")
        self.clusters = clusters
        self.topics = topics

    @property
    def address(self) -> str:
        return " <-> ".join(self.clusters)

    @property
    def libs(self) -> Path:
        return libs(self.cache_dir)

    def install(self, say) -> None:
        self.fetch(self.cache_dir, say)

    @staticmethod
    def fetch(cache_dir: Path, say) -> None:
        """Resolve connect-mirror and its runtime jars from Maven Central into the cache, once."""
        folder = libs(cache_dir)
        if (folder / ".complete").exists():
            return
        say(f"mirrormaker: resolving connect-mirror:{MIRROR_VERSION} and its runtime jars from Maven Central")
        maven_copy(POM, folder, "mirrormaker")
        (folder / ".complete").write_text(MIRROR_VERSION)

    @property
    def properties_file(self) -> Path:
        return self.data_dir / "mirrormaker.properties"

    @property
    def secrets_file(self) -> Path:
        return self.data_dir / "cluster-passwords.properties"

    def properties(self) -> dict[str, str]:
        regions = list(self.clusters)
        copies = str(min(kafka.replication for kafka in self.clusters.values()))
        props = {
            "clusters": ", ".join(regions),
            "topics": "|".join(t.replace(".", "\\.") for t in self.topics),
            "groups.exclude": ".*",  # consumer groups are each region's own: no offsets are translated
            "refresh.topics.interval.seconds": "5",
            "sync.topic.acls.enabled": "false",  # each cluster's ACLs come from its own `topics apply`
            "emit.heartbeats.enabled": "false",
            "sync.group.offsets.enabled": "false",
            "plugin.discovery": "service_load",
            "config.providers": "file",
            "config.providers.file.class": "org.apache.kafka.common.config.provider.FileConfigProvider",
            **{
                f"{name}.replication.factor": copies
                for name in (
                    "",
                    "offset-syncs.topic",
                    "checkpoints.topic",
                    "heartbeats.topic",
                    "config.storage",
                    "offset.storage",
                    "status.storage",
                )
            },
        }
        props["replication.factor"] = props.pop(".replication.factor")
        for region, kafka in self.clusters.items():
            props[f"{region}.bootstrap.servers"] = kafka.address
            if kafka.secure:
                props |= {
                    f"{region}.security.protocol": "SASL_PLAINTEXT",
                    f"{region}.sasl.mechanism": SCRAM,
                    f"{region}.sasl.jaas.config": (
                        "org.apache.kafka.common.security.scram.ScramLoginModule required "
                        f'username="{MIRROR}" password="${{file:{self.secrets_file}:{region}}}";'
                    ),
                }
            for other in regions:
                if other != region:
                    props[f"{region}->{other}.enabled"] = "true"
        return props

    def prepare(self) -> None:
        secret_files.write(
            self.secrets_file,
            "".join(
                f"{region}={kafka.secret(MIRROR)}\n"
                for region, kafka in self.clusters.items()
                if kafka.secure
            ),
        )
        self.properties_file.write_text("".join(f"{k} = {v}\n" for k, v in self.properties().items()))
        log4j = next(iter(self.clusters.values()))
        log4j = getattr(log4j, "nodes", [log4j])[0].data_dir / "log4j2.properties"
        (self.data_dir / "log4j2.properties").write_text(log4j.read_text() if log4j.exists() else "")

    def command(self) -> list[str]:
        return [
            "java",
            "-Xmx256m",
            f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
            "-cp",
            f"{self.libs}/*",
            MAIN,
            str(self.properties_file),
        ]

    def is_ready(self) -> bool:
        """Every region's cluster holds the copy of each other region's mirrored topics (MirrorMaker
        makes a copy once the topic exists at its source: after `topics apply` there)."""
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, self._copies_present()).result()

    def copies(self) -> dict[str, list[str]]:
        """region -> the copies its cluster should hold."""
        return {
            region: [
                f"{other}.{topic}" for other in self.clusters if other != region for topic in self.topics
            ]
            for region in self.clusters
        }

    async def _copies_present(self) -> bool:
        from aiokafka import AIOKafkaConsumer

        for region, wanted in self.copies().items():
            kafka = self.clusters[region]
            consumer = AIOKafkaConsumer(
                bootstrap_servers=kafka.address, request_timeout_ms=3000, **kafka.client_options()
            )
            try:
                await consumer.start()
                if not set(wanted) <= await consumer.topics():
                    return False
            except Exception:  # noqa: BLE001 - not answering: not ready
                return False
            finally:
                await consumer.stop()
        return True
