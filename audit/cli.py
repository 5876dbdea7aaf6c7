"""`tokenstream audit request | conversation | range`: timelines and the gap check from the log.

Exit code 0: every audited request passed the gap check; 1: at least one failed; 2: nothing found.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from audit import ledger_cli
from audit.report import Exporter, Summary, timeline
from audit.run import Auditor, Options, Outcome
from common import id_key
from common.config import settings

app = typer.Typer(
    help="Replay requests and conversations from the topics, in order, with a gap check.",
    no_args_is_help=True,
)
console = Console()
errors = Console(stderr=True)


@app.callback()
def _start() -> None:
    """Every command reads request ids, which only the deployment's id key opens (schemas/ids.py)."""
    id_key.install()


Tenant = typer.Option(None, help="only this tenant's requests")
Export = typer.Option(None, help="also write every event as JSON Lines to this file")
Horizon = typer.Option(600.0, help="seconds after admission a request may still write events")


def parse_time(value: str) -> int:
    """ISO 8601 (UTC unless an offset is given), or a duration back from now: 90s, 15m, 2h, 7d."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if value and value[-1] in units and value[:-1].replace(".", "", 1).isdigit():
        return int((dt.datetime.now(dt.UTC).timestamp() - float(value[:-1]) * units[value[-1]]) * 1000)
    try:
        moment = dt.datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter(f"{value!r}: give ISO 8601 (2026-11-30T05:00:00) or 90s / 15m / 2h / 7d")
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return int(moment.timestamp() * 1000)


def _run(make, export: Path | None, tenant: str | None, horizon: float) -> Outcome:
    with contextlib.ExitStack() as stack:
        exporter = Exporter(stack.enter_context(export.open("wb"))) if export else None
        progress = stack.enter_context(
            Progress(
                TextColumn("scanning"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("records"),
                TimeRemainingColumn(),
                console=errors,
                transient=True,
                disable=not errors.is_terminal,
            )
        )
        task = progress.add_task("scan", total=None)
        opts = Options(
            settings().kafka_bootstrap,
            tenant=tenant,
            horizon_s=horizon,
            export=exporter,
            progress=lambda done, total: progress.update(task, completed=done, total=total),
        )

        async def go() -> Outcome:
            async with Auditor(opts) as auditor:
                return await make(auditor)

        outcome = asyncio.run(go())
        if exporter is not None:
            errors.print(f"exported {exporter.lines} event(s) to {export}", highlight=False)
    return outcome


def _finish(outcome: Outcome) -> None:
    console.print(
        f"{outcome.requests} request(s), {outcome.failed} failing the gap check, {outcome.open} open; "
        f"{outcome.records:,} records read"
        + (f", {outcome.undecodable} undecodable" if outcome.undecodable else ""),
        highlight=False,
    )
    raise typer.Exit(2 if not outcome.requests else 1 if outcome.failed else 0)


@app.command("request")
def request(
    request_id: str,
    since: str = typer.Option(None, help="for an id without its admission time"),
    export: Path = Export,
    horizon: float = Horizon,
) -> None:
    """Every event of one request across all topics, in order, and the text its client saw."""
    since_ms = parse_time(since) if since else None
    outcome = _run(lambda a: a.request(request_id, since_ms), export, None, horizon)
    for audit in outcome.audits:
        timeline(console, audit)
    _finish(outcome)


@app.command("conversation")
def conversation(
    conversation_id: str,
    tenant: str = Tenant,
    since: str = typer.Option(
        None, help="where to start (default: the conversation id's admission time when it is a request id)"
    ),
    until: str = typer.Option(None, help="where to stop looking for its requests"),
    export: Path = Export,
    horizon: float = Horizon,
) -> None:
    """Every request of a conversation, each as a timeline, in order."""
    since_ms = parse_time(since) if since else None
    until_ms = parse_time(until) if until else None
    try:
        outcome = _run(lambda a: a.conversation(conversation_id, since_ms, until_ms), export, tenant, horizon)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    for audit in sorted(outcome.audits, key=lambda a: a.first_ms):
        timeline(console, audit)
    _finish(outcome)


@app.command("range")
def range_(
    since: str = typer.Option(..., help="ISO 8601 time or a duration back from now (15m, 2h)"),
    until: str = typer.Option(None, help="default: now"),
    tenant: str = Tenant,
    timelines: bool = typer.Option(False, "--timeline", help="print every request's timeline"),
    export: Path = Export,
    horizon: float = Horizon,
) -> None:
    """Every request admitted between --since and --until: a summary (or timelines) and the gap check."""
    since_ms = parse_time(since)
    until_ms = parse_time(until) if until else int(dt.datetime.now(dt.UTC).timestamp() * 1000)
    summary = Summary()

    def keep(audit) -> None:
        if timelines:
            timeline(console, audit)
        summary.add(audit)

    def scan(auditor):
        auditor.timelines = timelines
        return auditor.range(since_ms, until_ms, keep)

    outcome = _run(scan, export, tenant, horizon)
    summary.print(console)
    _finish(outcome)


@app.command("rescreen")
def rescreen(
    policy: str = typer.Option(..., help="a policy name from the policies file (e.g. strict)"),
    since: str = typer.Option(..., help="ISO 8601 time or a duration back from now (15m, 2h, 7d)"),
    until: str = typer.Option(None, help="default: now"),
    tenant: str = Tenant,
    policies: Path = typer.Option(None, help="policies file (default safety_model/policies.json)"),
    horizon: float = Horizon,
) -> None:
    """Re-judge stored inputs and answers under another safety policy, into its own verdict topic."""
    from audit.rescreen import Rescreener, commit_progress, group_of
    from producers import start_producer
    from safety_model.classifier import SafetyClassifier
    from safety_model.policies import POLICIES_FILE, named_policy

    try:
        chosen = named_policy(policy, policies or POLICIES_FILE)
    except (KeyError, ValueError) as exc:
        raise typer.BadParameter(str(exc.args[0] if exc.args else exc)) from None
    since_ms = parse_time(since)
    until_ms = parse_time(until) if until else int(dt.datetime.now(dt.UTC).timestamp() * 1000)
    errors.print(f"loading the safety classifier under policy {policy} ({chosen.version})", highlight=False)
    classifier = SafetyClassifier.load(policy=chosen)
    bootstrap = settings().kafka_bootstrap
    holder = {}

    async def make(auditor):
        producer = await start_producer(bootstrap)
        try:
            screener = holder["screener"] = Rescreener(classifier, producer)
            outcome = await auditor.range(since_ms, until_ms, screener.add)
            await screener.flush()
            await commit_progress(auditor, bootstrap, policy)
            return outcome
        finally:
            await producer.stop()

    outcome = _run(make, None, tenant, horizon)
    report = holder["screener"].report
    table = Table(
        "stage",
        "judged",
        f"blocked under {report.policy_version}",
        "newly blocked",
        "newly allowed",
        title=f"rescreen of {report.requests} request(s) under {policy} ({report.policy_version})",
    )
    for stage, st in report.stages.items():
        table.add_row(
            stage,
            str(st.judged),
            str(st.blocked_now),
            str(sum(st.newly_blocked.values())),
            str(sum(st.newly_allowed.values())),
        )
    console.print(table)
    changes = Table("stage", "change", "category", "requests", "examples", title="what would change")
    for stage, st in report.stages.items():
        for change, counts in (("newly blocked", st.newly_blocked), ("newly allowed", st.newly_allowed)):
            for category, n in counts.most_common():
                examples = "\n".join(
                    f"{rid}: {text!r}" for rid, text in st.examples.get((change, category), [])
                )
                changes.add_row(stage, change, category, str(n), examples)
    console.print(changes)
    console.print(
        f"{report.written} verdict(s) written to ts.audit.rescreen.verdicts; offsets committed in group "
        f"{group_of(policy)}; {outcome.records:,} records read",
        highlight=False,
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())


ledger_cli.register(app, parse_time)
