"""Limits on what a client may send, enforced before a route runs (a pure ASGI middleware).

A request body is kept at most up to `max_body_bytes` (413 as soon as it is known to be larger:
from Content-Length before keeping anything, or while reading a chunked body), which keeps every
event the gateway writes below the broker's message size. Before answering 413 the rest of the body
is read and thrown away, up to DRAIN_BYTES within DRAIN_S (a client still sending when the
connection closes would see a reset instead of the answer); a client that sent
`Expect: 100-continue` gets its 413 without sending anything. A body that is not JSON by its
Content-Type is refused with 400. The body read here is handed on to the app unchanged.
"""

from __future__ import annotations

import asyncio
import json

from gateway.openai_api import error_body

JSON_TYPES = ("application/json",)
DRAIN_BYTES = 16 * 1024 * 1024
DRAIN_S = 5.0


def _is_json(content_type: bytes) -> bool:
    mime = content_type.split(b";", 1)[0].strip().lower().decode("latin-1")
    return mime in JSON_TYPES or mime.endswith("+json")


async def _refuse(send, status: int, message: str, code: str, param: str | None = None) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", param, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimits:
    """`uploads`: paths whose POST body is a multipart upload, with their own limit (the file's
    limit and room for the form around it); every other body must be JSON within `max_body_bytes`."""

    def __init__(self, app, max_body_bytes: int, uploads: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_body = max_body_bytes
        self.uploads = uploads or {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        upload = scope["method"] == "POST" and scope["path"].rstrip("/") in self.uploads
        most = self.uploads[scope["path"].rstrip("/")] if upload else self.max_body
        too_large = (
            f"The upload exceeds the limit of {most} bytes."
            if upload
            else f"The request body exceeds the limit of {most} bytes; send a shorter conversation "
            "(or continue a stored one with conversation_id)."
        )
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await _refuse(
                    send, 400, "Content-Length is not a number.", "invalid_header", "Content-Length"
                )
                return
            if length > most:
                if headers.get(b"expect", b"").lower() != b"100-continue" and length <= DRAIN_BYTES:
                    await _drain(receive, DRAIN_BYTES)
                await _refuse(send, 413, too_large, "request_too_large")
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                await self.app(scope, _replay([], message, receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > most:
                if message.get("more_body", False):
                    await _drain(receive, DRAIN_BYTES - size)
                await _refuse(send, 413, too_large, "request_too_large")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        content_type = headers.get(b"content-type")
        if size and content_type is not None and not upload and not _is_json(content_type):
            await _refuse(
                send,
                400,
                f"Content-Type {content_type.decode('latin-1')!r} is not supported: "
                "send the body as application/json.",
                "unsupported_content_type",
                "Content-Type",
            )
            return
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], None, receive), send)


async def _drain(receive, most: int) -> None:
    """Read what the client still sends and drop it (at most `most` bytes, DRAIN_S seconds)."""
    try:
        async with asyncio.timeout(DRAIN_S):
            while most > 0:
                message = await receive()
                if message["type"] != "http.request":
                    return
                most -= len(message.get("body", b""))
                if not message.get("more_body", False):
                    return
    except TimeoutError:
        pass


def _replay(messages: list[dict], last: dict | None, receive):
    """A receive callable that first hands out what was read, then waits on the connection again."""
    pending = list(messages) + ([last] if last is not None else [])

    async def replayed():
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
