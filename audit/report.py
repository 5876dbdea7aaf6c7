"""Rendering audits: a timeline table per request, the client's text, a summary, JSON Lines export."""

from __future__ import annotations

import datetime as dt
from typing import IO

import msgspec
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from audit.fold import Audit

SUMMARY_ROWS = 200  # rows a range summary shows; the rest are counted, never held


def stamp(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def verdict(audit: Audit) -> str:
    if audit.erased:
        return f"[magenta]erased[/] ({audit.erased} record(s): content destroyed by `tokenstream erase`)"
    problems = audit.problems(open_ok=audit.open_ok)
    if problems:
        return "[red]FAIL[/] " + "; ".join(problems)
    return "[yellow]open[/]" if not audit.completed and audit.open_ok else "[green]ok[/]"


def timeline(console: Console, audit: Audit) -> None:
    table = Table(
        "time (UTC)",
        "+ms",
        "topic",
        "partition@offset",
        "event",
        "detail",
        title=f"request {audit.request_id}",
        caption=f"conversation {audit.conversation_id or '-'}"
        f" · tenant {audit.tenant or '-'} · model {audit.model or '-'} · {audit.events} events",
        expand=False,
    )
    for row in audit.rows:
        table.add_row(
            stamp(row.timestamp),
            str(row.timestamp - audit.first_ms),
            row.topic,
            row.where,
            row.kind,
            row.detail,
        )
    console.print(table)
    hops(console, audit)
    extra = f" · {audit.withheld} chunk(s) generated after the stream ended" if audit.withheld else ""
    extra += f" · {audit.duplicates} duplicate chunk(s) dropped" if audit.duplicates else ""
    console.print(
        Panel(
            "(erased)" if audit.erased else audit.text or "(nothing)",
            title="the text the client saw",
            subtitle=f"finish: {audit.finish_reason or '-'}{extra}",
            title_align="left",
        )
    )
    console.print("gap check: " + verdict(audit), highlight=False)


def hops(console: Console, audit: Audit) -> None:
    """The time spent in each hop (audit.hops), from admission to the Completion."""
    spent = audit.hops
    if not spent:
        return
    total = sum(s for _, s in spent)
    table = Table(
        "", *(name for name, _ in spent), "total", title="time in each hop (ms)", title_justify="left"
    )
    table.add_row("ms", *(f"{s * 1000:.0f}" for _, s in spent), f"{total * 1000:.0f}")
    if total > 0:
        table.add_row("share", *(f"{s / total:.0%}" for _, s in spent), "100%")
    console.print(table)


class Summary:
    """A range's one-line-per-request table, bounded to SUMMARY_ROWS; failures always listed."""

    def __init__(self) -> None:
        self.table = Table(
            "admitted (UTC)", "request", "tenant", "finish", "chunks", "check", title="requests in the range"
        )
        self.rows = 0
        self.hidden = 0

    def add(self, audit: Audit) -> None:
        failing = bool(audit.problems(open_ok=audit.open_ok))
        if self.rows >= SUMMARY_ROWS and not failing:
            self.hidden += 1
            return
        self.rows += 1
        self.table.add_row(
            stamp(audit.first_ms),
            audit.request_id,
            audit.tenant,
            audit.finish_reason or "-",
            str(len(audit.seqs)),
            verdict(audit),
        )

    def print(self, console: Console) -> None:
        if self.hidden:
            self.table.caption = f"{self.hidden} more passing request(s) not listed"
        console.print(self.table)


class Exporter:
    """JSON Lines, one record per event: topic, partition, offset, timestamp and the decoded event."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.encoder = msgspec.json.Encoder()
        self.lines = 0

    def __call__(self, record: dict) -> None:
        self.out.write(self.encoder.encode(record) + b"\n")
        self.lines += 1
