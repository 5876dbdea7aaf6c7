"""deploy/k8s validated offline: built-in kinds against the Kubernetes schemas (kubernetes-validate),
KEDA, Strimzi and prometheus-operator resources against their CRDs' structure; the KafkaTopic
resources equal what the registry generates; the dashboard and alerts name metrics that exist."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.k8s_crds import SCHEMAS
from topics import inference_topic
from topics.access import USERS
from topics.export import strimzi_topics, strimzi_users, to_yaml
from topics.registry import TOOL_CALLS, all_topics, processor_group, worker_group

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.32"
#: metrics of the Strimzi Kafka Exporter the alerts and dashboard use beside tokenstream's own
EXPORTER_METRICS = {"kafka_consumergroup_lag", "kafka_topic_partition_current_offset"}


def build(folder: Path) -> list[dict]:
    """The resources of a kustomization (resources and configMapGenerator files; what these use)."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    out: list[dict] = []
    for entry in spec.get("resources", []):
        path = folder / entry
        if path.is_dir():
            out += build(path)
        else:
            out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for gen in spec.get("configMapGenerator", []):
        data = {Path(f).name: (folder / f).read_text() for f in gen["files"]}
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    for patch in spec.get("patches", []):  # merge patches (RFC 7386) of resources chosen by kind and name
        for doc in (d for d in yaml.safe_load_all((folder / patch["path"]).read_text()) if d):
            [target] = [
                r for r in out if _selected(r, {"kind": doc["kind"], "name": doc["metadata"]["name"]})
            ]
            _merge(target, doc)
    for rule in spec.get("replacements", []):
        replace(out, rule)
    return out


def _merge(target: dict, patch: dict) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value


def _path(field_path: str) -> list[str]:
    """kustomize's field path: dots between names, [name] for a name holding dots."""
    return [m.group(1) or m.group(2) for m in re.finditer(r"\[([^\]]+)\]|([^.\[\]]+)", field_path)]


def _selected(res: dict, select: dict) -> bool:
    return res["kind"] == select["kind"] and res["metadata"]["name"] == select["name"]


def replace(resources: list[dict], rule: dict) -> None:
    """A kustomize replacement of the simple form these files use (a source field into target fields;
    a scalar copied into a string field stays a string, as kustomize writes it)."""
    [source] = [r for r in resources if _selected(r, rule["source"])]
    value = source
    for name in _path(rule["source"]["fieldPath"]):
        value = value[name]
    for target in rule["targets"]:
        for res in (r for r in resources if _selected(r, target["select"])):
            for field_path in target["fieldPaths"]:
                *parents, last = _path(field_path)
                node = res
                for name in parents:
                    node = node[name]
                node[last] = str(value) if isinstance(node[last], str) else value


FOLDERS = [K8S / "base", K8S / "overlays" / "canary", K8S / "overlays" / "region-eu", K8S / "monitoring"]


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_every_manifest_validates_against_its_schema(folder):
    resources = build(folder)
    assert resources
    for res in resources:
        key = (res["apiVersion"], res["kind"])
        if key in SCHEMAS:
            jsonschema.validate(res, SCHEMAS[key])
        else:
            kubernetes_validate.validate(res, KUBERNETES_VERSION, strict=True)


