"""Assistant presets (like custom GPTs): a named system prompt with model and sampling settings,
and knowledge: tools in the Responses API's shapes (`file_search` over named vector stores,
`code_interpreter`, `web_fetch`), which `/v1/responses` gives the model when a client chooses the
assistant, without the client sending them. A preset's vector store ids are searched within the
calling tenant's files (the tool's tenant is always the request's).

Configuration shared by the gateway (which answers 404 for an unknown preset before anything is
queued) and the conversation processor (which applies them); the file is TOKENSTREAM_PRESETS_FILE.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import msgspec


class Preset(msgspec.Struct, kw_only=True):
    system: str
    model: str | None = None
    sampling: dict[str, object] = msgspec.field(default_factory=dict)
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)  # Responses API tool objects


@lru_cache(maxsize=4)
def load_presets(path: Path) -> dict[str, Preset]:
    return msgspec.convert(json.loads(Path(path).read_text()), dict[str, Preset])


def presets() -> dict[str, Preset]:
    """The configured presets (read once per process)."""
    from common.config import settings

    return load_presets(settings().presets_file)
