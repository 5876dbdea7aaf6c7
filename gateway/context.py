"""Refusing, before anything is queued, what cannot fit the model's context window.

The context comes from `common.models.context_length` (the figure the conversation processor
trims to and the worker enforces). The processor keeps what fits by dropping older turns; what it
cannot fix is the newest message alone (with the system prompt and the tools the worker renders
into it, schemas/prompt.py) being too long, or `max_tokens` beyond the context: those are refused
here with 400 instead of travelling the pipeline to an error. Counting tokens costs a tokenizer
pass, so it runs only when the byte length cannot rule it out.
"""

from __future__ import annotations

import asyncio
from functools import lru_cache

from common.models import context_length, load_tokenizer, prompt_budget, tokens_at_most
from gateway import openai_api as api
from schemas import ChatMessage, OutputSpec
from schemas.prompt import instructions, prompt_ids


@lru_cache(maxsize=64)
def window(model: str) -> int | None:
    try:
        return context_length(model)
    except (OSError, ValueError):
        return None


@lru_cache(maxsize=64)
def vocabulary(model: str) -> int | None:
    """How many token ids the model's tokenizer has (None for a model this gateway has no files for)."""
    try:
        return len(load_tokenizer(model))
    except (OSError, ValueError):
        return None


def _count(model: str, messages: list[ChatMessage], output: OutputSpec) -> int:
    return len(prompt_ids(load_tokenizer(model), messages, output))


async def check(
    model: str,
    messages: list[ChatMessage],
    max_tokens: int,
    max_tokens_param: str,
    output: OutputSpec | None = None,
) -> None:
    """Raise a 400 when `max_tokens`, or the newest message with the system prompt and tools, cannot fit."""
    output = output or OutputSpec()
    context = window(model)
    if context is None:
        return  # a model this gateway has no files for: the processor and the worker decide
    if max_tokens > context:
        raise api.APIError(
            400,
            f"{max_tokens_param} is too large: {max_tokens}. This model's context holds "
            f"{context} tokens, prompt and answer together.",
            "invalid_request_error",
            param=max_tokens_param,
            code="invalid_value",
        )
    budget = prompt_budget(context, max_tokens)
    kept = [m for m in messages if m.role == "system"] + [messages[-1]]
    # the tools and response format are written into the prompt as this text: its bytes bound its tokens too
    if tokens_at_most([m.content for m in kept] + [instructions(output)]) <= budget:
        return
    tokens = await asyncio.to_thread(_count, model, kept, output)
    if tokens > budget:
        with_tools = " and the tools" if output.callable_tools else ""
        raise api.APIError(
            400,
            f"This model's maximum context length is {context} tokens. However, the newest "
            f"message with the system prompt{with_tools} takes {tokens} tokens and the answer "
            f"{min(max_tokens, context // 2)}. Please shorten the message.",
            "invalid_request_error",
            param="messages",
            code="context_length_exceeded",
        )


async def check_whole(
    model: str,
    messages: list[ChatMessage],
    max_tokens: int,
    output: OutputSpec | None = None,
    param: str = "input",
) -> None:
    """With truncation disabled: a 400 when the whole prompt (every message, the tools) cannot fit beside the
    answer's room; nothing is dropped to make it fit. Models this gateway has no files for are left to the
    conversation processor, which refuses the same way."""
    output = output or OutputSpec()
    context = window(model)
    if context is None:
        return
    budget = prompt_budget(context, max_tokens)
    if tokens_at_most([m.content for m in messages] + [instructions(output)]) <= budget:
        return
    tokens = await asyncio.to_thread(_count, model, messages, output)
    if tokens > budget:
        raise api.APIError(
            400,
            f"The input takes {tokens} tokens; with the answer's room this model's context holds "
            f'{budget}. Shorten it, or send truncation "auto" to drop the oldest items.',
            "invalid_request_error",
            param=param,
            code="context_length_exceeded",
        )
