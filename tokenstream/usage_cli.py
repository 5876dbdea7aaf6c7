"""`tokenstream usage`: a tenant's tokens from the log, reconciled with the gateway's live counters.

The log's side is audit/usage.py (transcripts, and cache hits' Completions). The live side is what
every gateway adds to Redis per key and UTC day when it sees a request's Completion (`keys usage`):
requests, prompt, completion, and as "cached" the tokens of answers served from the exact cache.
For each whole day of the range both are set side by side, field by field, and every difference
gets the reasons that account for it, counted where the log can count them.
"""

from __future__ import annotations

import asyncio
import time

import typer
from rich.console import Console
from rich.table import Table

from common.config import settings
from schemas import keys as K

console = Console()
FIELDS = (
    ("requests", "requests"),
    ("prompt", "prompt"),
    ("completion", "completion"),
    ("cache_hit_tokens", "cached"),
)


def usage(
    tenant: str = typer.Option(..., help="the tenant"),
    since: str = typer.Option(..., help="ISO 8601 (a day: 2026-12-01) or a duration back (7d)"),
    until: str = typer.Option(None, help="the end (default: now)"),
) -> None:
    """Tokens in, prefix-cached, out and cache hits per day, model and tier, from the log; then each day
    against the live counters, with what explains the differences."""
    from audit.cli import parse_time
    from audit.usage import by_day, from_log
    from tokenstream.keys import KeyStore

    since_ms = parse_time(since)
    until_ms = parse_time(until) if until else int(time.time() * 1000)
    tallies = asyncio.run(from_log(settings().kafka_bootstrap, tenant, since_ms, until_ms))
    table = Table(
        "day",
        "model",
        "tier",
        "requests",
        "prompt",
        "prefix-cached",
        "completion",
        "cache hits",
        "cache-hit tokens",
        title=f"{tenant}: usage on the log",
    )
    for (day, model, tier), t in sorted(tallies.items()):
        table.add_row(
            day,
            model,
            tier,
            *(
                f"{v:,}"
                for v in (
                    t.requests,
                    t.prompt,
                    t.prefix_cached,
                    t.completion,
                    t.cache_hits,
                    t.cache_hit_tokens,
                )
            ),
        )
    console.print(table)

    store = KeyStore(settings().redis_url)
    days = max(1, int((time.time() * 1000 - since_ms) // 86_400_000) + 1)
    live: dict[str, dict[str, int]] = {}
    for day, rec, counts in store.usage(days=min(days, 400)):
        if rec.tenant == tenant:
            row = live.setdefault(day, {})
            for name, value in counts.items():
                row[name] = row.get(name, 0) + value
    logged = by_day(tallies)
    first, last = _day(since_ms / 1000), _day(until_ms / 1000)
    check = Table(
        "day", "field", "log", "live", "difference", "explained by", title="reconciled with the live counters"
    )
    for day in sorted(set(logged) | {d for d in live if first <= d <= last}):
        t, counted = logged.get(day), live.get(day, {})
        unsettled = [] if t is None else _unsettled(store, sorted(t.request_ids))
        for attr, name in FIELDS:
            mine, theirs = (getattr(t, attr) if t else 0), counted.get(name, 0)
            missed = sum(t.shares[r][attr] for r in unsettled) if t else 0
            why = (
                "equal"
                if mine == theirs
                else "; ".join(_reasons(day, first, last, mine, theirs, unsettled, missed))
            )
            check.add_row(day, name, f"{mine:,}", f"{theirs:,}", f"{mine - theirs:+,}", why)
    console.print(check)


def _unsettled(store, request_ids: list[str]) -> list[str]:
    """The requests whose usage no gateway counted (no settled mark), in one Redis round trip."""
    pipe = store.r.pipeline(transaction=False)
    for rid in request_ids:
        pipe.exists(K.usage_settled(rid))
    return [rid for rid, counted in zip(request_ids, pipe.execute(), strict=True) if not counted]


def _day(seconds: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(seconds))


def _reasons(
    day: str, first: str, last: str, mine: int, theirs: int, unsettled: list[str], missed: int
) -> list[str]:
    out = []
    if mine > theirs and unsettled:
        whole = " (all of the difference)" if missed == mine - theirs else ""
        out.append(
            f"{len(unsettled)} request(s) on the log never counted live (Redis away at their completion, "
            f"or counted by no gateway), {missed:+,}{whole}: {', '.join(sorted(unsettled)[:3])}"
        )
    if day in (first, last) and (mine < theirs or missed != mine - theirs):
        out.append("the range cuts this day, the live counters hold all of it")
    if mine > theirs and not unsettled and day not in (first, last):
        out.append("the settled marks of this day's requests have expired (kept a day): not countable here")
    if theirs > mine:
        out.append(
            "counted live, not on the log: answers whose transcript is not written yet (the conversation "
            "processor's lag), or cache hits older than ts.tokens' one day"
        )
    return out or ["unexplained"]
