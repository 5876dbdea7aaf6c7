"""Test fixtures: one real stack (Kafka, Redis, Weaviate) per test session on free loopback ports.

Every test that needs a broker gets the real one; its data lives in a temporary folder
and everything is stopped at the end of the session.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from tokenstream.stack import Stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory):
    root: Path = tmp_path_factory.mktemp("stack")
    stack = Stack.ephemeral(root)
    old = {k: os.environ.get(k) for k in stack.environment()}
    try:
        stack.up(say=lambda m: print(m))
        os.environ.update(stack.environment())
        from tokenstream.config import settings

        settings.cache_clear()
        yield stack
    finally:
        stack.down(say=lambda m: print(m))
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def bootstrap(stack: Stack) -> str:
    return stack.kafka.address


@pytest.fixture
def unique() -> str:
    """A fresh suffix for topic and group names, so tests never see each other's events."""
    return uuid.uuid4().hex[:8]
