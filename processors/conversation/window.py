"""Fitting a conversation into the model's context window, counted with the model's own tokenizer."""

from __future__ import annotations

from collections.abc import Callable

from common.models import tokens_at_most
from schemas import ChatMessage, OutputSpec
from schemas.prompt import instructions, prompt_ids


class PromptTooLong(ValueError):
    """Even the newest message alone (with the system messages and the tools) does not fit."""


def prompt_counter(tokenizer, output: OutputSpec) -> Callable[[list[ChatMessage]], int]:
    """Tokens of the prompt exactly as the worker will render it (schemas.prompt: the tools and the
    response format written into the system message, earlier calls, the chat template and the
    generation prompt)."""

    def count(messages: list[ChatMessage]) -> int:
        return len(prompt_ids(tokenizer, messages, output))

    return count


def trim(
    messages: list[ChatMessage],
    count: Callable[[list[ChatMessage]], int],
    budget: int,
    output: OutputSpec | None = None,
) -> tuple[list[ChatMessage], int]:
    """Drop the oldest turns until the prompt takes at most `budget` tokens.

    System messages and the newest message always stay; the kept part starts with a user
    turn. Returns the kept messages and how many were dropped. Binary search over the cut,
    since the count only falls as more is dropped. A prompt whose byte length already proves it
    fits is not counted (a chat-template pass costs milliseconds on every request): the contents
    and the tools' and format's instructions (`output`), as long as no earlier call is rendered.
    """
    rendered = instructions(output) if output is not None else ""
    if (
        not any(m.tool_calls for m in messages)
        and tokens_at_most([m.content for m in messages] + [rendered]) <= budget
    ):
        return list(messages), 0
    system = [m for m in messages if m.role == "system"]
    rest = [m for m in messages if m.role != "system"]
    if count(messages) <= budget:
        return list(messages), 0
    low, high = 1, len(rest) - 1  # drop rest[:cut]; cut=len(rest)-1 keeps only the newest message
    if high < low or count([*system, rest[-1]]) > budget:
        raise PromptTooLong(
            f"the newest message alone, with the system messages and the tools rendered into "
            f"the prompt, exceeds the {budget}-token budget"
        )
    while low < high:
        mid = (low + high) // 2
        if count([*system, *rest[mid:]]) <= budget:
            high = mid
        else:
            low = mid + 1
    cut = low
    while cut < len(rest) - 1 and rest[cut].role != "user":
        cut += 1
    return [*system, *rest[cut:]], cut
