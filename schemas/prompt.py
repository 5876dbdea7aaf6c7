"""The prompt of a request exactly as the worker feeds it to the model: shared by the worker (which
renders it) and the conversation processor (which trims history so that it fits the context).

SmolLM2's chat template only joins role and content (it has no `tools` support), and the call
format must be the one the grammar enforces, so every model gets one documented rendering, which
the chat template then wraps as usual:

- the system message (added when absent) ends with the tools, one JSON line each, inside
  <tools></tools>, and the call format the grammar enforces:
  <tool_call>{"name": ..., "arguments": {...}}</tool_call>
- an assistant message's calls are appended to its content in that same format;
- a `tool` message keeps its role and content (the template writes any role as is);
- a json_schema response format adds the schema the answer must follow.
"""

from __future__ import annotations

import json

from schemas.requests import ChatMessage
from schemas.structured import OutputSpec

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
DEFAULT_SYSTEM = "You are a helpful assistant."


def call_text(name: str, arguments: str) -> str:
    return f'{CALL_OPEN}{{"name": "{name}", "arguments": {arguments or "{}"}}}{CALL_CLOSE}'


def instructions(spec: OutputSpec) -> str:
    parts = []
    tools = spec.callable_tools
    if tools:
        lines = "\n".join(
            json.dumps(
                {
                    "name": t.function.name,
                    "description": t.function.description,
                    "parameters": t.function.parameters or {"type": "object", "properties": {}},
                }
            )
            for t in tools
        )
        parts.append(
            "Functions you can call:\n<tools>\n" + lines + "\n</tools>\n"
            f'Call one as {CALL_OPEN}{{"name": ..., "arguments": {{...}}}}{CALL_CLOSE}'
        )
    if spec.response_format == "json_schema":
        parts.append("Answer with JSON that follows this schema: " + json.dumps(spec.json_schema))
    elif spec.response_format == "json_object":
        parts.append("Answer with a JSON object.")
    return "\n\n".join(parts)


def render(messages: list[ChatMessage], spec: OutputSpec) -> list[dict]:
    """Messages as chat-template dicts (documented rendering; see the module docstring)."""
    out: list[dict] = []
    for m in messages:
        content = m.content
        if m.tool_calls:
            calls = "\n".join(call_text(c.function.name, c.function.arguments) for c in m.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": m.role, "content": content})
    extra = instructions(spec)
    if extra:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + extra}
        else:
            out.insert(0, {"role": "system", "content": DEFAULT_SYSTEM + "\n\n" + extra})
    return out


def prompt_ids(tokenizer, messages: list[ChatMessage], spec: OutputSpec) -> list[int]:
    """The token ids the model is fed: the rendering through the tokenizer's chat template (with the
    generation prompt), or the contents joined by newlines for a tokenizer without one."""
    rendered = render(messages, spec)
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if not isinstance(ids, list) else ids)
    return tokenizer("\n".join(m["content"] for m in rendered))["input_ids"]
