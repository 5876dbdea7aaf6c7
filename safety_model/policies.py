"""Named safety policies, for re-screening history under another policy (`tokenstream audit rescreen`).

policies.json maps a name to a policy version and thresholds (a default `threshold`, per-category
`thresholds`, optionally `categories`); "live" is the policy the safety processor runs now, from
the TOKENSTREAM_SAFETY_* settings.
"""

from __future__ import annotations

import json
from pathlib import Path

from safety_model.config import Policy, safety_settings

POLICIES_FILE = Path(__file__).resolve().parent / "policies.json"


def named_policy(name: str, path: Path = POLICIES_FILE) -> Policy:
    catalogue = json.loads(Path(path).read_text())
    if name not in catalogue:
        raise KeyError(f"no safety policy {name!r} in {path} (known: {', '.join(sorted(catalogue))})")
    live = Policy.from_settings(safety_settings())
    entry = catalogue[name]
    if name == "live" or set(entry) <= {"note"}:
        return live
    categories = tuple(entry.get("categories", live.categories))
    default = float(entry.get("threshold", live.default_threshold))
    thresholds = {c: float(entry.get("thresholds", {}).get(c, default)) for c in categories}
    unknown = set(entry.get("thresholds", {})) - set(categories)
    if unknown:
        raise ValueError(f"policy {name!r}: thresholds for unknown categories {sorted(unknown)}")
    return Policy(
        version=str(entry.get("version", name)),
        thresholds=thresholds,
        default_threshold=default,
        categories=categories,
    )
