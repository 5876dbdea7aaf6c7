"""`tokenstream topics describe --flow`: the way of a request, read from the topic registry."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from topics.registry import Reader, TopicSpec, Writer


def _writers(writers: tuple[Writer, ...]) -> str:
    """One line per distinct `when`, naming every role that writes then (ts.deadletter: five roles,
    one rule)."""
    by_when: dict[str, list[str]] = {}
    for w in writers:
        by_when.setdefault(w.when, []).append(w.role.title)
    return "\n".join(
        f"[bold]{escape(', '.join(roles))}[/]: {escape(when)}" for when, roles in by_when.items()
    )


def _reader(r: Reader) -> str:
    purpose = f" ({escape(r.purpose)})" if r.purpose else ""
    group = escape(r.group or "group-less")
    return f"[bold]{escape(r.role.title)}[/]{purpose} [cyan]{group}[/]: {escape(r.commit)}"


def flow_table(specs: list[TopicSpec]) -> Table:
    """One row per topic in the order a request meets them: who writes, who reads and how."""
    table = Table(
        "#",
        "topic",
        "key / placement",
        "events",
        "written by",
        "read by (group: commit rule)",
        title="The way of a request",
        show_lines=True,
    )
    for n, spec in enumerate(specs, 1):
        writers = _writers(spec.writers) or "-"
        readers = "\n".join(_reader(r) for r in spec.readers) or "-"
        placement = spec.key if spec.placement == "key" else f"{spec.key}\n(partition: {spec.placement})"
        table.add_row(
            str(n), spec.name, placement, ", ".join(e.__name__ for e in spec.events), writers, readers
        )
    return table
