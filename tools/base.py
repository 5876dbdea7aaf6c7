"""The one interface every tool module implements, and the registry that finds them.

A tool is a module `tools/builtin/<name>.py` exposing `TOOL`, an object with a `name` and

    async def run(self, call: ToolCall, args: dict) -> Outcome

and, optionally, `def warm_up(self) -> None` (blocking; run once in a thread before the processor
serves, e.g. to load a model). Adding a tool is adding that one file.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Protocol

from schemas import ToolCall


class ToolError(Exception):
    """A call the tool refuses or cannot complete; its message goes back to the model."""


class ToolUnavailable(ToolError):
    """A dependency of the tool is away (Weaviate for file_search): the call fails at once with this
    message and its result says which dependency (`meta["unavailable"]`), so a caller may try again."""

    def __init__(self, message: str, dependency: str) -> None:
        super().__init__(message)
        self.dependency = dependency


@dataclass
class Outcome:
    output: str
    ok: bool = True
    error: str | None = None
    meta: dict[str, str] = field(default_factory=dict)


class Tool(Protocol):
    name: str

    async def run(self, call: ToolCall, args: dict) -> Outcome: ...


def builtin_tools() -> dict[str, Tool]:
    """Every `TOOL` in tools/builtin, by name."""
    import tools.builtin as package

    found: dict[str, Tool] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"tools.builtin.{info.name}")
        tool = getattr(module, "TOOL", None)
        if tool is not None:
            found[tool.name] = tool
    return found
