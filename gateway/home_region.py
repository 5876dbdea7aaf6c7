"""A key at home in another region is served there: its requests never touch this region's pipeline.

A pure ASGI middleware in front of every route (deployments with regions only). It hashes the bearer
key and asks `KeyHomes` where it is at home; a key of this region, or one no region published (401
from the routes), passes through. A key at home in region R:
- is proxied to R's gateway (TOKENSTREAM_REGIONS[R]) as it came: method, path, query, headers, body,
  and the answer streamed back as R sends it (SSE frames as they come). Nothing of it is written here:
  no event on this region's cluster, no key in its stores (rate limits, usage, files: R's, checked by R).
  A client that goes away closes the connection to R, whose gateway then cancels as for any client;
- is refused with 421 Misdirected Request in OpenAI's error shape (`wrong_region`, naming R) where
  R has no gateway URL here, or where the request was already proxied once (a loop between two
  gateways whose key homes disagree);
- on a WebSocket (`/v1/responses`) is refused before the handshake completes, the reason naming R's URL.
R unreachable: 503 (`region_unreachable`), which a client may retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import httpx

from gateway.openai_api import error_body
from schemas import keys as K

log = logging.getLogger(__name__)

VIA = b"x-tokenstream-via"  # set on a proxied request: the region that sent it
REGION = b"x-tokenstream-region"  # set on a proxied answer: the region that served it
HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"te",
    b"trailer",
    b"transfer-encoding",
    b"upgrade",
}
NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length"}  # httpx sets both for the home region's gateway


def bearer_digest(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, secret = value.decode("latin-1").partition(" ")
            secret = secret.strip()
            return K.digest(secret) if scheme.lower() == "bearer" and secret else None
    return None


async def _answer(
    send,
    status: int,
    message: str,
    code: str,
    type_: str = "invalid_request_error",
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    body = json.dumps(error_body(message, type_, None, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class HomeRegion:
    def __init__(self, app, gateway, connect_timeout_s: float = 5.0, read_timeout_s: float = 300.0) -> None:
        """`gateway`: the instance's Gateway (its key_homes, region and the regions' URLs)."""
        self.app, self.gateway = app, gateway
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s), follow_redirects=False
        )

    async def __call__(self, scope, receive, send) -> None:
        homes = self.gateway.key_homes
        if scope["type"] not in ("http", "websocket") or homes is None:
            await self.app(scope, receive, send)
            return
        digest = bearer_digest(scope["headers"])
        home = homes.home(digest) if digest else None
        if home is None or home == self.gateway.region:
            await self.app(scope, receive, send)
            return
        url = self.gateway.regions.get(home)
        self.gateway.metrics.home_region.labels(home).inc()
        if scope["type"] == "websocket":
            where = f"connect to {url}" if url else "use that region's endpoint"
            await send(
                {
                    "type": "websocket.close",
                    "code": 1008,
                    "reason": f"this key is at home in region {home}: {where}"[:120],
                }
            )
            return
        if url is None or any(name.lower() == VIA for name, _ in scope["headers"]):
            await _answer(
                send,
                421,
                f"This API key is at home in region {home}, which this endpoint "
                f"(region {self.gateway.region}) does not serve: send its requests to region {home}'s "
                "endpoint.",
                "wrong_region",
            )
            return
        await self._proxy(scope, receive, send, url, home)

    async def _proxy(self, scope, receive, send, base_url: str, home: str) -> None:
        target = base_url.rstrip("/") + scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in NOT_FORWARDED]
        headers.append((VIA, self.gateway.region.encode()))
        parts: list[bytes] = []
        while True:  # BodyLimits in front of this has already bounded the body
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        request = self.client.build_request(scope["method"], target, headers=headers, content=b"".join(parts))
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            log.warning("region %s unreachable at %s: %s", home, base_url, exc)
            await _answer(
                send,
                503,
                f"This API key is at home in region {home}, which cannot be reached "
                "right now; try again shortly.",
                "region_unreachable",
                "service_unavailable",
                ((b"retry-after", b"5"),),
            )
            return
        relay = asyncio.create_task(self._relay(response, send, home))
        gone = asyncio.create_task(_disconnected(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (relay, gone):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await response.aclose()
        if not relay.cancelled() and relay.done() and relay.exception() is not None:
            log.warning("region %s: the answer was cut: %s", home, relay.exception())

    @staticmethod
    async def _relay(response: httpx.Response, send, home: str) -> None:
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]
        await send(
            {
                "type": "http.response.start",
                "status": response.status_code,
                "headers": [*headers, (REGION, home.encode())],
            }
        )
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def aclose(self) -> None:
        await self.client.aclose()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
