"""Stop sequences on decoded text, and the text that is safe to stream.

Text that could still become a stop string is held back: with stop "###", "ab#" streams
"ab" and keeps "#" until the next token shows whether "##..." follows. A trailing U+FFFD
(an incomplete UTF-8 character split over tokens) is held back too.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, start: int = 0) -> int | None:
        """Index in `text` of the earliest stop string beginning at or after `start - longest + 1`."""
        best = None
        lo = max(0, start - self.longest + 1)
        for s in self.stops:
            i = text.find(s, lo)
            if i >= 0 and (best is None or i < best):
                best = i
        return best

    def safe_end(self, text: str) -> int:
        """How much of `text` may be streamed now (no stop string was found in it)."""
        end = len(text)
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, end), hold, -1):
                if text.endswith(s[:k], 0, end):
                    hold = k
                    break
        return end - hold
