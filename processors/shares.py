"""A step record's entries as an agent sees them: each entry a share of the one faust event the step
record arrived as (schemas/steps.py).

A share stands for the record its entry would have been on its own: its `key`, `value` and `headers`
(the entry's trace context among them) are the entry's; everything else (`.message`, `.app`, the
partition, offset and consumer generation a table write or an acknowledgement uses) is the step
record's faust event. Its `ack()` counts the entry as handled; the faust event itself is acknowledged
once, when the last of its entries is, so that a consumer never commits past an entry an agent holds
unacknowledged (the safety processor's rule: processors/safety/held.py).
"""

from __future__ import annotations

from faust.types import EventT

from schemas.steps import Unpacked


class _Step:
    """A step record's faust event and how many of its entries are not acknowledged yet."""

    __slots__ = ("event", "left")

    def __init__(self, event: EventT, entries: int) -> None:
        self.event, self.left = event, entries


class Share:
    """One entry of a step record, standing for the faust event to an agent (see the module's rule)."""

    __slots__ = ("__weakref__", "_step", "acked", "record")

    def __init__(self, step: _Step, record: Unpacked) -> None:
        self._step, self.record, self.acked = step, record, False

    @property
    def key(self) -> bytes:
        return self.record.key

    @property
    def value(self) -> bytes:
        return self.record.value

    @property
    def headers(self) -> list[tuple[str, bytes]]:
        return self.record.headers

    def __getattr__(self, name: str):  # what a share does not hold itself is its faust event's
        if name == "_step":
            raise AttributeError(name)
        return getattr(self._step.event, name)

    def ack(self) -> bool:
        """This entry is handled (a second ack counts nothing); acknowledges the step record's faust
        event when it is the last of its entries to be: what that acknowledgement returns, else False."""
        if self.acked:
            return False
        self.acked = True
        step = self._step
        step.left -= 1
        return step.event.ack() if step.left == 0 else False

    def __repr__(self) -> str:
        return f"<Share of {self._step.event!r}: k={self.key!r}>"


def shares(event: EventT, entries: list[Unpacked]) -> list[Share]:
    """One share of `event` per entry of its step record, in order."""
    step = _Step(event, len(entries))
    return [Share(step, entry) for entry in entries]


def headers_of(raw) -> list | dict:
    """The headers of the record `raw` (a faust event or a share) stands for."""
    return raw.headers if isinstance(raw, Share) else raw.message.headers
