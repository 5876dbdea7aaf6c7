"""web_fetch through a real tool processor, against pages served by a local http.server on loopback."""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from schemas import ToolCall
from tests.tool_support import sandbox_root, serving, tools_env

ARTICLE = """<html><head><title>Lighthouses</title></head><body>
<nav><a href="/">Home</a> | <a href="/about">About</a></nav>
<article><h1>The keepers of the coast</h1>
<p>The Bell Rock Lighthouse, off the coast of Angus, is the oldest surviving sea-washed lighthouse in
the world. It was built between 1807 and 1810 by Robert Stevenson on the Inchcape reef.</p>
<p>Its light was first lit on the first of February 1811 and has warned ships ever since.</p>
</article><footer>Copyright nobody</footer></body></html>"""


class Pages(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        port = self.server.server_address[1]
        if self.path == "/article":
            self._send(200, "text/html; charset=utf-8", ARTICLE.encode())
        elif self.path == "/to-localhost":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{port}/article")
            self.end_headers()
        elif self.path == "/big":
            self._send(200, "text/plain", b"word " * 400_000)
        else:
            self._send(404, "text/plain", b"no such page")

    def _send(self, status: int, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def site():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def fetch_call(url: str) -> ToolCall:
    return ToolCall(
        request_id=f"req-{uuid.uuid4().hex[:10]}",
        call_id=f"call-{uuid.uuid4().hex}",
        conversation_id="conv-web",
        tenant="t-test",
        name="web_fetch",
        arguments=json.dumps({"url": url}),
    )


async def test_web_fetch_reads_allowlisted_pages_and_refuses_the_rest(roles, bootstrap, site):
    env = tools_env(
        sandbox_root(),
        TOKENSTREAM_TOOLS_WEB_ALLOW_HOSTS='["127.0.0.1", "localhost"]',
        TOKENSTREAM_TOOLS_WEB_ALLOW_PRIVATE='["127.0.0.1"]',
        TOKENSTREAM_TOOLS_WEB_MAX_KB="64",
    )
    calls = {
        "article": fetch_call(f"{site}/article"),
        "not_allowlisted": fetch_call("http://example.com/"),
        "loopback": fetch_call(site.replace("127.0.0.1", "localhost") + "/article"),
        "redirect_to_loopback": fetch_call(f"{site}/to-localhost"),
        "too_big": fetch_call(f"{site}/big"),
        "missing": fetch_call(f"{site}/nothing-here"),
        "scheme": fetch_call("file:///etc/passwd"),
    }
    async with serving(roles, bootstrap, env) as (_, bus):
        for call in calls.values():
            await bus.send(call)
        got = await bus.wait([c.call_id for c in calls.values()])
    r = {name: got[call.call_id] for name, call in calls.items()}
    page = json.loads(r["article"].output)
    assert r["article"].ok and page["status"] == 200
    assert "Bell Rock Lighthouse" in page["text"] and "1811" in page["text"]
    assert "Home | About" not in page["text"]  # the navigation is boilerplate, not the page's text
    assert not r["not_allowlisted"].ok and "not on the web tool's allowlist" in r["not_allowlisted"].error
    assert not r["loopback"].ok and "private or loopback" in r["loopback"].error
    assert not r["redirect_to_loopback"].ok and "private or loopback" in r["redirect_to_loopback"].error
    big = json.loads(r["too_big"].output)
    assert r["too_big"].ok and big["truncated"] and len(big["text"]) <= 64 * 1024
    assert not r["missing"].ok and "HTTP 404" in r["missing"].error
    assert not r["scheme"].ok and "only http and https" in r["scheme"].error
