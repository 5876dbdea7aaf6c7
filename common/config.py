"""Typed configuration, read from TOKENSTREAM_* environment variables with local defaults."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


def _xdg(var: str, fallback: str) -> Path:
    return Path(os.environ.get(var) or Path.home() / fallback) / "tokenstream"


class Settings(BaseSettings):
    """One place for every knob. Example: TOKENSTREAM_KAFKA_BOOTSTRAP=10.0.0.5:9092."""

    model_config = SettingsConfigDict(env_prefix="TOKENSTREAM_", extra="ignore")

    kafka_bootstrap: str = "127.0.0.1:9092"
    kafka_controller_port: int | None = Field(
        None, description="KRaft controller port of `stack up` (default: the bootstrap port + 1)"
    )
    kafka_replication: int = Field(1, ge=1, description="replication factor of created topics")
    kafka_brokers: int = Field(
        1,
        ge=1,
        le=9,
        description="nodes of the local stack's Kafka (`stack up "
        "--brokers 3`: a three-node cluster on the bootstrap port and the next five)",
    )
    kafka_session_timeout_s: float = Field(
        3.0,
        ge=1,
        le=300,
        description="how long a group member may stay silent before the broker hands its "
        "partitions to the others: the takeover time after a death no supervisor reports (a process that "
        "dies under `ops supervise` or `guard` leaves at once); heartbeats every sixth of it; the "
        "brokers' group.min.session.timeout.ms must allow it (Kafka's default, 6 s, does not allow 3)",
    )
    kafka_security: Literal["sasl_plaintext", "sasl_ssl", "plaintext"] = Field(
        "sasl_plaintext",
        description="how every client authenticates to the broker: SASL/SCRAM-SHA-512 "
        "(over TLS with sasl_ssl), or plaintext for a broker without SASL (common/kafka_auth.py)",
    )
    kafka_user: str | None = Field(
        None, description="this process's broker user (default: its role's, admin for the operator's tools)"
    )
    kafka_password: SecretStr | None = Field(None, description="the password of TOKENSTREAM_KAFKA_USER")
    kafka_credentials_dir: Path | None = Field(
        None,
        description="a folder with one password file per broker "
        "user (the local stack's: written by `stack up`, `topics apply`)",
    )
    id_key: SecretStr | None = Field(
        None,
        description="64 hex digits: the key that makes request ids opaque, "
        "the same in every gateway and auditor (default: the data folder's id-key)",
    )
    ledger_key: SecretStr | None = Field(
        None,
        description="64 hex digits: the seed of the audit notary's "
        "Ed25519 signing key (default: the data folder's ledger-key)",
    )
    kafka_ssl_cafile: Path | None = Field(
        None, description="the CA that signed the brokers' certificates (sasl_ssl)"
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="the durable Redis (noeviction): API keys, "
        "usage, files, vector stores, stored responses, ledgers, rate-limit counters",
    )
    sealing: bool = Field(
        True,
        description="seal a tenant's content on the topics and in the stores with "
        "keys of its conversations held in the durable Redis (`tokenstream erase` destroys "
        "them); off only to measure what sealing costs",
    )
    cache_redis_url: str = Field(
        "redis://127.0.0.1:6380/0",
        description="the evicting Redis (allkeys-lru): "
        "the exact response cache alone; losing any key there loses nothing",
    )
    cache_redis_maxmemory: str = Field("256mb", description="maxmemory of the cache Redis `stack up` starts")
    redis_outage_s: float = Field(
        30.0,
        gt=0,
        description="how long a role retries an unreachable Redis "
        "(back-off, input held) before it exits for its supervisor to restart it",
    )
    recovery_stall_s: float = Field(
        30.0,
        gt=0,
        description="how long a processor's table recovery may read "
        "nothing while records are left before it exits for its supervisor to restart it",
    )
    weaviate_host: str = "127.0.0.1"
    weaviate_http_port: int = 8080
    weaviate_grpc_port: int = 50051
    weaviate_cluster_ports: tuple[int, int, int, int] = Field(
        (7946, 7947, 8300, 8301), description="gossip, data, raft and raft-rpc ports of `stack up`"
    )

    data_dir: Path = Field(
        default_factory=lambda: _xdg("XDG_DATA_HOME", ".local/share"),
        description="persistent broker, Redis and Weaviate data of `stack up`",
    )
    cache_dir: Path = Field(
        default_factory=lambda: _xdg("XDG_CACHE_HOME", ".cache"),
        description="downloaded Kafka jars and the built Weaviate binary",
    )

    models: list[str] = ["smollm2"]
    gateway_port: int = Field(8000, description="port of the gateway `system up` starts")
    worker_metrics_port: int = Field(
        9400, description="Prometheus and health port of the worker `system up` starts"
    )
    tools_health_port: int = Field(9450, description="health port of the tool processor `system up` starts")
    model_paths: dict[str, Path] = Field(
        default_factory=dict, description="served model name -> local Hugging Face folder (JSON object)"
    )
    context_tokens: dict[str, int] = Field(
        default_factory=dict,
        description="served model name -> context window in tokens, overriding the "
        "model's own (JSON object); read through common.models",
    )
    region: str = Field(
        "",
        pattern=r"^([a-z][a-z0-9-]{0,15})?$",
        description="this deployment's region (empty: a deployment of one region). A key made "
        "here is at home here; its tenant's content is written to this region's cluster and "
        "stores only (docs/operators.md, Regions)",
    )
    regions: dict[str, str] = Field(
        default_factory=dict,
        description="every region of the deployment -> the base URL of its gateways "
        "(JSON object). A gateway sends the requests of a key at home elsewhere to that URL, or answers 421 "
        "where the region has none; `topics apply` grants the gateway the other regions' mirrored topics",
    )
    presets_file: Path = Field(
        Path(__file__).with_name("presets.json"),
        description="assistant presets (JSON object: name -> preset), read by the "
        "gateway (404 for an unknown one) and the conversation processor",
    )


@lru_cache
def settings() -> Settings:
    return Settings()
