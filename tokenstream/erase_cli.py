"""`tokenstream erase --tenant T [--conversation C]`: crypto-shredding (tokenstream/erase.py says how)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

console = Console()


def erase_command(
    tenant: str = typer.Option(..., help="the tenant whose content is erased"),
    conversation: str = typer.Option(None, help="only this conversation of the tenant"),
    yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation"),
) -> None:
    """Destroy the keys a tenant's (or one conversation's) content was sealed with, and delete its records
    from the durable store, the caches and the vector index: from then on nothing of it can be read."""
    from tokenstream.erase import erase

    what = (
        f"conversation {conversation} of tenant {tenant}"
        if conversation
        else f"everything of tenant {tenant}"
    )
    if not yes and not typer.confirm(f"Erase {what}? This cannot be undone"):
        raise typer.Exit(1)
    done = erase(tenant, conversation)
    table = Table("what", "erased", title=f"erased: {what}")
    table.add_row("sealing keys destroyed", str(len(done.keys)))
    for kind, n in sorted(done.records.items()):
        table.add_row(f"durable store: {kind}", str(n))
    for kind, n in sorted(done.weaviate.items()):
        table.add_row(f"Weaviate: {kind}", str(n))
    table.add_row("durable store files rewritten", "yes" if done.rewritten else "no (it keeps no files)")
    console.print(table)
    console.print("Running roles stop opening the erased content within 10 s (the keys they hold expire).")
