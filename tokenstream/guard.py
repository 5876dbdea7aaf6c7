"""`tokenstream guard <role command>`: run one role process under a guard that, when the process
dies, takes it out of its consumer groups at once, then exits with its status.

Kubernetes restarts a container whose process died, but the group coordinator learns of the death
only when the process's session ends (3 s), and until then its partitions stand still although a
standby of the role is running. The guard is the container's first process: it starts the role as
its child, passes SIGTERM and SIGINT on (a clean stop leaves the groups by itself), and when the
child exits, whatever the cause, sends the LeaveGroup the child could not (producers/membership.py,
`evict`, with the role's own broker user) and exits with the child's status, so the kubelet restarts
the container as before. A lost node is still noticed by the session alone.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import typer

from common.config import settings


def guard(ctx: typer.Context) -> None:
    """Run `tokenstream <role command>` (e.g. `guard processor conversation`); when it exits, take it
    out of its consumer groups at once and exit with its status."""
    from producers.membership import evict_and_say

    if not ctx.args:
        raise typer.BadParameter("name the role command to run, e.g. `tokenstream guard processor safety`")
    # a session of its own: a terminal's Ctrl-C reaches it once, through the guard
    child = subprocess.Popen([sys.executable, "-m", "tokenstream.cli", *ctx.args], start_new_session=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda received, _frame: child.send_signal(received))
    status = child.wait()
    asyncio.run(
        evict_and_say(
            settings().kafka_bootstrap,
            child.pid,
            f"guard: pid {child.pid} (exit {status})",
            lambda said: print(said, flush=True),
        )
    )
    raise typer.Exit(status if status >= 0 else 128 - status)
