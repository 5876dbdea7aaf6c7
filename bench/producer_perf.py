"""Kafka's own producer performance tool (`org.apache.kafka.tools.ProducerPerformance`) against a running
broker: the baseline `bench tokens` sets the token path's capacity beside.

The tool is the `kafka-tools` jar of the Kafka version the stack runs (bench/kafka_tools.pom.xml),
resolved from Maven Central on first use into the broker's cache folder (`kafka-<version>/tools`) and
run on the broker's own classpath. It writes to a scratch topic with the tokens topic's partition
count, at Kafka's producer defaults but acks=all (what every role's producer asks for), as the
broker's super user over SASL/SCRAM when the broker wants it.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

POM = Path(__file__).with_name("kafka_tools.pom.xml")
MAIN = "org.apache.kafka.tools.ProducerPerformance"
TOPIC = "bench.producer-perf"
# "200000 records sent, 98716.7 records/sec (9.41 MB/sec), 250.5 ms avg latency, 413.0 ms max latency, ..."
SUMMARY = re.compile(
    r"(\d+) records sent, ([\d.]+) records/sec \(([\d.]+) MB/sec\), ([\d.]+) ms avg latency, "
    r"([\d.]+) ms max latency(?:, (\d+) ms 50th, (\d+) ms 95th, (\d+) ms 99th)?"
)


def tools_folder(kafka) -> Path:
    """The kafka-tools jar's folder beside the broker's jars, resolved once."""
    from tokenstream.stack.service import maven_copy

    folder = kafka.libs.parent / "tools"
    if not (folder / ".complete").exists():
        maven_copy(POM, folder, "kafka-tools")
        (folder / ".complete").write_text("kafka-tools")
    return folder


async def baseline(kafka, record_size: int, records: int, partitions: int, say=print) -> dict:
    """ProducerPerformance's figures for `records` records of `record_size` bytes, acks=all."""
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from tokenstream.stack.kafka import ADMIN

    tools = await asyncio.to_thread(tools_folder, kafka)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.address, **kafka.client_options())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(TOPIC, partitions, 1)])
    finally:
        await admin.close()
    with tempfile.TemporaryDirectory(prefix="bench-producer-perf-") as tmp:
        config = Path(tmp) / "producer.properties"
        lines = [f"bootstrap.servers={kafka.address}", "acks=all"]
        if kafka.secure:
            lines += [
                "security.protocol=SASL_PLAINTEXT",
                "sasl.mechanism=SCRAM-SHA-512",
                (
                    "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required "
                    f'username="{ADMIN}" password="{kafka.secret(ADMIN)}";'
                ),
            ]
        config.write_text("\n".join(lines) + "\n")
        command = [
            "java",
            "-Xmx512m",
            "-cp",
            f"{kafka.libs}/*:{tools}/*",
            MAIN,
            "--topic",
            TOPIC,
            "--num-records",
            str(records),
            "--record-size",
            str(record_size),
            "--throughput",
            "-1",
            "--command-config",
            str(config),
        ]
        say(f"baseline: Kafka's ProducerPerformance, {records:,} records of {record_size} bytes, acks=all")
        proc = await asyncio.create_subprocess_exec(
            *command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 300)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    text = out.decode(errors="replace")
    found = SUMMARY.findall(text)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"ProducerPerformance failed (exit {proc.returncode}):\n{text[-2000:]}")
    sent, per_s, mb_s, avg, most, p50, p95, p99 = found[-1]
    return {
        "tool": MAIN,
        "command": " ".join(command[command.index(MAIN) :]),
        "producer_settings": "Kafka's defaults, acks=all" + (", SASL/SCRAM-SHA-512" if kafka.secure else ""),
        "topic_partitions": partitions,
        "record_size": record_size,
        "records": int(sent),
        "records_per_s": float(per_s),
        "mb_per_s": float(mb_s),
        "latency_ms": {
            "avg": float(avg),
            "max": float(most),
            **({"p50": int(p50), "p95": int(p95), "p99": int(p99)} if p50 else {}),
        },
    }
