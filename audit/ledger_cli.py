"""`tokenstream audit notarize | verify | export`: the tamper-evident ledger's commands."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from audit.signer import Signer
from common.config import settings

console = Console()


def register(app: typer.Typer, parse_time) -> None:
    """Add the ledger's commands to `app` (audit/cli.py); `parse_time` reads --since and --until."""

    def _range(since: str | None, until: str | None) -> tuple[int | None, int | None]:
        return (parse_time(since) if since else None, parse_time(until) if until else None)

    @app.command("notarize")
    def notarize(
        follow: bool = typer.Option(False, help="keep attesting new records as they come"),
        interval: float = typer.Option(5.0, help="seconds between checkpoints of a partition"),
        heartbeat: Path = typer.Option(None, help="a file touched each round (a liveness probe's)"),
    ) -> None:
        """Chain every audited topic's new records and write signed checkpoints to ts.audit.ledger."""
        from audit.notary import notarize as run
        from audit.notary import run_forever

        signer, bootstrap = Signer.load(), settings().kafka_bootstrap
        if follow:
            asyncio.run(run_forever(bootstrap, signer, interval, heartbeat, say=console.print))
        n = asyncio.run(run(bootstrap, signer, interval_s=interval, say=console.print))
        console.print(f"attested {n:,} records (key {signer.key_id})")

    @app.command("verify")
    def verify(
        since: str = typer.Option(None, help="checkpoints signed from (ISO 8601 or 15m, 2h, 7d)"),
        until: str = typer.Option(None, help="checkpoints signed until"),
        tenant: str = typer.Option(None, help="only the partitions holding this tenant's records"),
        topic: list[str] = typer.Option(None, help="only these topics (repeatable; default: every one)"),
        copy: list[str] = typer.Option(
            None, help="TOPIC=COPY: check a copy of TOPIC against its checkpoints (repeatable)"
        ),
    ) -> None:
        """Prove a range whole and in order, or name the first record changed, removed, reordered or
        inserted."""
        from audit.proof import prove

        since_ms, until_ms = _range(since, until)
        copies = dict(c.split("=", 1) for c in copy or [])
        proofs = asyncio.run(
            prove(
                settings().kafka_bootstrap,
                Signer.load().public_key,
                since_ms=since_ms,
                until_ms=until_ms,
                tenant=tenant,
                copies=copies,
                topics=set(topic) if topic else None,
            )
        )
        table = Table("topic", "partition", "checkpoints", "records", "verdict")
        for p in proofs:
            where = p.topic if p.read_from == p.topic else f"{p.topic} (copy {p.read_from})"
            table.add_row(
                where,
                str(p.partition),
                str(p.checkpoints),
                f"{p.attested:,}",
                f"[red]{p.problem}[/]" if p.problem else "[green]whole and in order[/]",
            )
        console.print(table)
        if not proofs:
            console.print("no checkpoints in that range (run `tokenstream audit notarize`)")
            raise typer.Exit(2)
        raise typer.Exit(1 if any(p.problem for p in proofs) else 0)

    @app.command("export")
    def export(
        out: Path = typer.Option(..., help="the bundle's folder"),
        since: str = typer.Option(None, help="checkpoints signed from"),
        until: str = typer.Option(None, help="checkpoints signed until"),
        tenant: str = typer.Option(None, help="only this tenant's records in full (others' as digests)"),
    ) -> None:
        """A bundle a third party verifies without tokenstream: `python verify.py BUNDLE`."""
        from audit.proof import export as write

        since_ms, until_ms = _range(since, until)
        manifest = asyncio.run(
            write(
                settings().kafka_bootstrap,
                Signer.load().public_key,
                out,
                since_ms=since_ms,
                until_ms=until_ms,
                tenant=tenant,
            )
        )
        console.print(
            f"{manifest['records']:,} records of {manifest['partitions']} partitions, "
            f"{manifest['requests']:,} requests -> {out} (verify: python {out / 'verify.py'} {out})"
        )
