"""How a request's messages and the stored history make the prompt (pure functions)."""

from __future__ import annotations

from schemas import ChatMessage, Completion


def carries_full_history(messages: list[ChatMessage]) -> bool:
    """OpenAI-style clients resend everything: any assistant turn, or several user turns, say so."""
    return any(m.role == "assistant" for m in messages) or sum(m.role == "user" for m in messages) > 1


def merge(history: list[ChatMessage], messages: list[ChatMessage]) -> list[ChatMessage]:
    """The conversation as the model should see it.

    A full history replaces what is stored. Otherwise the new turn is appended, and a
    system message in the request replaces the stored one.
    """
    if carries_full_history(messages) or not history:
        return list(messages)
    system = [m for m in messages if m.role == "system"] or [m for m in history if m.role == "system"]
    earlier = [m for m in history if m.role != "system"]
    return [*system, *earlier, *(m for m in messages if m.role != "system")]


def with_answer(messages: list[ChatMessage], completion: Completion) -> list[ChatMessage]:
    """The history after an answer: its text and calls appended, or the unanswered user turn removed."""
    if completion.text or completion.tool_calls:
        return [
            *messages,
            ChatMessage(role="assistant", content=completion.text, tool_calls=list(completion.tool_calls)),
        ]
    return without_unanswered(messages)


def without_unanswered(messages: list[ChatMessage]) -> list[ChatMessage]:
    """The history less a final user turn whose answer will not come."""
    if messages and messages[-1].role == "user":
        return messages[:-1]
    return messages


def bounded(messages: list[ChatMessage], most: int) -> list[ChatMessage]:
    """Keep system messages and the newest `most` others, so a table row never grows without bound."""
    system = [m for m in messages if m.role == "system"]
    rest = [m for m in messages if m.role != "system"]
    return [*system, *rest[-most:]]


def unmatched_tool_message(messages: list[ChatMessage]) -> str | None:
    """The tool_call_id of the first `tool` message no earlier assistant call asked for, if any."""
    made: set[str] = set()
    for m in messages:
        made.update(c.id for c in m.tool_calls)
        if m.role == "tool" and m.tool_call_id not in made:
            return m.tool_call_id or ""
    return None
