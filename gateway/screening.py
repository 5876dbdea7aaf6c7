"""Holding an answer back until its input verdict (parallel screening, see `schemas.Screening`).

The request is generated while safety judges its input, so its first tokens may reach the tokens
partition before the verdict. Nothing is passed on until the input verdict arrives in band: a pass
releases what was held and everything after it; a block discards it and ends the answer with the
refusal and `content_filter`, so no generated token ever reaches the client. The same events give
the same output live and on a resume from the log (the refusal always has positions 0 and 1).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from schemas import REFUSAL, Completion, Event, SafetyVerdict, TokenChunk


def refusal(verdict: SafetyVerdict) -> list[Event]:
    ids = dict(request_id=verdict.request_id, conversation_id=verdict.conversation_id, tenant=verdict.tenant)
    return [
        TokenChunk(**ids, seq=0, text=REFUSAL),
        Completion(
            **ids,
            seq=1,
            finish_reason="content_filter",
            text=REFUSAL,
            error="input flagged: " + ", ".join(verdict.categories),
        ),
    ]


async def held_until_screened(source: AsyncIterator[list[Event]]) -> AsyncIterator[list[Event]]:
    """`source` with every event before the input verdict held back (see the module docstring).

    An error completion, or a blocking output verdict, before the input verdict ends the answer at
    once without the held text: that text was never judged as input.
    """
    held: list[Event] = []
    released = False
    try:
        async for batch in source:
            if released:
                yield batch
                continue
            for i, event in enumerate(batch):
                if isinstance(event, SafetyVerdict) and event.stage == "input":
                    if event.blocked:
                        yield refusal(event)
                        return
                    released = True
                    if held or batch[i + 1 :]:
                        yield held + batch[i + 1 :]
                    break
                if (isinstance(event, Completion) and event.finish_reason == "error") or (
                    isinstance(event, SafetyVerdict) and event.blocked
                ):
                    yield [event]
                    return
                held.append(event)
    finally:
        await source.aclose()  # type: ignore[attr-defined]
