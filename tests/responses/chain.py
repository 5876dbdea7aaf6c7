"""The Responses tests' chain, started once for the package (tests/responses/conftest.py): the three
processors, a SmolLM2 worker under its own model name, a tool processor and a gateway."""

from __future__ import annotations

import uuid

MODEL = f"smollm2-resp-{uuid.uuid4().hex[:6]}"


def worker_args() -> tuple[str, ...]:
    from gpu_workers.model_loader import smollm2_dir

    return ("worker", "--model", MODEL, "--model-path", str(smollm2_dir()))
