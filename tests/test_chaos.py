"""The fault drill in its reduced form (`tokenstream chaos` runs it for longer): two processes of every
role and two gateways under streaming load, on a stack of its own (its broker is restarted); each role
is killed -9 once and the broker restarted once.
Every admitted request must end for its client with exactly the text ts.tokens holds (a prefix of it
whenever its stream broke off), the log must hold one consistent answer per request, every group
must drain, and nothing may be left generating."""

from __future__ import annotations

import pytest

from tokenstream.chaos.brokers import CLUSTER_FAULTS
from tokenstream.chaos.cli import as_dict
from tokenstream.chaos.drill import run

pytestmark = pytest.mark.slow


def held(summary: dict) -> None:
    """The drill's guarantee: every request answered once and whole, the groups drained, every fault left."""
    assert summary["requests"]["admitted"] >= 10, summary
    assert summary["lost"] == [] and summary["duplicated"] == [] and summary["unfinished"] == [], summary
    assert summary["differs"] == [] and summary["log_inconsistent"] == [], summary
    assert not any(summary["lag_left"].values()), summary
    assert summary["running_left"] == 0, summary
    assert all(f["recovery_s"] is not None for f in summary["faults"]), summary


# make test-all: two minutes of ten processes under load on two cores, over make test's budget; make
# test keeps kill -9 of the conversation and tool processors (test_processors, test_responses) and
# `tokenstream chaos` runs this drill against a deployment
@pytest.mark.heavy
@pytest.mark.timeout(1200)  # start-up of ten processes, 70 s of load, then the checks
async def test_kill_each_role_and_restart_the_broker_under_load(tmp_path):
    report = await run(
        1.2, clients=2, every_s=11, max_tokens=16, kinds=("kill",) * 5 + ("broker",), root=tmp_path
    )
    summary = as_dict(report)
    assert [f["kind"] for f in summary["faults"]] == ["kill -9"] * 5 + ["broker restart"], summary
    held(summary)


@pytest.mark.heavy
@pytest.mark.timeout(1500)  # ten processes and three Kafka nodes; a rolling restart alone takes a minute
async def test_a_three_node_cluster_under_load_loses_nothing_to_a_node_the_controller_or_a_rolling_restart(
    tmp_path,
):
    """`tokenstream chaos --brokers 3` reduced: the cluster's three broker faults (kill -9 of a node, of the
    active controller, a rolling restart of all three) under streaming load, and nothing else."""
    report = await run(2.0, clients=2, max_tokens=16, schedule=("broker",) * 3, brokers=3, root=tmp_path)
    summary = as_dict(report)
    assert [f["kind"] for f in summary["faults"]] == list(CLUSTER_FAULTS), summary
    held(summary)


@pytest.mark.heavy
@pytest.mark.timeout(1200)  # start-up of ten processes, a minute of load, then the checks
async def test_a_frozen_worker_and_processor_are_replaced_and_lose_and_double_nothing_when_they_wake(
    tmp_path,
):
    """`tokenstream chaos --freezes` reduced: a worker and the conversation processor stopped (SIGSTOP)
    for twice their session while their supervisor sees them alive: the broker expels them, the others
    take over, and what they do when they wake up (a worker mid-answer) writes nothing twice."""
    report = await run(
        1.2,
        clients=2,
        max_tokens=16,
        schedule=("freeze",) * 2,
        roles=("worker", "conversation"),
        root=tmp_path,
    )
    summary = as_dict(report)
    assert [(f["kind"], f["target"].split("-")[0]) for f in summary["faults"]] == [
        ("freeze", "worker"),
        ("freeze", "conversation"),
    ], summary
    held(summary)
