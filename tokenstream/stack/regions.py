"""Several regions on one machine: a stack per region (its own Kafka, Redis and Weaviate, its own
folder and ports) and MirrorMaker 2 between their clusters (`tokenstream stack up --regions eu,us`).

Region i of the recorded list runs on the single-region ports plus i x PORT_STEP (its gateway too),
under <data dir>/regions/<name>. `tokenstream --region NAME <command>` runs any command as that
region's: its stack, its keys, its roles. In a real deployment each region is its own environment
with TOKENSTREAM_REGION and TOKENSTREAM_REGIONS set (docs/operators.md, Regions).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from common.config import Settings, settings

PORT_STEP = 100
NAME = re.compile(r"^[a-z][a-z0-9-]{0,15}$")


def parse(names: str) -> list[str]:
    """'eu,us' -> ['eu', 'us'] (two or more distinct names of lowercase letters, digits and '-')."""
    out = [n.strip() for n in names.split(",") if n.strip()]
    bad = [n for n in out if not NAME.match(n)]
    if bad or len(out) < 2 or len(set(out)) != len(out):
        raise ValueError(f"--regions: two or more distinct names like eu,us (got {names!r})")
    return out


def _record(cfg: Settings) -> Path:
    """Where the local regions are recorded: in the machine's data folder, which a local region's own
    settings (region_settings) name as the grandparent of theirs."""
    base = (
        cfg.data_dir.parent.parent if cfg.region and cfg.data_dir.parent.name == "regions" else cfg.data_dir
    )
    return base / "regions.json"


def recorded(base: Settings | None = None) -> list[str]:
    """The regions `stack up --regions` last started on this machine ([] if none), from its own
    settings or from those of one of its regions."""
    path = _record(base or settings())
    return json.loads(path.read_text()) if path.exists() else []


def record(names: list[str], base: Settings | None = None) -> None:
    path = _record(base or settings())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(names))


def _shift_url(url: str, step: int) -> str:
    return re.sub(r":(\d+)(/|$)", lambda m: f":{int(m.group(1)) + step}{m.group(2)}", url, count=1)


def region_settings(name: str, names: list[str], base: Settings | None = None) -> Settings:
    """The settings of region `name` of the local regions `names`, from the single-region ones."""
    base = base or settings()
    if name not in names:
        raise ValueError(f"no region {name!r} here (the local regions: {', '.join(names) or 'none'})")
    step = PORT_STEP * names.index(name)
    host, port = base.kafka_bootstrap.rsplit(":", 1)
    return base.model_copy(
        update={
            "region": name,
            "regions": {
                r: f"http://127.0.0.1:{base.gateway_port + PORT_STEP * i}" for i, r in enumerate(names)
            },
            "kafka_bootstrap": f"{host}:{int(port) + step}",
            "kafka_controller_port": (base.kafka_controller_port or int(port) + 1) + step,
            "redis_url": _shift_url(base.redis_url, step),
            "cache_redis_url": _shift_url(base.cache_redis_url, step),
            "weaviate_http_port": base.weaviate_http_port + step,
            "weaviate_grpc_port": base.weaviate_grpc_port + step,
            "weaviate_cluster_ports": tuple(p + step for p in base.weaviate_cluster_ports),
            "gateway_port": base.gateway_port + step,
            "worker_metrics_port": base.worker_metrics_port + step,
            "tools_health_port": base.tools_health_port + step,
            "data_dir": base.data_dir / "regions" / name,
        }
    )


REGIONAL = (
    "region",
    "regions",
    "kafka_bootstrap",
    "kafka_controller_port",
    "redis_url",
    "cache_redis_url",
    "weaviate_http_port",
    "weaviate_grpc_port",
    "weaviate_cluster_ports",
    "gateway_port",
    "worker_metrics_port",
    "tools_health_port",
    "data_dir",
)


def environment(cfg: Settings) -> dict[str, str]:
    """The TOKENSTREAM_* variables of a region's settings: this process and the roles it starts."""
    out = {}
    for field in REGIONAL:
        value = getattr(cfg, field)
        out[f"TOKENSTREAM_{field.upper()}"] = (
            json.dumps(list(value) if isinstance(value, tuple) else value)
            if isinstance(value, (dict, tuple))
            else str(value)
        )
    return out


def mirror(names: list[str], base: Settings | None = None):
    """MirrorMaker 2 between the local regions' clusters, copying the registry's mirrored topics."""
    from tokenstream.stack.mirror import MirrorMaker
    from tokenstream.stack.stack import Stack, _folders
    from topics.registry import REGISTRY

    base = base or settings()
    clusters = {name: Stack.default(region_settings(name, names, base)).kafka for name in names}
    return MirrorMaker(
        *_folders(base.data_dir / "regions" / "mirror", base.cache_dir),
        clusters=clusters,
        topics=tuple(spec.name for spec in REGISTRY if spec.mirrored),
    )
