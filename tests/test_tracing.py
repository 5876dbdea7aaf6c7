"""OpenTelemetry spans of every hop (common/tracing.py).

The chain test runs every role as a real process (gateway, conversation, safety and router
processors, a worker with the tiny random Llama, the tool processor) against the session's broker,
exporting OTLP over HTTP to a receiver in this test that decodes the real protobuf requests. One
chat request that calls a server tool must be one trace: every hop's span shares the gateway's
trace id, each is the child of the hop that wrote the record it read, and the GenAI attributes are
there. Without the OTEL_* / TOKENSTREAM_TRACING variables nothing is exported.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from common import tracing
from schemas import ChatRequest, Completion, SamplingParams, ToolCall, TraceContext, Usage

# ------------------------------------------------------------------ an OTLP/HTTP receiver


class Receiver:
    """Accepts OTLP/HTTP protobuf trace exports on /v1/traces; keeps every span as a dict."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceRequest,
                    ExportTraceServiceResponse,
                )

                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                ok = (
                    self.path == "/v1/traces" and self.headers.get("Content-Type") == "application/x-protobuf"
                )
                if ok:
                    export = ExportTraceServiceRequest()
                    export.ParseFromString(body)
                    receiver.add(export)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 400)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, export) -> None:
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    with self.lock:
                        self.spans.append(
                            {
                                "name": span.name,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent": span.parent_span_id.hex(),
                                "kind": span.kind,
                                "service": resource.get("service.name"),
                                "attributes": {a.key: _value(a.value) for a in span.attributes},
                            }
                        )

    def of_trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


# ------------------------------------------------------------------ in process, no broker


