"""The health endpoints of a role without a web framework of its own (worker, tool processor).

    server = HealthServer(port, check, registry)   # a thread; /health/live, /health/ready, /metrics

`check()` returns a `Report`, computed from what the role's own loops recorded (no network call in
the request but the tool processor's half-second Weaviate readiness check): `live` false only for
what a restart cures (a stuck engine), `ready` false while the role cannot take work (`detail`
says why), `degraded` lists what only some requests need and is away (Weaviate). /health/ready
answers 200 or 503 with the report as JSON; /health/live 200 or 503; /metrics is the role's Prometheus
registry, when it has one.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

log = logging.getLogger(__name__)


@dataclass
class Report:
    ready: bool
    live: bool = True
    detail: list[str] = field(default_factory=list)  # why not ready (or not live)
    degraded: list[str] = field(default_factory=list)  # optional dependencies away
    checks: dict[str, object] = field(default_factory=dict)  # each check's own state

    def body(self) -> bytes:
        return json.dumps(asdict(self)).encode()


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # probes every few seconds would fill the log
        pass


class HealthServer:
    def __init__(
        self,
        port: int,
        check: Callable[[], Report],
        registry: CollectorRegistry | None = None,
        host: str = "0.0.0.0",
    ) -> None:
        self.check = check
        self.metrics = make_wsgi_app(registry) if registry is not None else None
        self.server = make_server(host, port, self._app, ThreadingWSGIServer, handler_class=_Quiet)
        self.thread = threading.Thread(target=self.server.serve_forever, name="health", daemon=True)
        self.thread.start()

    def _app(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path in ("/health/ready", "/health/live"):
            try:
                report = self.check()
            except Exception as exc:
                log.exception("health check failed")
                report = Report(ready=False, detail=[f"health check failed: {type(exc).__name__}: {exc}"])
            ok = report.ready if path == "/health/ready" else report.live
            start_response(
                "200 OK" if ok else "503 Service Unavailable",
                [("Content-Type", "application/json"), ("Cache-Control", "no-store")],
            )
            return [report.body()]
        if self.metrics is not None and path in ("/metrics", "/"):
            return self.metrics(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
