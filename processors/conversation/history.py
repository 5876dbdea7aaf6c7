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
    """The history after an answer: its text appended, or the unanswered user turn removed."""
    if completion.text:
        return [*messages, ChatMessage(role="assistant", content=completion.text)]
    if messages and messages[-1].role == "user":
        return messages[:-1]
    return messages


def bounded(messages: list[ChatMessage], most: int) -> list[ChatMessage]:
    """Keep system messages and the newest `most` others, so a table row never grows without bound."""
    system = [m for m in messages if m.role == "system"]
    rest = [m for m in messages if m.role != "system"]
    return [*system, *rest[-most:]]
