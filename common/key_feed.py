"""Keys pushed to every running keyring as they are made and destroyed (Redis pub/sub on the durable store).

Why: a conversation's key is made by its first writer (the gateway) and read by every role after it.
Fetched on first sight, that is one round trip to the durable Redis per role, each on the path of the
conversation's first token. Instead the maker publishes the new key in the same Lua call that stores it
(common/sealing.py), and every keyring listens here, so a role usually holds the key before the first
event that needs it arrives (a message on an open Redis connection beats a produce and a fetch through
the broker). A destroyed key is published too, so running roles stop opening it at once.

Pub/sub delivers at most once: what is published while a listener's connection is down is lost to it.
So the feed says since when it has heard everything (`live_since`): the moment its subscription was
confirmed, cleared when the connection fails or a ping goes unanswered for `SILENCE_S`. The keyring
trusts a key it took in while the feed was live for as long as the feed stays live, and any other only
for its short TTL, as before the feed: an erasure reaches a running role at once, and within that TTL
where its feed was down.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Callable

import redis

log = logging.getLogger(__name__)

CHANNEL = "ts:seal:keys"
PING_S = 1.0  # a ping on the subscription this often, so that a silent connection is noticed
SILENCE_S = 3.0  # nothing heard for this long: the feed is not live (messages may have been lost)


def made_message(key_id: str, tenant: str, scope: str, material: bytes) -> str:
    return json.dumps(
        {
            "op": "made",
            "id": key_id,
            "tenant": tenant,
            "scope": scope,
            "key": base64.b64encode(material).decode("ascii"),
        }
    )


def destroyed_message(key_ids: list[str]) -> str:
    return json.dumps({"op": "destroyed", "ids": key_ids})


class KeyFeed:
    """A daemon thread subscribed to CHANNEL, calling `on_made(key_id, tenant, scope, material)` and
    `on_destroyed(key_ids)` for what it hears."""

    def __init__(
        self,
        client: redis.Redis,
        on_made: Callable[[str, str, str, bytes], None],
        on_destroyed: Callable[[list[str]], None],
    ) -> None:
        self.client, self.on_made, self.on_destroyed = client, on_made, on_destroyed
        self._since: float | None = None
        self._heard = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ts-key-feed", daemon=True)
        self._thread.start()

    def live_since(self) -> float | None:
        """Monotonic time since which every key published has been heard, None when the feed is down."""
        since = self._since
        if since is None or time.monotonic() - self._heard > SILENCE_S:
            return None
        return since

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        delay = 0.1
        while not self._stop.is_set():
            pubsub = self.client.pubsub()
            try:
                self._listen(pubsub)
                delay = 0.1
            except (redis.RedisError, OSError, ValueError) as exc:
                if self._since is not None:
                    log.warning("key feed: lost (%s); keys held fall back to their short TTL", exc)
                self._since = None
            finally:
                try:
                    pubsub.close()
                except (redis.RedisError, OSError):
                    pass
            self._stop.wait(delay)
            delay = min(delay * 2, 2.0)

    def _listen(self, pubsub) -> None:
        pubsub.subscribe(CHANNEL)
        pinged = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if self._since is not None and now - self._heard > SILENCE_S:
                raise redis.ConnectionError(f"no answer to a ping for {SILENCE_S:.0f} s")
            if now - pinged >= PING_S:
                pubsub.ping()
                pinged = now
            message = pubsub.get_message(timeout=0.5)
            if message is None:
                continue
            self._heard = time.monotonic()
            if message["type"] == "subscribe":
                self._since = self._heard
            elif message["type"] == "message":
                self._handle(message["data"])

    def _handle(self, data: bytes | str) -> None:
        try:
            event = json.loads(data)
            if event["op"] == "made":
                self.on_made(event["id"], event["tenant"], event["scope"], base64.b64decode(event["key"]))
            elif event["op"] == "destroyed":
                self.on_destroyed(list(event["ids"]))
        except (ValueError, KeyError, TypeError) as exc:  # it may have been a destruction: as if lost
            raise ValueError(f"an unreadable message ({type(exc).__name__}: {exc})") from exc
