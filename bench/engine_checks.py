"""`tokenstream bench engine`'s check of its vLLM peer column against vLLM measuring itself.

`vllm-defaults` (vLLM's AsyncLLM at its defaults, streamed, requests at their arrival offsets) is the
peer of the headline ratio. In the same saturated run `vllm-offline` serves the same requests through
vLLM's own `LLM.generate` (its multiprocess engine core). Serving every request at once, streamed,
cannot be much slower than vLLM's offline batch API at the same defaults: a `vllm-defaults` column
below PLAUSIBLE x `vllm-offline`'s tokens/s measured something other than vLLM (a start-up inside the
timed window, a missing allocator, threads fighting for cores) and is reported as invalid: its figures
stay in the results with the reason, and no ratio is formed with it.
"""

from __future__ import annotations

PLAUSIBLE = 0.85  # vllm-defaults' tokens/s at least this share of vllm-offline's
CHECKED = {"vllm-defaults": "vllm-offline"}  # column -> the column it is checked against


def check_peers(results: dict) -> dict[str, str]:
    """Mark the columns of one mode's `results` that fail their check (`invalid`: why) and note the
    check on those that pass (`checked_against`). Returns {column: why} of the invalid ones."""
    invalid = {}
    for name, against in CHECKED.items():
        mine, ref = results.get(name, {}), results.get(against, {})
        a, b = mine.get("tokens_per_s"), ref.get("tokens_per_s")
        if not a:
            continue
        if not b:
            mine["checked_against"] = f"{against}: not run or skipped (unchecked)"
            continue
        share = a / b
        if share < PLAUSIBLE:
            why = (
                f"{a} tok/s is {share:.2f}x {against}'s {b} tok/s on the same requests, below the "
                f"plausible {PLAUSIBLE}x: not a measurement of vLLM"
            )
            mine["invalid"] = why
            invalid[name] = why
        else:
            mine["checked_against"] = f"{against}: {share:.2f}x its tokens/s (plausible from {PLAUSIBLE}x)"
    return invalid


def usable(results: dict, name: str) -> float | None:
    """The tokens/s of column `name` where it may enter a ratio: run, not skipped, not invalid."""
    r = results.get(name, {})
    return None if r.get("invalid") else r.get("tokens_per_s")
