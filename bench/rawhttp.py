"""A load generator's HTTP client: raw asyncio sockets speaking HTTP/1.0, so measuring costs little CPU
next to what is measured. SSE event ids (`<request id>:<position>`) are read straight off the bytes."""

from __future__ import annotations

import asyncio
import json
import re
import time

ID_RE = re.compile(rb"id: ([0-9a-f]{32}(?:s\d+)?):(-?\d+)\r?\n")


def chat_post(port: int, body: dict, *, key: str | None = None) -> bytes:
    """A POST /v1/chat/completions request with `body` as JSON (and the API key, when given)."""
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST /v1/chat/completions HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"{auth}Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data


async def first_token(port: int, request: bytes) -> tuple[str | None, float, float | None]:
    """Send `request`, read the stream to its end: (request id, sent at, first content frame at)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = time.time()
    writer.write(request)
    buf, rid, first = b"", None, None
    while first is None:
        data = await reader.read(65536)
        if not data:
            break
        buf += data
        for m in ID_RE.finditer(buf):
            rid = m.group(1).decode()
            if int(m.group(2)) >= 0:
                first = time.time()
                break
    while await reader.read(65536):
        pass
    writer.close()
    return rid, sent, first
