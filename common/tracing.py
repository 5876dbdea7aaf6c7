"""OpenTelemetry spans for every hop of a request, one trace per request, parented through Kafka headers.

Each role wraps its handling of one event in `hop(...)`: a span whose parent is the `traceparent`
header of the record it read (`schemas.tracing.TraceContext`), and whose own id is the
`traceparent` of every event it writes, so the next hop's span is its child. The gateway's span
is the root (or the child of a client's W3C `traceparent` HTTP header).

Off by default, and then free: `hop` only makes the child context the roles always carried.
On when `TOKENSTREAM_TRACING` is `otlp` (or `console`, spans printed to stderr), or when the
standard `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set;
`TOKENSTREAM_TRACING=off` or `OTEL_SDK_DISABLED=true` keeps it off. The rest is the SDK's own
standard configuration: OTLP over HTTP/protobuf (`OTEL_EXPORTER_OTLP_*` endpoint, headers, timeout,
compression), `OTEL_SERVICE_NAME` (default `tokenstream-<role>`), `OTEL_RESOURCE_ATTRIBUTES`,
`OTEL_TRACES_SAMPLER` / `_ARG` (default: parent-based, always on) and `OTEL_BSP_*` (the batch
exporter runs in a thread of its own; spans leave every `OTEL_BSP_SCHEDULE_DELAY` ms).

Attributes follow the OpenTelemetry GenAI semantic conventions (`gen_ai.operation.name`,
`gen_ai.provider.name`, `gen_ai.request.*`, `gen_ai.response.*`, `gen_ai.usage.*`,
`gen_ai.conversation.id`, `gen_ai.tool.*`) and the messaging ones for the Kafka record a hop
consumed (`messaging.*`); `tokenstream.hop` names the role, `tokenstream.request_id` the request.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from typing import Any, Self

from schemas import ChatRequest, Completion, InferenceRequest, ToolCall, TraceContext

log = logging.getLogger(__name__)

PROVIDER = "tokenstream"  # gen_ai.provider.name: the system serving the model
_state: dict[str, Any] = {"tracer": None, "provider": None}
_lock = threading.Lock()


def wanted(env: dict[str, str] | None = None) -> str | None:
    """The exporter the environment asks for: "otlp", "console", or None (tracing off)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    choice = env.get("TOKENSTREAM_TRACING", "").strip().lower()
    if choice in ("off", "none", "false", "0"):
        return None
    if choice in ("otlp", "console"):
        return choice
    if choice:
        raise ValueError(f"TOKENSTREAM_TRACING={choice!r}: give otlp, console or off")
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return "otlp"
    return None


def setup(role: str, exporter=None) -> bool:
    """Start exporting this process's spans when the environment asks for it (or to `exporter`, an SDK
    SpanExporter, e.g. the in-memory one of a test). Returns whether tracing is on. Idempotent."""
    kind = "given" if exporter is not None else wanted()
    if kind is None:
        return False
    with _lock:
        if _state["tracer"] is not None:
            return True
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        if exporter is None and kind == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        elif exporter is None:
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporter = ConsoleSpanExporter()
        attributes = {"tokenstream.role": role}
        if not os.environ.get("OTEL_SERVICE_NAME"):
            attributes[SERVICE_NAME] = f"tokenstream-{role}"
        provider = TracerProvider(resource=Resource.create(attributes))  # sampler: OTEL_TRACES_SAMPLER
        processor = SimpleSpanProcessor(exporter) if kind == "given" else BatchSpanProcessor(exporter)
        provider.add_span_processor(processor)
        _state["provider"] = provider
        _state["tracer"] = provider.get_tracer("tokenstream")
    log.info("tracing on: %s spans of %s", kind, role)
    return True


def enabled() -> bool:
    return _state["tracer"] is not None


def shutdown() -> None:
    """Export what is pending and stop (the SDK also does this at a normal interpreter exit)."""
    with _lock:
        provider, _state["provider"], _state["tracer"] = _state["provider"], None, None
    if provider is not None:
        provider.shutdown()


