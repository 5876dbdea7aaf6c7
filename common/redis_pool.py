"""Redis clients whose connections are bounded and shared: a burst waits for a free connection.

redis-py's default pool opens a connection per concurrent command and fails the 101st with
"Too many connections"; under thousands of live streams that failure reached every stream. Here
each client holds at most `max_connections`, and a command that finds them all busy waits up to
`wait_s` for one (then raises, as an outage would: a Redis that is down refuses connections at
once, so only load makes a command wait here). One client per store and process: commands
pipeline over the few connections instead of opening one each.
"""

from __future__ import annotations

import redis.asyncio as aioredis

MAX_CONNECTIONS = 32  # per client; Redis answers a command in microseconds, so few are needed
WAIT_S = 30.0  # how long a command waits for a free connection (a load, not an outage) before it fails


def bounded(
    url: str,
    *,
    socket_timeout: float,
    socket_connect_timeout: float,
    max_connections: int = MAX_CONNECTIONS,
    wait_s: float = WAIT_S,
) -> aioredis.Redis:
    """An asyncio Redis client over a blocking pool of at most `max_connections` connections."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=wait_s,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_connect_timeout,
    )
    return aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() closes it
