"""The engine's own CPU kernels (`csrc/`: decode attention; a Llama layer's fused steps), built once per
machine.

PyTorch's SDPA on a CPU serves a decoding row's single query token poorly: each call runs its
flash kernel's blocking for a handful of query positions (about 400 us per call for 16 rows of
SmolLM2 in bf16 on 2 EPYC threads, 8 calls per layer and step), and rows of different lengths must
be padded or split into calls. vLLM's CPU build has its own C++ decode kernel for the same reason.
Ours is one small function compiled with PyTorch's own extension builder (`torch.utils.cpp_extension`,
ninja + the system C++ compiler) for the CPU it runs on (`-march=native`), registered as the op
`torch.ops.tokenstream.decode_attention`; the same library carries the fused element-wise steps
of a Llama layer (`csrc/fused_ops.cpp`, used by llama_step.py).

It is built by the set-up (`make setup` runs `python -m gpu_workers.cpu_kernels`), into
`~/.cache/tokenstream/kernels/<torch>-<cpu>-<source hash>/`; an engine loads it if built and
otherwise runs SDPA and transformers' forward (and says so once): an engine never stops to compile.
A worker's `TOKENSTREAM_WORKER_CPU_KERNELS=false` (an engine's `cpu_kernels=False`) runs without them,
for comparisons.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("tokenstream.worker")
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("decode_attention.cpp", "fused_ops.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / "dtypes.h"]  # part of the build's key, not compiled alone
NAME = "tokenstream_cpu_ops"
# -fopenmp: ATen's parallel_for is OpenMP in headers (serial without it); the library's libgomp.so.1
# is torch's own, already loaded (the same soname), so one thread pool serves both.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_loaded: bool | None = None


def _cpu() -> str:
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def build_dir() -> Path:
    """Where this machine's build lives: one per torch version, CPU and source text."""
    text = b"".join(p.read_bytes() for p in [*SOURCES, *HEADERS])
    key = hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:12]
    root = Path(os.environ.get("TOKENSTREAM_CACHE", Path.home() / ".cache" / "tokenstream"))
    return root / "kernels" / f"torch{torch.__version__.replace('+', '-')}-{_cpu()}-{key}"


def library() -> Path:
    return build_dir() / f"{NAME}.so"


def build(verbose: bool = False) -> Path:
    """Compile the kernels (about 20 s on 2 cores; needs ninja and a C++ compiler); returns the library."""
    from torch.utils import cpp_extension

    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    bin_dir = str(Path(sys.executable).parent)  # the venv's ninja, also when the venv is not activated
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    cpp_extension.load(
        NAME,
        [str(p) for p in SOURCES],
        extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
        verbose=verbose,
    )
    return library()


def available() -> bool:
    """Load the built kernels once per process; False (torch's own ops serve) when not built or not
    loadable."""
    global _loaded
    if _loaded is None:
        _loaded = False
        if not library().exists():
            log.warning(
                "CPU kernels not built (run `make setup` or `python -m gpu_workers.cpu_kernels`): "
                "decoding rows use SDPA, layers torch's ops, slower"
            )
        else:
            try:
                torch.ops.load_library(str(library()))
                _loaded = True
            except (OSError, RuntimeError) as e:
                log.warning("CPU kernels did not load (%s): decoding rows use SDPA, layers torch's ops", e)
    return _loaded


def main() -> int:
    """`python -m gpu_workers.cpu_kernels`: build this machine's kernels unless a loadable build is there."""
    if library().exists():
        try:
            torch.ops.load_library(str(library()))
            print(f"cpu kernels: built ({library()})")
            return 0
        except (OSError, RuntimeError) as e:  # a build cut short: start again
            print(f"cpu kernels: the build there does not load ({e}); building again")
            shutil.rmtree(build_dir(), ignore_errors=True)
    t0 = time.monotonic()
    print("cpu kernels: compiling the engine's CPU kernels for this CPU (about 20 s)", flush=True)
    try:
        path = build()
    except Exception as e:  # noqa: BLE001 - the engine runs without them; say why
        print(
            f"cpu kernels: not built ({type(e).__name__}: {e}); the engine will use torch's own ops",
            file=sys.stderr,
        )
        return 0
    print(f"cpu kernels: built in {time.monotonic() - t0:.0f} s ({path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
