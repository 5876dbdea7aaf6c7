"""The environment every benchmark's child process runs with: offline model files, this checkout first;
and the throwaway broker and keyring store a benchmark without the whole stack runs against."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def py_env(engine_path: Path | None = None) -> dict:
    """os.environ, offline for Hugging Face, with `engine_path` (a baseline checkout) and this checkout
    first."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    paths = [str(engine_path)] if engine_path else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@contextmanager
def broker_and_keyring(prefix: str, say: Callable[[str], None], sealing: bool = True) -> Iterator:
    """A throwaway Kafka and durable Redis (the keyring events are sealed with, common/sealing.py) on free
    ports, this process pointed at both (and its children, through os.environ); yields the stack."""
    from tokenstream.stack import Stack
    from tokenstream.stack.stack import use

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        stack = Stack.ephemeral(Path(tmp))
        services = (stack.kafka, stack.redis)
        try:
            for service in services:
                service.start(say)
            use(
                {
                    **stack.kafka.environment(),
                    "TOKENSTREAM_REDIS_URL": stack.redis.address,
                    "TOKENSTREAM_SEALING": "true" if sealing else "false",
                }
            )
            yield stack
        finally:
            for service in services:
                service.stop(lambda m: None)
