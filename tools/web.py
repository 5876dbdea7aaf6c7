"""Fetching a web page for the model, behind the operator's allowlist.

    page = await fetch(url, tool_settings())   # -> Page(url, status, text, truncated); raises ToolError

Every hop (the URL and each redirect) is checked: http or https only, the host on
`web_allow_hosts` (an entry ".example.com" admits its subdomains), and every address the host
resolves to public, unless the host is also on `web_allow_private`. The connection then goes to
the address that was checked (the Host header and TLS name stay the host's), so a DNS answer that
changes between the check and the connection cannot lead to an internal address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import httpx

from common.documents import readable
from tools.base import ToolError
from tools.config import ToolSettings

TEXT_TYPES = ("text/html", "application/xhtml+xml", "text/plain", "text/markdown")


@dataclass
class Page:
    url: str
    status: int
    content_type: str
    text: str
    truncated: bool


def allowed(host: str, entries: list[str]) -> bool:
    host = host.lower().rstrip(".")
    for entry in entries:
        entry = entry.lower().rstrip(".")
        if host == entry or (entry.startswith(".") and host.endswith(entry)):
            return True
    return False


async def resolve(host: str, port: int, cfg: ToolSettings) -> str:
    """The address to connect to, after checking every address the host has."""
    if not allowed(host, cfg.web_allow_hosts):
        raise ToolError(f"host {host!r} is not on the web tool's allowlist")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ToolError(f"cannot resolve {host!r}: {exc.strerror}") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    private = [a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_global]
    if private and not allowed(host, cfg.web_allow_private):
        raise ToolError(
            f"host {host!r} resolves to a private or loopback address ({', '.join(private)}); refused"
        )
    return addresses[0]


def _target(url: str) -> tuple[str, str, int, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ToolError(f"only http and https URLs are fetched, not {parts.scheme or 'a relative URL'!r}")
    if not parts.hostname:
        raise ToolError("the URL names no host")
    if parts.username or parts.password:
        raise ToolError("URLs with credentials are refused")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, parts.hostname, port, parts.netloc


async def fetch(url: str, cfg: ToolSettings) -> Page:
    try:
        async with asyncio.timeout(cfg.web_timeout_s):
            return await _fetch(url, cfg)
    except TimeoutError:
        raise ToolError(f"fetching {url} took longer than {cfg.web_timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise ToolError(f"fetching {url} failed: {type(exc).__name__}: {exc}") from None


async def _fetch(url: str, cfg: ToolSettings) -> Page:
    limit = cfg.web_max_kb * 1024
    async with httpx.AsyncClient(
        follow_redirects=False, trust_env=False, timeout=cfg.web_timeout_s
    ) as client:
        for _hop in range(cfg.web_max_redirects + 1):
            scheme, host, port, netloc = _target(url)
            address = await resolve(host, port, cfg)
            shown = f"[{address}]" if ":" in address else address
            parts = urlsplit(url)
            pinned = parts._replace(netloc=f"{shown}:{port}").geturl()
            headers = {
                "Host": netloc.rsplit("@", 1)[-1],
                "User-Agent": "tokenstream-web-fetch",
                "Accept": ", ".join(TEXT_TYPES),
            }
            request = client.build_request(
                "GET", pinned, headers=headers, extensions={"sni_hostname": host} if scheme == "https" else {}
            )
            response = await client.send(request, stream=True)
            try:
                if response.is_redirect:
                    location = response.headers.get("location")
                    if not location:
                        raise ToolError(f"{url} redirects without a Location")
                    url = urljoin(url, location)
                    continue
                kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
                if kind and kind not in TEXT_TYPES:
                    raise ToolError(f"{url} is {kind}, not a page the web tool reads")
                body, truncated = bytearray(), False
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > limit:
                        del body[limit:]
                        truncated = True
                        break
                encoding = response.encoding or "utf-8"
            finally:
                await response.aclose()
            raw = bytes(body).decode(encoding, errors="replace")
            text = readable(raw, url) if kind != "text/plain" and kind != "text/markdown" else raw
            cap = cfg.web_text_kb * 1024
            if len(text) > cap:
                text, truncated = text[:cap], True
            return Page(url, response.status_code, kind or "unknown", text, truncated)
    raise ToolError(f"more than {cfg.web_max_redirects} redirects from {url}")