def test_off_unless_the_environment_asks():
    assert tracing.wanted({}) is None
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}) == "otlp"
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) == "otlp"
    assert tracing.wanted({"TOKENSTREAM_TRACING": "console"}) == "console"
    assert (
        tracing.wanted({"TOKENSTREAM_TRACING": "off", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) is None
    )
    assert tracing.wanted({"OTEL_SDK_DISABLED": "true", "TOKENSTREAM_TRACING": "otlp"}) is None
    with pytest.raises(ValueError, match="otlp, console or off"):
        tracing.wanted({"TOKENSTREAM_TRACING": "jaeger"})
    # off: a hop still hands on the request's trace (a new span id in the same trace), and exports nothing
    parent = TraceContext.new()
    hop = tracing.hop("route m", parent, role="router")
    assert hop.span is None and hop.trace.trace_id == parent.trace_id and hop.trace.span_id != parent.span_id


def test_hops_in_process_parent_through_the_headers_with_genai_attributes():
    """The SDK's in-memory exporter: a chain of hops, each parented by the headers the last one wrote."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    assert tracing.setup("test", exporter=exporter)
    try:
        request = ChatRequest(
            request_id="r1",
            conversation_id="c1",
            tenant="t",
            model="m",
            messages=[],
            sampling=SamplingParams(max_tokens=7, temperature=0.5, seed=3),
        )
        with tracing.hop(
            "chat m", None, role="gateway", kind="server", attributes=tracing.request_attributes(request)
        ) as gateway:
            headers = gateway.trace.headers()  # what the gateway writes on the record
            with tracing.hop(
                "prepare m",
                tracing.parent_of(headers),
                role="conversation",
                attributes=tracing.record_attributes("ts.chat.requests", 3, 41, "ts-conversation"),
            ):
                pass
            done = Completion(
                request_id="r1",
                seq=2,
                finish_reason="stop",
                usage=Usage(prompt_tokens=5, completion_tokens=2),
            )
            gateway.set(tracing.completion_attributes(done, "m"))
        with tracing.hop(
            "execute_tool web_fetch",
            tracing.parent_of(dict(headers)),
            role="tools",
            attributes=tracing.tool_attributes(ToolCall(request_id="r1", call_id="call_1", name="web_fetch")),
        ):
            pass
        spans = {s.name: s for s in exporter.get_finished_spans()}
        root = spans["chat m"]
        assert root.parent is None
        for child in ("prepare m", "execute_tool web_fetch"):
            assert spans[child].context.trace_id == root.context.trace_id
            assert spans[child].parent.span_id == root.context.span_id
        a = root.attributes
        assert (
            a["gen_ai.operation.name"],
            a["gen_ai.request.model"],
            a["gen_ai.request.max_tokens"],
            a["gen_ai.request.temperature"],
            a["gen_ai.request.seed"],
        ) == ("chat", "m", 7, 0.5, 3)
        assert (
            a["gen_ai.usage.input_tokens"],
            a["gen_ai.usage.output_tokens"],
            a["gen_ai.response.id"],
            tuple(a["gen_ai.response.finish_reasons"]),
        ) == (5, 2, "r1", ("stop",))
        assert spans["prepare m"].attributes["messaging.kafka.offset"] == 41
        assert spans["execute_tool web_fetch"].attributes["gen_ai.tool.name"] == "web_fetch"
        assert spans["execute_tool web_fetch"].attributes["gen_ai.operation.name"] == "execute_tool"
    finally:
        tracing.shutdown()
    assert not tracing.enabled()


# ------------------------------------------------------------------ the real chain

WEB_FETCH = {
    "type": "function",
    "function": {
        "name": "web_fetch",
        "parameters": {
            "type": "object",
            "required": ["url"],
            "properties": {"url": {"enum": ["https://example.invalid/"]}},
        },
    },
}


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.mark.slow
# every role as a process (about 30 s): make test-all; the in-process span tests stay in make test
@pytest.mark.heavy
async def test_one_request_is_one_trace_across_every_role(stack, bootstrap, roles, receiver, tmp_path):
    from gpu_workers.random_model import build
    from tests.gateway_support import openai_client, start_gateway
    from tests.test_worker_kafka import wait_for_log
    from tests.tool_support import sandbox_root, tools_env, wait_ready
    from topics import inference_topic
    from topics.admin import apply
    from topics.registry import all_topics

    model = f"traced-{uuid.uuid4().hex[:6]}"
    await apply(all_topics([model]), bootstrap)
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    tiny = await asyncio.to_thread(build, tmp_path / "tiny")
    procs = {
        name: roles.start("processor", name, "--loglevel", "info", env=otel, name=f"processor-{name}")
        for name in ("conversation", "safety", "router")
    }
    procs["worker"] = roles.start(
        "worker", "--model", model, "--model-path", str(tiny), env=otel, name="worker"
    )
    procs["tools"] = roles.start("tools", env={**tools_env(sandbox_root()), **otel}, name="tools")
    url, procs["gateway"] = await asyncio.to_thread(
        start_gateway, roles, [model], env={**otel, "TOKENSTREAM_GATEWAY_SCREENING": "serial"}, timeout=120
    )
    await asyncio.to_thread(wait_for_log, roles, procs["worker"], "worker ready", 180)
    await wait_ready(procs["tools"], roles.log, 180)

    openai_parent = TraceContext.new()  # the client's own trace: the gateway joins it
    client = openai_client(url, timeout=240)
    done = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Fetch the page, please."}],
        tools=[WEB_FETCH],
        tool_choice={"type": "function", "function": {"name": "web_fetch"}},
        max_tokens=40,
        temperature=0,
        extra_headers={"traceparent": openai_parent.traceparent},
    )
    rid = done.id.removeprefix("chatcmpl-")
    [call] = done.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"url": "https://example.invalid/"}

    wanted = {"gateway", "conversation", "safety", "router", "worker", "tools"}
    deadline = time.monotonic() + 90
    while True:
        spans = receiver.of_trace(openai_parent.trace_id)
        hops = {s["attributes"].get("tokenstream.hop") for s in spans}
        names = {s["name"] for s in spans}
        if wanted <= hops and {"record answer", "screen_output"} <= names:
            break
        for name, proc in procs.items():
            assert proc.poll() is None, f"{name} exited:\n" + roles.log(proc)[-3000:]
        assert time.monotonic() < deadline, f"hops of the trace so far: {sorted(map(str, hops))}"
        await asyncio.sleep(0.3)

    by_name = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)

    def one(name: str) -> dict:
        [span] = by_name[name]
        return span

    gateway = next(s for s in by_name[f"chat {model}"] if s["attributes"]["tokenstream.hop"] == "gateway")
    worker = next(s for s in by_name[f"chat {model}"] if s["attributes"]["tokenstream.hop"] == "worker")
    prepare, screen, route = one(f"prepare {model}"), one(f"screen_input {model}"), one(f"route {model}")
    tool = one("execute_tool web_fetch")
    # the chain: client -> gateway -> conversation -> safety -> router -> worker -> tool processor
    assert gateway["parent"] == openai_parent.span_id
    for child, parent in (
        (prepare, gateway),
        (screen, prepare),
        (route, screen),
        (worker, route),
        (tool, worker),
    ):
        assert child["parent"] == parent["span_id"], (child["name"], parent["name"])
    # the answer's way back: the worker's completion re-keyed, then recorded by the conversation processor
    rekey = next(s for s in by_name["rekey answer"] if s["attributes"]["tokenstream.request_id"] == rid)
    assert rekey["parent"] == worker["span_id"]
    assert one("record answer")["parent"] == rekey["span_id"]
    for window in by_name["screen_output"]:  # the safety processor's output checks: children of the worker's
        assert window["parent"] == worker["span_id"]
    assert {s["service"] for s in spans} >= {f"tokenstream-{h}" for h in wanted}

    for span in (gateway, prepare, screen, route, worker):
        a = span["attributes"]
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == model, span["name"]
        assert a["gen_ai.request.max_tokens"] == 40 and a["gen_ai.request.temperature"] == 0.0, span["name"]
        assert a["gen_ai.response.id"] == rid and a["gen_ai.provider.name"] == "tokenstream", span["name"]
    for span in (gateway, worker):
        a = span["attributes"]
        assert a["gen_ai.response.finish_reasons"] == ["tool_calls"], span["name"]
        assert a["gen_ai.usage.output_tokens"] == done.usage.completion_tokens > 0, span["name"]
        assert a["gen_ai.usage.input_tokens"] == done.usage.prompt_tokens > 0, span["name"]
    assert gateway["kind"] == 2 and worker["kind"] == 1 and prepare["kind"] == 5  # SERVER, INTERNAL, CONSUMER
    assert route["attributes"]["gen_ai.response.model"] == model
    assert screen["attributes"]["tokenstream.safety.blocked"] is False
    assert worker["attributes"]["messaging.destination.name"] == inference_topic(model).name
    t = tool["attributes"]
    assert (t["gen_ai.operation.name"], t["gen_ai.tool.name"], t["gen_ai.tool.call.id"]) == (
        "execute_tool",
        "web_fetch",
        call.id,
    )
