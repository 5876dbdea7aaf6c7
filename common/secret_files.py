"""Secrets the local stack makes for itself (broker passwords, the id key): one file each, mode 0600,
in a folder of mode 0700, made once by whichever process needs it first."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def ensure(path: Path, make: Callable[[], str]) -> str:
    """The secret in `path`, written first from `make()` if the file does not exist yet."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(make())
    return path.read_text().strip()


def write(path: Path, text: str) -> None:
    """Replace `path` with `text`, readable by this user alone (secrets made from others, each start)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
