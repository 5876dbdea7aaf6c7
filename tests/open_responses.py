"""Validation against the Open Responses specification (spec version 2026-04-24), with the models that
`openresponses-types` generates from the specification's published OpenAPI document
(public/openapi/openapi.json of github openresponses/openresponses).

The specification covers messages, function calls and their outputs, reasoning and compaction. Items
and tools outside it (OpenAI's server tools: code_interpreter_call, file_search_call, mcp_call, ...) are
the provider's extensions; they are set aside here and checked by the official SDK's models instead
(tests/responses/test_responses.py `conforms`, `valid_event`).
"""

from __future__ import annotations

import enum
import inspect

import openresponses_types.types as spec

SPEC_ITEMS = {"message", "function_call", "function_call_output", "reasoning", "compaction"}


def _event_models() -> dict[str, type]:
    models = {}
    for name, cls in inspect.getmembers(spec, inspect.isclass):
        if name.endswith("StreamingEvent"):
            kind = cls.model_fields["type"].annotation
            if isinstance(kind, type) and issubclass(kind, enum.Enum):
                models.update({member.value: cls for member in kind})
    return models


EVENTS = _event_models()


def _within_spec(response: dict) -> dict:
    """The response with the provider's extension items and tools set aside (a tool choice forcing a server
    tool is, within the specification, a required call)."""
    choice = response["tool_choice"]
    if isinstance(choice, dict) and choice.get("type") not in ("function", "allowed_tools"):
        choice = "required"
    return dict(
        response,
        output=[i for i in response["output"] if i["type"] in SPEC_ITEMS],
        tools=[t for t in response["tools"] if t["type"] == "function"],
        tool_choice=choice,
    )


def response(body: dict) -> spec.ResponseResource:
    """A response object as the specification's ResponseResource (raises pydantic's ValidationError)."""
    return spec.ResponseResource.model_validate(_within_spec(body))


def ws_error(body: dict) -> spec.WebSocketErrorEvent:
    """A WebSocket mode error event as the specification's WebSocketErrorEvent (status, error, its code)."""
    return spec.WebSocketErrorEvent.model_validate({k: v for k, v in body.items() if k != "stream_id"})


def error(body: dict) -> spec.Error:
    """An HTTP error body's `error` object as the specification's Error (type, code, message, param)."""
    return spec.Error.model_validate(body["error"])


def event(body: dict) -> bool:
    """A streamed event validated against the specification's model of its type; False for an event type
    the specification does not define (a server tool's progress events), True when it validated."""
    model = EVENTS.get(body["type"])
    if model is None:
        return False
    if (
        body["type"] in ("response.output_item.added", "response.output_item.done")
        and body["item"]["type"] not in SPEC_ITEMS
    ):
        return False
    if "response" in body:
        body = dict(body, response=_within_spec(body["response"]))
    model.model_validate(body)
    return True


# The events of one code_interpreter_call item, in the order OpenAI streams them.
CODE_INTERPRETER_ITEM_EVENTS = [
    "response.output_item.added",
    "response.code_interpreter_call.in_progress",
    "response.code_interpreter_call_code.delta",
    "response.code_interpreter_call_code.done",
    "response.code_interpreter_call.interpreting",
    "response.code_interpreter_call.completed",
    "response.output_item.done",
]
