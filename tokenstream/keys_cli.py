"""`tokenstream keys create | list | revoke | usage`: API keys and their daily usage, as tables."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from common.config import settings
from schemas import keys as K
from tokenstream.keys import KeyStore

app = typer.Typer(help="API keys: tenant, tier, limits; stored hashed in Redis.", no_args_is_help=True)
console = Console()


def _store() -> KeyStore:
    return KeyStore(settings().redis_url)


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M") if ts else "-"


@app.command("create")
def create(
    tenant: str = typer.Option(..., help="the tenant the key acts for"),
    tier: str = typer.Option("free", help="/".join(K.TIERS) + ": priority at the workers, routing tier"),
    name: str = typer.Option("", help="a label for `keys list`"),
    rpm: int = typer.Option(0, help="requests per minute for this key (0: unlimited)"),
    tpm: int = typer.Option(0, help="tokens per minute for this key (0: unlimited)"),
    tenant_rpm: int = typer.Option(0, help="requests per minute shared by the tenant's keys (0: unlimited)"),
    tenant_tpm: int = typer.Option(0, help="tokens per minute shared by the tenant's keys (0: unlimited)"),
    max_streams: int = typer.Option(
        0, help="open requests at once across every gateway (0: the tier's default, -1: no limit)"
    ),
    expires: str = typer.Option(None, help="30d, 12h, 90m from now, or an ISO date (default: never)"),
    admin: bool = typer.Option(False, help="may also read /metrics"),
    exact_cache: bool = typer.Option(True, help="serve deterministic requests from the exact cache"),
    semantic_cache: bool = typer.Option(False, help="opt in to the semantic cache"),
) -> None:
    """Create a key and print it once (only its sha256 is stored)."""
    try:
        secret, rec = _store().create(
            tenant,
            tier=tier,
            name=name,
            rpm=rpm,
            tpm=tpm,
            tenant_rpm=tenant_rpm,
            tenant_tpm=tenant_tpm,
            max_streams=max_streams,
            expires=expires,
            admin=admin,
            exact_cache=exact_cache,
            semantic_cache=semantic_cache,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    home = f", at home in region {rec.region}" if rec.region else ""
    console.print(
        f"key {rec.key_id} for tenant [bold]{rec.tenant}[/] ({rec.tier}{home}); shown only now:",
        highlight=False,
    )
    print(secret)


@app.command("list")
def list_keys() -> None:
    """Every key: id, tenant, tier, limits, state."""
    table = Table(
        "key id",
        "tenant",
        "tier",
        "name",
        "rpm",
        "tpm",
        "tenant rpm/tpm",
        "streams",
        "caches",
        "region",
        "created",
        "expires",
        "state",
    )
    for _, rec in _store().all():
        state = rec.problem() or "active"
        colour = {"active": "green", "revoked": "red", "expired": "yellow"}[state]
        caches = ",".join(n for n, on in (("exact", rec.exact_cache), ("semantic", rec.semantic_cache)) if on)
        shared = f"{rec.tenant_rpm or '∞'}/{rec.tenant_tpm or '∞'}"
        table.add_row(
            rec.key_id,
            rec.tenant,
            rec.tier + (" admin" if rec.admin else ""),
            rec.name or "-",
            str(rec.rpm or "∞"),
            str(rec.tpm or "∞"),
            shared,
            {0: "tier", -1: "∞"}.get(rec.max_streams, str(rec.max_streams)),
            caches or "-",
            rec.region or "-",
            _when(rec.created_at),
            _when(rec.expires_at),
            f"[{colour}]{state}[/]",
        )
    console.print(table)


@app.command("revoke")
def revoke(key: str = typer.Argument(..., help="the key id from `keys list` (or the key itself)")) -> None:
    """Revoke a key: every request with it gets 401 from now on."""
    rec = _store().revoke(key)
    if rec is None:
        console.print(f"[red]no key {key!r}[/]")
        raise typer.Exit(1)
    console.print(f"revoked {rec.key_id} (tenant {rec.tenant})", highlight=False)


@app.command("usage")
def usage(days: int = typer.Option(7, min=1, max=90, help="how many days back")) -> None:
    """Tokens per key per UTC day: prompt, cached (served from a cache), completion, requests."""
    table = Table("day", "key id", "tenant", "requests", "prompt", "cached", "completion", "total")
    for day, rec, c in _store().usage(days):
        prompt, cached, completion = c.get("prompt", 0), c.get("cached", 0), c.get("completion", 0)
        table.add_row(
            day,
            rec.key_id,
            rec.tenant,
            f"{c.get('requests', 0):,}",
            f"{prompt:,}",
            f"{cached:,}",
            f"{completion:,}",
            f"{prompt + completion:,}",
        )
    console.print(table)


def local_key(path: Path) -> str:
    """The local key of `make run`: reused while it is valid in Redis, else created (and saved 0600)."""
    store = _store()
    if path.exists():
        secret = path.read_text().strip()
        rec = store.get(secret)
        if rec is not None and rec.problem() is None:
            return secret
    secret, _ = store.create("local", tier="paid", name="make run", admin=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(secret + "\n")
    return secret
