"""The one thread that runs torch in a worker process: loading, the KV pool, the engine, every step.

torch's CPU kernels run on OpenMP (libgomp), which gives every thread that opens a parallel region
a team of pool threads of its own, kept until that thread exits. Once a process holds more OpenMP
threads than the machine has cores, libgomp throttles every team's spin-wait at its barriers from
300,000 iterations to 100 (GOMP_SPINCOUNT in libgomp's manual): the pool threads fall asleep on
a futex between two parallel regions and each of the hundreds of regions in a step pays a wake-up.
Measured on 2 cores (SmolLM2-135M, 64 requests at once, 69 steps): the engine stepping on a second
thread after loading on the first (two teams) took 13.2-14.3 s where one thread takes 11.5 s, with
92,000 voluntary context switches instead of 700; a worker that loaded the model in asyncio's
default executor, built its engine on the event loop's thread and stepped on a third took 14.6-16.4 s.
Everything torch does in a worker therefore runs here, on one thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def torch_thread() -> ThreadPoolExecutor:
    """The process's torch thread (a one-thread executor, created on first use, never shut down)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="torch")
        return _executor


async def on_torch_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Await `fn(*args, **kwargs)` run on the torch thread."""
    return await asyncio.get_running_loop().run_in_executor(torch_thread(), partial(fn, *args, **kwargs))


def run_on_torch_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` run on the torch thread, from synchronous code (benchmarks, tools)."""
    return torch_thread().submit(fn, *args, **kwargs).result()
