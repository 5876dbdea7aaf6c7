"""The environment every benchmark's child process runs with: offline model files, this checkout first."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def py_env(engine_path: Path | None = None) -> dict:
    """os.environ, offline for Hugging Face, with `engine_path` (a baseline checkout) and this checkout first."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    paths = [str(engine_path)] if engine_path else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env
