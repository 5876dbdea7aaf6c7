"""Reaching Weaviate from any role: short client timeouts, a readiness check, and a breaker.

Weaviate serves only some requests (the gateway's semantic cache, the file_search tool, file
ingestion), so an outage must cost those requests a fast, clear answer and nothing else:

- every client is made with `client_config(timeout_s)`: connect, query and insert time out after
  seconds instead of the client's defaults (30 s queries, 90 s inserts);
- a role that failed to reach Weaviate skips it for a pause (`Breaker`: 0.25 s doubling to 2 s),
  answering at once (a cache miss, a tool error) instead of trying again on every request, and
  drops its client so that the next try connects afresh (a gRPC channel left from before the
  outage would wait out its own reconnect back-off, up to two minutes);
- `ready()` / `aready()` ask Weaviate's own readiness endpoint; health endpoints report it, and a
  failure while Weaviate says it is ready is the request's own (not an outage).

Health rule: Weaviate is optional for serving, so its absence makes a role *degraded* (ready,
with `weaviate: false` and the reason in `degraded`), never not-ready: taking a gateway out of its
load balancer because the cache is away would turn a cache outage into a full one.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from common.config import settings


def client_config(timeout_s: float, insert_s: float | None = None):
    """The weaviate-client AdditionalConfig with `timeout_s` for connecting and querying."""
    from weaviate.classes.init import AdditionalConfig, Timeout

    return AdditionalConfig(
        timeout=Timeout(
            init=timeout_s, query=timeout_s, insert=insert_s if insert_s is not None else timeout_s
        )
    )


def ready_url() -> str:
    cfg = settings()
    return f"http://{cfg.weaviate_host}:{cfg.weaviate_http_port}/v1/.well-known/ready"


def ready(timeout_s: float = 1.0) -> bool:
    """Whether Weaviate says it is ready now (blocking; call it in a thread from async code)."""
    try:
        with urllib.request.urlopen(ready_url(), timeout=timeout_s) as answer:
            return answer.status == 200
    except OSError:
        return False


async def aready(timeout_s: float = 1.0) -> bool:
    """`ready()` for async code."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            return (await http.get(ready_url())).status_code == 200
    except httpx.HTTPError:
        return False


BACKOFF_FIRST_S, BACKOFF_MOST_S = (
    0.25,
    2.0,
)  # the pause after a failure, doubling: the breaker's and ingestion's


def backoff_s(failures: int, first_s: float = BACKOFF_FIRST_S, most_s: float = BACKOFF_MOST_S) -> float:
    """The pause after `failures` + 1 failures in a row: first_s, doubling, at most most_s."""
    return min(most_s, first_s * 2**failures)


@dataclass
class Breaker:
    """After a failure, callers skip the dependency for a pause (first_s, doubling to most_s); a success
    closes it. `allow()` says whether to try now; `up` whether the last try succeeded."""

    first_s: float = BACKOFF_FIRST_S
    most_s: float = BACKOFF_MOST_S
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    failures: int = 0
    open_until: float = 0.0
    last_error: str = ""
    down_since: float | None = None

    def allow(self) -> bool:
        return self.clock() >= self.open_until

    def failed(self, exc: BaseException | str) -> float:
        """Record a failure; returns the pause before the next try."""
        now = self.clock()
        pause = backoff_s(self.failures, self.first_s, self.most_s)
        self.failures += 1
        self.open_until = now + pause
        self.last_error = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"[:300]
        if self.down_since is None:
            self.down_since = now
        return pause

    def succeeded(self) -> None:
        self.failures, self.open_until, self.last_error, self.down_since = 0, 0.0, "", None

    @property
    def up(self) -> bool:
        return self.failures == 0
