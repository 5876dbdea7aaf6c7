"""The load generator of `bench gateway`'s fan-out: SSE streams held by a process of their own.

`Clients.start` spawns a process that opens the streams (raw sockets, HTTP/1.0, bench/rawhttp.py),
at most OPENING of them waiting for their answer's first bytes at a time, and reads each to its
end, noting when every SSE id (`request:seq`) arrived. The parent sees how many streams are open
or refused while it runs, and gets every stream's record when all have ended. Apart from the
gateway it measures, nothing shares this process's event loop.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from dataclasses import dataclass, field

from bench.rawhttp import ID_RE

# Streams connected and not yet answered, at most: more would overflow the gateway's accept queue
# (net.core.somaxconn), and a connection the kernel drops there is one its client believes open and
# that is never answered.
OPENING = 512


@dataclass
class Received:
    """What the clients saw: per stream its request id and when each of its SSE ids arrived."""

    rid_of: list[str | None]
    received: dict[str, dict[int, float]] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)  # HTTP status of each answer
    refusals: dict[str, str] = field(default_factory=dict)  # the first body of each status but 200
    out_of_order: int = 0  # frames whose id is not above the stream's last one
    connect_errors: int = 0


class Clients:
    """`streams` SSE streams, each a POST of `requests[i]`, in a spawned process."""

    def __init__(self, port: int, requests: list[bytes]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.opened = ctx.Value("i", 0)  # streams whose first SSE event arrived
        self.refused = ctx.Value("i", 0)  # streams answered other than 200, or not connected
        self._results = ctx.Queue()
        self._proc = ctx.Process(
            target=_main, args=(port, requests, self.opened, self.refused, self._results), daemon=True
        )

    def start(self) -> Clients:
        self._proc.start()
        return self

    @property
    def settled(self) -> int:
        """Streams open or refused so far."""
        return self.opened.value + self.refused.value

    async def result(self, timeout: float) -> Received:
        """Every stream's record, once all have ended (or `timeout` seconds passed)."""
        got = await asyncio.to_thread(self._results.get, True, timeout)
        await asyncio.to_thread(self._proc.join, 10)
        return got

    def stop(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()


def _main(port: int, requests: list[bytes], opened, refused, results) -> None:
    results.put(asyncio.run(_run(port, requests, opened, refused)))


async def _read(reader: asyncio.StreamReader) -> bytes:
    """The next bytes of a stream; b"" at its end, and where the gateway reset it (its tokens missing)."""
    try:
        return await reader.read(65536)
    except OSError:
        return b""


async def _run(port: int, requests: list[bytes], opened, refused) -> Received:
    seen = Received(rid_of=[None] * len(requests))
    opening = asyncio.Semaphore(OPENING)

    async def client(i: int) -> None:
        await opening.acquire()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            opening.release()
            seen.connect_errors += 1
            with refused.get_lock():
                refused.value += 1
            return
        writer.write(requests[i])
        tail, first, last = b"", True, None  # last: the highest SSE id seq seen on this stream
        while data := await _read(reader):
            now = time.time()
            if first:  # the status line: "HTTP/1.1 200 OK"
                first = False
                opening.release()
                status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "?"
                seen.statuses[status] = seen.statuses.get(status, 0) + 1
                if status != "200":
                    seen.refusals.setdefault(
                        status, data.partition(b"\r\n\r\n")[2][:300].decode(errors="replace")
                    )
                    with refused.get_lock():
                        refused.value += 1
            buf, end = tail + data, 0
            for m in ID_RE.finditer(buf):
                rid, seq = m.group(1).decode(), int(m.group(2))
                if seen.rid_of[i] is None:
                    seen.rid_of[i] = rid
                    with opened.get_lock():
                        opened.value += 1
                got = seen.received.setdefault(rid, {})
                seen.out_of_order += last is not None and seq <= last
                last = seq if last is None else max(last, seq)
                got[seq] = now
                end = m.end()
            tail = buf[end:][-256:]
        if first:  # ended without an answer
            opening.release()
        writer.close()

    await asyncio.gather(*(client(i) for i in range(len(requests))))
    return seen
