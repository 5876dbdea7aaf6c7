"""Calls of one Lua script made together, sent as one: a round trip and a parse for many callers.

A gateway ends thousands of answers a second at scale; each one's bookkeeping was its own script call
(a command packed, a round trip, a reply parsed: about 100 us of Python apiece). `Batched` gathers the
calls made while the event loop runs one pass of its ready callbacks and sends them as one call of the
script's batched form, which takes the calls' keys and arguments one after another (`keys_each` and
`args_each` apiece) and answers a list with one result per call. At most `most` calls go in one.
"""

from __future__ import annotations

import asyncio
from typing import Any


class Batched:
    def __init__(self, script, keys_each: int, args_each: int, most: int = 500) -> None:
        self.script = script  # a redis-py registered script of the batched form
        self.keys_each, self.args_each, self.most = keys_each, args_each, most
        self._pending: list[tuple[list, list, asyncio.Future]] = []
        self._tasks: set[asyncio.Task] = set()

    async def __call__(self, keys: list, args: list) -> Any:
        """The script's result for this one call."""
        if len(keys) != self.keys_each or len(args) != self.args_each:
            raise ValueError(f"a call takes {self.keys_each} keys and {self.args_each} arguments")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._pending.append((keys, args, done))
        if len(self._pending) == 1:
            loop.call_soon(self._send)  # after the callers ready in this pass have joined
        return await done

    def _send(self) -> None:
        while self._pending:
            calls, self._pending = self._pending[: self.most], self._pending[self.most :]
            task = asyncio.get_running_loop().create_task(self._call(calls))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _call(self, calls: list[tuple[list, list, asyncio.Future]]) -> None:
        try:
            results = await self.script(
                keys=[k for keys, _, _ in calls for k in keys], args=[a for _, args, _ in calls for a in args]
            )
        except Exception as exc:  # noqa: BLE001 - every caller hears it
            for _, _, done in calls:
                if not done.done():
                    done.set_exception(exc)
            return
        for (_, _, done), result in zip(calls, results, strict=True):
            if not done.done():
                done.set_result(result)
