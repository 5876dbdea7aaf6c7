"""The documented chat-completion fields tokenstream does not honour, and what is not documented at all:
each is a 400 naming it, never accepted without effect.

A field sent at its neutral value (null, `modalities: ["text"]`, `service_tier: "auto"`) asks for
nothing and passes: clients that echo every field with its default work unchanged. Anything else
named here would change the answer in a way this server cannot give, so the client hears so instead
of getting an answer that silently ignored it.

Honoured elsewhere (gateway/openai_api.py, gateway/routes/chat.py): model, messages (text parts),
stream, stream_options.include_usage, temperature, top_p, max_tokens, max_completion_tokens, stop,
seed, n (1), user, safety_identifier (recorded as the request's user), presence_penalty,
frequency_penalty, logit_bias, logprobs, top_logprobs, tools, tool_choice, parallel_tool_calls,
response_format, store and metadata (stored completions, gateway/stored_chats.py), prompt_cache_key
(the router's placement, processors/router/prefixes.py), and the extensions
conversation_id, assistant, cache, stream_interval and stream_interval_ms (the worker's stream interval,
gpu_workers/streaming.py; out of range: a 400 naming the field, as for every declared field).
"""

from __future__ import annotations

from typing import Any

from gateway import openai_api as api

# field -> (is the value neutral?, why it cannot be honoured)
_REFUSED: dict[str, tuple[Any, str]] = {
    "audio": (lambda v: v is None, "audio output is not offered: the model writes text only"),
    "modalities": (
        lambda v: v is None or v == ["text"],
        'the model writes text only: modalities may be ["text"]',
    ),
    "prediction": (lambda v: v is None, "Predicted Outputs are not supported"),
    "reasoning_effort": (
        lambda v: v is None,
        "the model does not reason before it answers: reasoning_effort would have no effect",
    ),
    "verbosity": (
        lambda v: v is None,
        "verbosity is not supported: bound the answer with max_completion_tokens",
    ),
    "web_search_options": (
        lambda v: v is None,
        'web search runs as a server tool of POST /v1/responses (tools: [{"type": "web_search"}])',
    ),
    "functions": (lambda v: v is None, "the legacy `functions` are not supported: send them as `tools`"),
    "function_call": (lambda v: v is None, "the legacy `function_call` is not supported: send `tool_choice`"),
    "service_tier": (
        lambda v: v in (None, "auto", "default"),
        'the service tier follows the API key\'s tier: service_tier may be "auto" or "default"',
    ),
}

# fields of a message other than those gateway.openai_api.Message honours, neutral only when null
_MESSAGE_NULL_ONLY = {"refusal", "audio", "function_call", "annotations"}


def refuse_unhonoured(body: api.ChatCompletionRequest) -> None:
    """Raise a 400 naming the first field of `body` that asks for something this server cannot give."""
    extra = body.model_extra or {}
    for name, value in extra.items():
        rule = _REFUSED.get(name)
        if rule is None:
            if value is not None:
                raise api.invalid_request(f"Unrecognized request argument supplied: {name}", name)
        elif not rule[0](value):
            raise api.invalid_request(f"{name}: {rule[1]}.", name)
    options = (body.stream_options.model_extra or {}) if body.stream_options else {}
    for name, value in options.items():
        if name == "include_obfuscation" and value in (None, False):
            continue  # this server never pads its chunks
        if value is not None:
            raise api.invalid_request(f"stream_options.{name} is not supported", f"stream_options.{name}")
    for i, message in enumerate(body.messages):
        for name, value in (message.model_extra or {}).items():
            if value is not None:
                why = "is not supported" if name in _MESSAGE_NULL_ONLY else "is not a field of a message"
                raise api.invalid_request(f"messages[{i}].{name} {why}", f"messages[{i}].{name}")
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type != "text":
                    raise api.invalid_request(
                        f"messages[{i}].content[{j}]: `{part.type}` parts are not supported: the model reads "
                        "text only",
                        f"messages[{i}].content[{j}].type",
                    )
                if part.text is None:
                    raise api.invalid_request(
                        f"messages[{i}].content[{j}].text is required", f"messages[{i}].content[{j}].text"
                    )
                if part.model_extra:
                    name = next(iter(part.model_extra))
                    raise api.invalid_request(
                        f"messages[{i}].content[{j}].{name} is not supported",
                        f"messages[{i}].content[{j}].{name}",
                    )
