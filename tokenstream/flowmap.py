"""`tokenstream topics describe --flow`: the way of a request, read from the topic registry."""

from __future__ import annotations

from rich.table import Table

from topics.registry import TopicSpec


def flow_table(specs: list[TopicSpec]) -> Table:
    """One row per topic in the order a request meets them: who writes, who reads and how."""
    table = Table("#", "topic", "key / placement", "events", "written by", "read by (group: commit rule)",
                  title="The way of a request", show_lines=True)
    for n, spec in enumerate(specs, 1):
        writers = "\n".join(f"[bold]{w.role}[/]: {w.when}" for w in spec.writers) or "-"
        readers = "\n".join(
            f"[bold]{r.role}[/] [cyan]{r.group or 'group-less'}[/]: {r.commit}" for r in spec.readers) or "-"
        placement = spec.key if spec.placement == "key" else f"{spec.key}\n(partition: {spec.placement})"
        table.add_row(str(n), spec.name, placement, ", ".join(e.__name__ for e in spec.events), writers, readers)
    return table
