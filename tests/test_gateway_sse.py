"""gateway/sse.py against an ASGI server's side of the protocol: batches as single writes, the stream
ended at once when its client leaves, pings for idle streams, a stuck write ended."""

from __future__ import annotations

import asyncio

from gateway.sse import PING, Streams, frame


class Client:
    """What uvicorn hands an ASGI app: `receive` that says http.disconnect when told, `send` that
    records bodies and can be made to hang (a client that reads nothing)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.gone = asyncio.Event()
        self.stuck = False

    async def receive(self):
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message) -> None:
        if message["type"] == "http.response.body":
            if self.stuck:
                await asyncio.Event().wait()
            self.bodies.append(message["body"])


async def _until(condition, timeout=5.0):
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def test_each_batch_is_one_write_and_the_end_an_empty_last_body():
    async def source():
        yield [frame("a", id="r:0"), frame("b", id="r:1")]
        yield [frame("c", id="r:2")]

    client = Client()
    await Streams(ping_s=60, stuck_s=60).response(source(), {"X-Extra": "1"})({}, client.receive, client.send)
    assert client.bodies == [frame("a", id="r:0") + frame("b", id="r:1"), frame("c", id="r:2"), b""]


async def test_a_client_leaving_ends_its_stream_and_runs_the_source_cleanup():
    closed = asyncio.Event()

    async def source():
        try:
            yield [frame("a")]
            await asyncio.Event().wait()  # nothing more comes
        finally:
            closed.set()

    client = Client()
    streams = Streams(ping_s=60, stuck_s=60)
    serving = asyncio.create_task(streams.response(source(), None)({}, client.receive, client.send))
    await _until(lambda: client.bodies)
    client.gone.set()
    await asyncio.wait_for(serving, 2)  # ends normally: the client's leaving is not an error
    assert closed.is_set() and not streams.open


async def test_an_idle_stream_is_pinged_and_a_stuck_one_ended():
    async def idle():
        yield [frame("a")]
        await asyncio.Event().wait()

    streams = Streams(ping_s=0.05, stuck_s=0.3)
    watching = asyncio.create_task(streams.run(every_s=0.02))
    quiet, stuck = Client(), Client()
    serving = asyncio.create_task(streams.response(idle(), None)({}, quiet.receive, quiet.send))
    await _until(lambda: quiet.bodies.count(PING) >= 2)
    stuck.stuck = True
    ended = asyncio.create_task(streams.response(idle(), None)({}, stuck.receive, stuck.send))
    await asyncio.wait_for(ended, 3)
    assert streams.stuck == 1 and not serving.done()
    quiet.gone.set()
    await asyncio.wait_for(serving, 2)
    watching.cancel()
