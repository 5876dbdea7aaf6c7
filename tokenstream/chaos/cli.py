"""`tokenstream chaos`: run the fault drill and print its report (exit 1 when a guarantee broke)."""

from __future__ import annotations

from pathlib import Path

import typer


def chaos(
    minutes: float = typer.Option(10.0, help="how long the load and the faults last"),
    clients: int = typer.Option(3, help="concurrent streaming users"),
    kills_per_role: int = typer.Option(
        20, help="kill -9 faults of each role (gateway, each processor, worker)"
    ),
    roles: str = typer.Option(
        "conversation,safety,router,worker,gateway",
        help="the roles killed, in turn (comma-separated): a drill of one role's takeover",
    ),
    broker_restarts: int = typer.Option(
        3,
        help="broker faults: a restart of the one broker; on a cluster, in "
        "turn, kill -9 of a node, of the active controller, a rolling restart",
    ),
    brokers: int = typer.Option(1, min=1, max=9, help="Kafka nodes of the drill's stack (3: a cluster)"),
    stalls: int = typer.Option(3, help="clients that stop reading for a while mid-answer"),
    freezes: int = typer.Option(
        0,
        help="processes of the roles stopped (SIGSTOP) for 6 s, twice their "
        "session, then let go on: expelled members that wake up",
    ),
    max_tokens: int = typer.Option(24, help="tokens per answer"),
    report_file: Path = typer.Option(None, "--report", help="also write the report as JSON here"),
) -> None:
    """Kill -9 every role in turn, restart the broker, stall clients and (--freezes) stop processes a while
    under load, exactly as many of each as asked, spread evenly over the run; then prove that no token was
    lost or repeated, every group drained and nothing is left generating."""
    import asyncio
    import json

    from tokenstream.chaos.drill import ROLES, plan, run

    chosen = tuple(r.strip() for r in roles.split(",") if r.strip())
    if not chosen or set(chosen) - set(ROLES):
        raise typer.BadParameter(f"roles among {', '.join(ROLES)}", param_hint="--roles")
    report = asyncio.run(
        run(
            minutes,
            clients=clients,
            max_tokens=max_tokens,
            schedule=plan(kills_per_role, broker_restarts, stalls, chosen, freezes),
            brokers=brokers,
            roles=chosen,
            say=lambda m: print(m, flush=True),
        )
    )
    print_report(report)
    if report_file is not None:
        report_file.write_text(json.dumps(as_dict(report), indent=2) + "\n")
    raise typer.Exit(0 if report.ok else 1)


def as_dict(report) -> dict:
    v = report.verdict
    recoveries = [f.recovery_s for f in report.faults if f.recovery_s is not None]
    first_tokens = [f.first_token_s for f in report.faults if f.first_token_s is not None]
    kill_stalls = [f.stall_s for f in report.faults if f.kind == "kill -9" and f.stall_s is not None]
    return {
        "seconds": round(report.seconds, 1),
        "ok": report.ok,
        "fault_every_s": round(report.every_s, 2),
        "faults": [
            {
                "kind": f.kind,
                "target": f.target,
                "recovery_s": f.recovery_s and round(f.recovery_s, 2),
                "first_token_s": f.first_token_s and round(f.first_token_s, 2),
                "stall_s": _rounded(f.stall_s),
            }
            for f in report.faults
        ],
        "requests": {
            "admitted": v.admitted,
            "completed": v.completed,
            "refused": report.refused,
            "unacknowledged": report.unacknowledged,
            "resumes": report.resumes,
            "interrupted": v.interrupted,
        },
        "lost": v.lost,
        "differs": v.differs,
        "log_inconsistent": v.inconsistent,
        "unfinished": v.unfinished,
        "duplicated": v.duplicates,
        "worst_recovery_s": round(max(recoveries), 2) if recoveries else None,
        "worst_first_token_s": round(max(first_tokens), 2) if first_tokens else None,
        "worst_kill_stall_s": _rounded(max(kill_stalls)) if kill_stalls else None,
        "baseline_stall_s": _rounded(report.baseline_stall_s),
        "baseline_answer_s": _rounded(report.baseline_answer_s),
        "lag_left": report.lag_left,
        "running_left": report.running_left,
        "logs": report.logs,
    }


def _rounded(seconds: float | None) -> float | str | None:
    if seconds is None:
        return None
    return "never" if seconds == float("inf") else round(seconds, 2)


def print_report(report) -> None:
    from collections import Counter

    from rich.console import Console
    from rich.table import Table

    d = as_dict(report)
    kinds = Counter(f["kind"] for f in d["faults"])
    table = Table("measure", "value", title="chaos drill")
    rows = [
        ("duration", f"{d['seconds']:.0f} s"),
        (
            "faults",
            (", ".join(f"{n} {k}" for k, n in kinds.items()) or "none")
            + f" (one every {d['fault_every_s']:.1f} s)",
        ),
        ("requests admitted / completed", f"{d['requests']['admitted']} / {d['requests']['completed']}"),
        ("refused at admission (429/503)", str(d["requests"]["refused"])),
        ("dropped before an id arrived", str(d["requests"]["unacknowledged"])),
        ("interrupted (error event or drop), resumed", str(d["requests"]["interrupted"])),
        ("resumes", str(d["requests"]["resumes"])),
        ("lost (client text short of the log's)", str(len(d["lost"]))),
        ("differs (client text not the log's)", str(len(d["differs"]))),
        ("log inconsistent (not one answer)", str(len(d["log_inconsistent"]))),
        ("unfinished within the deadline", str(len(d["unfinished"]))),
        ("duplicated", str(len(d["duplicated"]))),
        ("worst recovery (a request sent after the fault answered in full)", f"{d['worst_recovery_s']} s"),
        ("worst recovery to a first token (of a request sent after it)", f"{d['worst_first_token_s']} s"),
        (
            "worst stall after a kill (next token of a stream, first of a new request)",
            f"{d['worst_kill_stall_s']} s",
        ),
        ("worst stall without a fault (before the first)", f"{d['baseline_stall_s']} s"),
        ("longest whole answer without a fault (before the first)", f"{d['baseline_answer_s']} s"),
        ("lag left", ", ".join(f"{g}={n}" for g, n in d["lag_left"].items() if n) or "0"),
        ("still generating", f"{d['running_left']:g}"),
        ("verdict", "PASS" if d["ok"] else "FAIL"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console(width=120).print(table)
    faults = Table("fault", "target", "stall s", "first token s", "recovery s", title="faults")
    for f in d["faults"]:
        faults.add_row(
            f["kind"], f["target"], *(str(f[k]) for k in ("stall_s", "first_token_s", "recovery_s"))
        )
    Console(width=120).print(faults)
    print(f"logs: {d['logs']}")
