"""The classifier's turns (processors/safety/turns.py): one call at a time, an input before the output
windows waiting, output batches in pieces. The classifier is a stand-in that records its calls and
blocks until released (a unit test: the model's own judgements are tested in test_safety_classifier)."""

from __future__ import annotations

import asyncio
import threading

from processors.safety.turns import Turns
from safety_model.classifier import Judgement


class Recorder:
    """A blocking judge: each call waits for its release, and records its texts."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.started = threading.Semaphore(0)
        self.release = threading.Semaphore(0)

    def __call__(self, texts: list[str]) -> list[Judgement]:
        self.calls.append(list(texts))
        self.started.release()
        self.release.acquire()
        return [Judgement(False, [], {"t": float(len(t))}, "p") for t in texts]


async def started(judge: Recorder) -> None:
    assert await asyncio.to_thread(judge.started.acquire, True, 10), "no call started"


async def test_an_input_goes_between_the_pieces_of_an_output_batch_and_before_waiting_outputs():
    judge = Recorder()
    turns = Turns(judge, piece=2)
    batch = asyncio.create_task(turns.outputs(["o1", "o2", "o3", "o4", "o5"]))
    await started(judge)  # the batch's first piece is in the classifier
    later_outputs = asyncio.create_task(turns.outputs(["p1"]))
    await asyncio.sleep(0)  # queued behind the piece
    first_input = asyncio.create_task(turns.inputs(["i1"]))
    await asyncio.sleep(0)
    second_input = asyncio.create_task(turns.inputs(["i2"]))
    for _ in range(6):  # every call, one at a time
        judge.release.release()
        if _ < 5:
            await started(judge)
    verdicts = await batch
    assert [v.scores["t"] for v in verdicts] == [2.0] * 5  # each text judged once, in order
    assert (await first_input)[0].scores == {"t": 2.0} and (await second_input)[0].scores == {"t": 2.0}
    await later_outputs
    # the inputs went before the batch's second piece and before the output call waiting longer
    assert judge.calls == [["o1", "o2"], ["i1"], ["i2"], ["p1"], ["o3", "o4"], ["o5"]]
    assert turns.calls == 6 and not turns.busy and not turns.waiting


async def test_a_call_cancelled_while_waiting_or_handed_its_turn_passes_the_turn_on():
    judge = Recorder()
    turns = Turns(judge, piece=8)
    turns.busy = True  # as if a call were in the classifier
    gone = asyncio.create_task(turns.inputs(["cancelled while waiting"]))
    handed = asyncio.create_task(turns.inputs(["cancelled once handed its turn"]))
    last = asyncio.create_task(turns.outputs(["b"]))
    await asyncio.sleep(0)  # all three wait
    gone.cancel()
    await asyncio.sleep(0)
    turns._next()  # the call in the classifier ends: the turn goes past `gone` to `handed`
    handed.cancel()  # before `handed` runs
    await started(judge)
    judge.release.release()
    assert (await last)[0].scores == {"t": 1.0}
    assert judge.calls == [["b"]] and not turns.busy and not turns.waiting
    assert gone.cancelled() and handed.cancelled()