def test_a_broken_manifest_is_caught():
    [deployment] = [
        r
        for r in build(K8S / "base")
        if r["metadata"]["name"] == "worker-smollm2" and r["kind"] == "Deployment"
    ]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = ["metrics"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    [scaled] = [r for r in build(K8S / "base") if r["kind"] == "ScaledObject"]
    del scaled["spec"]["triggers"][0]["metadata"]["consumerGroup"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, SCHEMAS[("keda.sh/v1alpha1", "ScaledObject")])


def test_the_kafka_topics_are_what_the_registry_generates():
    env_free = os.environ.get("TOKENSTREAM_AUDIT_RETENTION_DAYS") is None
    assert env_free, "the committed resources use the default audit retention"
    assert (K8S / "base" / "kafkatopics.yaml").read_text() == to_yaml(
        strimzi_topics(all_topics(["smollm2"]), "tokenstream", 3)
    )
    assert (K8S / "overlays" / "canary" / "kafkatopic-smollm2-v2.yaml").read_text() == to_yaml(
        strimzi_topics([inference_topic("smollm2-v2")], "tokenstream", 3)
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenstream.cli",
            "topics",
            "export",
            "--format",
            "strimzi",
            "--model",
            "smollm2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 0 and out.stdout == (K8S / "base" / "kafkatopics.yaml").read_text()


def test_the_kafka_users_are_what_the_registry_generates():
    assert (K8S / "base" / "kafkausers.yaml").read_text() == to_yaml(
        strimzi_users(all_topics(["smollm2"]), "tokenstream"), "strimzi-users"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenstream.cli",
            "topics",
            "export",
            "--format",
            "strimzi-users",
            "--model",
            "smollm2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 0 and out.stdout == (K8S / "base" / "kafkausers.yaml").read_text()
    # The canary's users: those of both models whose grants differ from the base's.
    base = {u["metadata"]["name"]: u for u in strimzi_users(all_topics(["smollm2"]), "tokenstream")}
    both = strimzi_users(all_topics(["smollm2", "smollm2-v2"]), "tokenstream")
    assert (K8S / "overlays" / "canary" / "kafkausers-smollm2-v2.yaml").read_text() == to_yaml(
        [u for u in both if base[u["metadata"]["name"]] != u], "strimzi-users"
    )
    [canary_worker] = [
        r
        for r in build(K8S / "overlays" / "canary")
        if r["kind"] == "KafkaUser" and r["metadata"]["name"] == "worker"
    ]
    names = {acl["resource"]["name"] for acl in canary_worker["spec"]["authorization"]["acls"]}
    assert {"ts.inference.smollm2", "ts.inference.smollm2-v2", "worker.smollm2-v2"} <= names


def test_the_regions_users_are_what_the_registry_generates():
    """The region overlay's KafkaUsers: MirrorMaker's, new, and the others whose grants name the other
    region."""
    folder = K8S / "overlays" / "region-eu"
    base = {u["metadata"]["name"]: u for u in strimzi_users(all_topics(["smollm2"]), "tokenstream", peers=())}
    region = strimzi_users(all_topics(["smollm2"]), "tokenstream", peers=("us",))
    assert (folder / "kafkauser-mirror.yaml").read_text() == to_yaml(
        [u for u in region if u["metadata"]["name"] not in base], "strimzi-users"
    )
    assert (folder / "kafkausers-region.yaml").read_text() == to_yaml(
        [u for u in region if u["metadata"]["name"] in base and base[u["metadata"]["name"]] != u],
        "strimzi-users",
    )
    [config] = [
        r for r in build(folder) if r["kind"] == "ConfigMap" and r["metadata"]["name"] == "tokenstream-config"
    ]
    assert config["data"]["TOKENSTREAM_REGION"] == "eu" and set(
        json.loads(config["data"]["TOKENSTREAM_REGIONS"])
    ) == {"eu", "us"}
    [mirror] = [r for r in build(folder) if r["kind"] == "KafkaMirrorMaker2"]
    assert [
        (m["sourceCluster"], m["targetCluster"], m["topicsPattern"]) for m in mirror["spec"]["mirrors"]
    ] == [("us", "eu", "ts\\.key\\.homes")]  # the registry's mirrored topic, nothing else
    assert {c["authentication"]["username"] for c in mirror["spec"]["clusters"]} == {"mirror"}


def _role_args(container: dict) -> list[str]:
    """The role command a container runs, with or without the guard in front of it."""
    args = container["args"]
    return args[1:] if args[:1] == ["guard"] else args


@pytest.mark.parametrize("folder", [K8S / "base", K8S / "overlays" / "canary"], ids=lambda p: p.name)
def test_every_consumer_group_member_runs_under_the_guard(folder):
    """A role that is a member of a consumer group (processors, workers, the tool processor) leaves it the
    moment it dies (tokenstream/guard.py), so a standby takes its partitions without waiting its session."""
    for res in build(folder):
        if res["kind"] == "Deployment":
            [container] = res["spec"]["template"]["spec"]["containers"]
            if _role_args(container)[0] in ("processor", "worker", "tools"):
                assert container["args"][0] == "guard", res["metadata"]["name"]


@pytest.mark.parametrize("folder", [K8S / "base", K8S / "overlays" / "canary"], ids=lambda p: p.name)
def test_each_pod_runs_as_its_roles_broker_user(folder):
    resources = build(folder)
    users = {r["metadata"]["name"] for r in resources if r["kind"] == "KafkaUser"}
    assert users == set(USERS)
    for res in resources:
        if res["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        [container] = res["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container.get("env", [])}
        user = env["TOKENSTREAM_KAFKA_USER"]["value"]
        assert user in users, res["metadata"]["name"]
        assert env["TOKENSTREAM_KAFKA_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": user,
            "key": "password",
        }
        command = _role_args(container)
        expected = {
            "gateway": "gateway",
            "worker": "worker",
            "tools": "tools",
            "route": "operator",
            "audit": "audit",
        }.get(command[0], command[1] if command[0] == "processor" else None)
        assert user == expected, (res["metadata"]["name"], user)
    for scaled in (r for r in resources if r["kind"] == "ScaledObject"):
        for trigger in scaled["spec"]["triggers"]:
            assert trigger["metadata"]["sasl"] == "scram_sha512"
            assert trigger["authenticationRef"] == {"name": "kafka-autoscaler"}


@pytest.mark.parametrize("folder", [K8S / "base", K8S / "overlays" / "canary"], ids=lambda p: p.name)
def test_each_worker_group_scales_on_its_own_lag_within_its_partitions(folder):
    resources = build(folder)
    deployments = {r["metadata"]["name"]: r for r in resources if r["kind"] == "Deployment"}
    topics = {
        r["spec"].get("topicName", r["metadata"]["name"]): r for r in resources if r["kind"] == "KafkaTopic"
    }
    scaled = [r for r in resources if r["kind"] == "ScaledObject"]
    workers = [
        d for d in deployments.values() if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    ]
    assert workers and len(scaled) == len(workers)
    for obj in scaled:
        target = deployments[obj["spec"]["scaleTargetRef"]["name"]]
        model = target["metadata"]["labels"]["tokenstream.io/model"]
        [trigger] = obj["spec"]["triggers"]
        assert trigger["metadata"]["consumerGroup"] == worker_group(model)
        assert trigger["metadata"]["topic"] == inference_topic(model).name
        assert obj["spec"]["maxReplicaCount"] <= topics[inference_topic(model).name]["spec"]["partitions"]
        args = _role_args(target["spec"]["template"]["spec"]["containers"][0])
        assert args[:3] == ["worker", "--model", model]
        assert target["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_every_role_has_probes():
    for res in build(K8S / "base"):
        if res["kind"] in ("Deployment", "StatefulSet"):
            [container] = res["spec"]["template"]["spec"]["containers"]
            assert "readinessProbe" in container and "livenessProbe" in container, res["metadata"]["name"]


def test_workers_are_ready_only_by_their_health_and_live_unless_stuck():
    workers = [
        r
        for r in [*build(K8S / "base"), *build(K8S / "overlays" / "canary")]
        if r["kind"] == "Deployment" and r["metadata"]["name"].startswith("worker-")
    ]
    assert {w["metadata"]["name"] for w in workers} >= {"worker-smollm2", "worker-smollm2-v2"}
    for worker in workers:
        [container] = worker["spec"]["template"]["spec"]["containers"]
        paths = {
            probe: container[probe]["httpGet"]["path"]
            for probe in ("startupProbe", "readinessProbe", "livenessProbe")
        }
        assert paths == {
            "startupProbe": "/health/live",
            "readinessProbe": "/health/ready",
            "livenessProbe": "/health/live",
        }, worker["metadata"]["name"]


def test_the_tool_processor_runs_with_its_group_probe_and_a_sandbox_folder():
    [tools] = [
        r for r in build(K8S / "base") if r["kind"] == "Deployment" and r["metadata"]["name"] == "tools"
    ]
    [container] = tools["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["guard", "tools"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"][-2:] == ["--group", processor_group("tools")]
    assert {"name": "TOKENSTREAM_TOOLS_SANDBOX_DIR", "value": "/sandbox"} in container["env"]
    assert tools["spec"]["replicas"] <= TOOL_CALLS.partitions


def _metric_names() -> set[str]:
    text = "".join((ROOT / f).read_text() for f in ("gateway/metrics.py", "gpu_workers/metrics.py"))
    return set(re.findall(r'(?:Counter|Gauge|Histogram|Summary)\(\s*"([a-z_:]+)"', text))


def _used_metrics(expr: str) -> set[str]:
    names = set(re.findall(r"([a-z_][a-z0-9_:]*)(?=\{|\[)", expr))
    return {re.sub(r"_(bucket|count|sum)$", "", n) for n in names}


def test_alerts_and_dashboard_name_metrics_that_exist():
    known = _metric_names() | EXPORTER_METRICS
    assert "gateway_ttft_seconds" in known and "vllm:inter_token_latency_seconds" in known
    [rule] = [r for r in build(K8S / "monitoring") if r["kind"] == "PrometheusRule"]
    exprs = [x["expr"] for g in rule["spec"]["groups"] for x in g["rules"]]
    [board] = [r for r in build(K8S / "monitoring") if r["kind"] == "ConfigMap"]
    dashboard = json.loads(board["data"]["tokenstream-dashboard.json"])
    exprs += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for expr in exprs:
        unknown = _used_metrics(expr) - known
        assert not unknown, f"{expr}: unknown metrics {unknown}"
    covered = " ".join(exprs)
    for concern in (
        "gateway_ttft_seconds",
        "inter_token_latency",
        "consumergroup_lag",
        '"429"',
        "ts.deadletter",
    ):
        assert concern in covered


@pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl not installed: the loader above is used alone"
)
@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_kustomize_builds_what_the_loader_reads(folder):
    out = subprocess.run(
        ["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    built = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out.stdout) if d}
    assert built == {(r["kind"], r["metadata"]["name"]) for r in build(folder)}


def _gateway(resources: list[dict]) -> dict:
    [gateway] = [r for r in resources if r["kind"] == "StatefulSet" and r["metadata"]["name"] == "gateway"]
    return gateway


def _downward(container: dict, env: str) -> str:
    [var] = [e for e in container["env"] if e["name"] == env]
    return var["valueFrom"]["fieldRef"]["fieldPath"]


@pytest.mark.parametrize("folder", [K8S / "base", K8S / "overlays" / "canary"], ids=lambda p: p.name)
def test_the_gateway_instance_count_is_its_replica_count(folder):
    """Index from the pod ordinal, count from spec.replicas (copied into an annotation): nothing
    hard-coded."""
    gateway = _gateway(build(folder))
    [container] = gateway["spec"]["template"]["spec"]["containers"]
    assert not any("instance" in a for a in container.get("args", []) + container.get("command", []))
    assert (
        _downward(container, "TOKENSTREAM_GATEWAY_INSTANCE_INDEX")
        == "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    count = re.fullmatch(
        r"metadata\.annotations\['([^']+)'\]", _downward(container, "TOKENSTREAM_GATEWAY_INSTANCE_COUNT")
    ).group(1)
    assert gateway["spec"]["template"]["metadata"]["annotations"][count] == str(gateway["spec"]["replicas"])
    # what the gateway makes of those variables: pod i of n owns the partitions p % n == i
    from gateway.config import GatewaySettings

    n = gateway["spec"]["replicas"]
    owned = [
        GatewaySettings(_env_file=None, instance_index=i, instance_count=n).owned_partitions(12)
        for i in range(n)
    ]
    assert sorted(p for share in owned for p in share) == list(range(12))
    with pytest.raises(ValueError, match="must be below the instance count"):  # a pod past the count
        GatewaySettings(_env_file=None, instance_index=n, instance_count=n)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_an_overlay_that_scales_the_gateway_scales_its_instance_count(tmp_path):
    overlay = tmp_path / "overlay"  # outside the repository: the base is referred to by a relative path
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [os.path.relpath(K8S / "base", overlay)],
                "replicas": [{"name": "gateway", "count": 5}],
                "replacements": base["replacements"],
            }
        )
    )
    out = subprocess.run(
        ["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    gateway = _gateway([d for d in yaml.safe_load_all(out.stdout) if d])
    assert gateway["spec"]["replicas"] == 5
    assert gateway["spec"]["template"]["metadata"]["annotations"]["tokenstream.io/gateway-instances"] == "5"
