"""The keyring's rule on event loops: no fetch of a key from the store runs on one (common/sealing.py).

Work on a loop that seals or opens goes through `unblocked`: a key it needs and does not hold raises
KeyNotHeld inside it, is fetched in a thread while the loop goes on, and the work runs again with it.
Elsewhere (threads, CLIs, tests) a key not held is fetched where it is needed; a fetch made on a loop
outside `unblocked` is logged once per process, with where it came from.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from schemas.sealing import KeyNotHeld

log = logging.getLogger(__name__)
T = TypeVar("T")

# The keys the work `unblocked` runs may use without holding them (fetched for it in a thread): present
# only while that work runs, on the loop's thread; absent, a key not held is fetched where it is needed.
_local = threading.local()
_NONE: dict = {}  # no key pinned (`held_only`; never written)
_warned_on_loop = False


def needed(keyring: object, what: Any, fetch: Callable[[], T]) -> T:
    """A key `keyring` does not hold (`what`: its id, or (tenant, scope) to seal with): fetched here,
    or, inside `unblocked`, the one fetched for it (KeyNotHeld asks for it)."""
    pins = getattr(_local, "pins", None)
    if pins is None:
        _note_on_loop(what)
        return fetch()
    wanted = (id(keyring), what)
    if wanted in pins:
        return pins[wanted]
    raise KeyNotHeld(f"the keyring does not hold the key of {what}", wanted, fetch)


def _note_on_loop(wanted: Any) -> None:
    global _warned_on_loop
    if _warned_on_loop:
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return  # off any loop: a blocking fetch is fine here
    _warned_on_loop = True
    log.warning(
        "the keyring fetched the key of %s on an event loop, blocking it: seal and open there through "
        "common.sealing.unblocked or hold_keys (logged once)",
        wanted,
        stack_info=True,
    )


def held_only(work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` with the keys held only: a key not held raises KeyNotHeld (a SealingUnavailable)
    instead of being fetched. The sync first try of a hot path on a loop, whose `except
    SealingUnavailable` goes on with `patiently` or `unblocked`."""
    outer = getattr(_local, "pins", None)
    _local.pins = outer if outer is not None else _NONE
    try:
        return work(*args)
    finally:
        _local.pins = outer


async def unblocked(work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` (an encode or decode, a seal or open of a stored value) on the event loop, never
    waiting there on the keyring's store: each key it needs and does not hold is fetched in a thread
    (the loop goes on meanwhile), then it runs again with that key. An unreachable store raises
    SealingUnavailable, as a fetch in place would; any other outcome is the work's own."""
    pins: dict = {}
    while True:
        outer = getattr(_local, "pins", None)
        _local.pins = pins
        try:
            return work(*args)
        except KeyNotHeld as missing:
            wanted, fetch = missing.wanted, missing.fetch
        finally:
            _local.pins = outer
        pins[wanted] = await _fetched(wanted, fetch)


# A key being fetched for a loop, by (loop, key): the works that miss it meanwhile wait on that one fetch
# (a burst of requests after a restart takes one thread, not the whole default pool).
_fetching: dict[tuple[Any, Any], asyncio.Future] = {}


async def _fetched(wanted: Any, fetch: Callable[[], T]) -> T:
    at = (asyncio.get_running_loop(), wanted)
    shared = _fetching.get(at)
    if shared is None:
        shared = _fetching[at] = asyncio.ensure_future(asyncio.to_thread(fetch))
        shared.add_done_callback(lambda done: _ended(at, done))
    return await asyncio.shield(shared)  # a waiter cancelled leaves the fetch to the others


def _ended(at: tuple[Any, Any], done: asyncio.Future) -> None:
    _fetching.pop(at, None)
    if not done.cancelled():
        done.exception()  # taken: an outage nobody waits on any more is not logged as never retrieved