class Hop:
    """One role's handling of one event. `trace` is the context to write on the events it emits."""

    __slots__ = ("span", "trace")

    def __init__(self, trace: TraceContext, span=None) -> None:
        self.trace = trace
        self.span = span

    def set(self, attributes: dict[str, Any]) -> Hop:
        if self.span is not None:
            self.span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        return self

    def fail(self, error: str, kind: str = "error") -> None:
        """Mark the hop failed (`error.type`, span status ERROR)."""
        if self.span is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_attribute("error.type", kind)
            self.span.set_status(Status(StatusCode.ERROR, error))

    def end(self) -> None:
        if self.span is not None:
            span, self.span = self.span, None
            span.end()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if exc is not None and self.span is not None:
            self.span.record_exception(exc)
            self.fail(str(exc) or type(exc).__name__, type(exc).__name__)
        self.end()


def hop(
    name: str,
    parent: TraceContext | None,
    *,
    role: str,
    kind: str = "consumer",
    attributes: dict[str, Any] | None = None,
) -> Hop:
    """Start the span of one hop under `parent` (None: a new trace). kind: server | consumer | internal."""
    tracer = _state["tracer"]
    if tracer is None:
        return Hop((parent or TraceContext.new()).child())
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

    context = None
    if parent is not None:
        remote = SpanContext(
            int(parent.trace_id, 16),
            int(parent.span_id, 16),
            is_remote=True,
            trace_flags=TraceFlags(int(parent.flags, 16)),
        )
        context = trace.set_span_in_context(NonRecordingSpan(remote))
    attrs = {"tokenstream.hop": role, **{k: v for k, v in (attributes or {}).items() if v is not None}}
    span = tracer.start_span(name, context=context, kind=getattr(SpanKind, kind.upper()), attributes=attrs)
    own = span.get_span_context()
    return Hop(
        TraceContext(f"{own.trace_id:032x}", f"{own.span_id:016x}", f"{int(own.trace_flags):02x}"), span
    )


# ---------------------------------------------------------------- GenAI attributes of the events


def request_attributes(request: ChatRequest | InferenceRequest) -> dict[str, Any]:
    """A chat request as the GenAI conventions name it (the request id is the response's id)."""
    s = request.sampling
    return {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": request.model,
        "gen_ai.request.max_tokens": s.max_tokens,
        "gen_ai.request.temperature": s.temperature,
        "gen_ai.request.top_p": s.top_p,
        "gen_ai.request.seed": s.seed,
        "gen_ai.request.stop_sequences": list(s.stop) or None,
        "gen_ai.response.id": request.request_id,
        "gen_ai.conversation.id": request.conversation_id or None,
        "tokenstream.request_id": request.request_id,
        "tokenstream.tenant": request.tenant or None,
    }


def completion_attributes(done: Completion, model: str | None = None) -> dict[str, Any]:
    return {
        "gen_ai.response.id": done.request_id,
        "gen_ai.response.model": model,
        "gen_ai.response.finish_reasons": [done.finish_reason],
        "gen_ai.usage.input_tokens": done.usage.prompt_tokens,
        "gen_ai.usage.output_tokens": done.usage.completion_tokens,
        "tokenstream.usage.cached_tokens": done.usage.cached_tokens or None,
        "tokenstream.timings.pipeline_s": done.timings.pipeline_s,
        "tokenstream.timings.queue_s": done.timings.queue_s,
        "tokenstream.timings.prefill_s": done.timings.prefill_s,
        "tokenstream.timings.decode_s": done.timings.decode_s,
    }


TOOL_TYPES = {"file_search": "datastore"}  # server tools: "extension"; client functions: "function"


def tool_attributes(call: ToolCall) -> dict[str, Any]:
    return {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.tool.name": call.name,
        "gen_ai.tool.call.id": call.call_id,
        "gen_ai.tool.type": TOOL_TYPES.get(call.name, "extension"),
        "gen_ai.conversation.id": call.conversation_id or None,
        "tokenstream.request_id": call.request_id,
    }


def record_attributes(topic: str, partition: int, offset: int, group: str | None = None) -> dict[str, Any]:
    """The Kafka record a hop consumed (messaging semantic conventions)."""
    return {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.destination.name": topic,
        "messaging.destination.partition.id": str(partition),
        "messaging.kafka.offset": offset,
        "messaging.consumer.group.name": group,
    }


def parent_of(headers: Iterable[tuple[str, bytes]] | dict | None) -> TraceContext | None:
    """The trace context a record carries (faust gives headers as a dict or a list of pairs)."""
    items = headers.items() if isinstance(headers, dict) else headers
    return TraceContext.from_headers(list(items or ()))
