"""The model's text of a request with tools -> content text and streamed tool-call deltas.

The grammar (gpu_workers/grammar.py) guarantees the text is either free text that never contains
"<tool_call>", or calls in exactly this form, separated by newlines:

    <tool_call>{"name": "NAME", "arguments": {...}}</tool_call>

so a character-level state machine suffices: no partial-JSON guessing. Arguments stream as they
are generated (their end is where the JSON object's braces balance, strings and escapes
respected). Fed the same text in any split, it returns the same deltas: a worker taking a request
over replays the text already emitted (discarding the output) and continues identically.
"""

from __future__ import annotations

from gpu_workers.grammar import CALL_OPEN
from schemas import FunctionCall, MessageToolCall, ToolCallDelta, call_id

NAME_PREFIX = CALL_OPEN + '{"name": "'
ARGS_PREFIX = '", "arguments": '
CALL_SUFFIX = "}</tool_call>"


class ToolCallParser:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.mode = "start"  # start | text | literal | name | args | between
        self.pending = ""  # undecided text at the start, or literal text being matched
        self.expect = ""  # the literal the text must match now
        self.after = ""  # the mode once the literal is matched
        self.content: list[str] = []
        self.calls: list[MessageToolCall] = []
        self._name: list[str] = []
        self._depth = 0
        self._in_string = False
        self._escape = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """New content text and call deltas for the next piece of the model's text."""
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        for ch in text:
            self._char(ch, content, deltas)
        out = "".join(content)
        self.content.append(out)
        return out, deltas

    def _char(self, ch: str, content: list[str], deltas: list[ToolCallDelta]) -> None:
        if self.mode == "text":
            content.append(ch)
        elif self.mode == "start":
            self.pending += ch
            if self.pending == NAME_PREFIX:
                self.pending, self.mode = "", "name"
            elif not NAME_PREFIX.startswith(self.pending):
                self.mode = "text"
                content.append(self.pending)
                self.pending = ""
        elif self.mode == "between":  # after a call: a newline, then the next call
            if ch != "\n":
                self._literal(NAME_PREFIX, "name")
                self._char(ch, content, deltas)
        elif self.mode == "literal":
            self.pending += ch
            if self.pending == self.expect:
                self.pending, self.mode = "", self.after
            elif not self.expect.startswith(self.pending):
                raise ValueError(f"unexpected text in a tool call: {self.pending!r}")
        elif self.mode == "name":
            if ch != '"':
                self._name.append(ch)
                return
            index = len(self.calls)
            name = "".join(self._name)
            self.calls.append(
                MessageToolCall(
                    id=call_id(self.request_id, index), function=FunctionCall(name=name, arguments="")
                )
            )
            deltas.append(ToolCallDelta(index=index, id=self.calls[-1].id, name=name, arguments=""))
            self._name = []
            self._literal(ARGS_PREFIX[1:], "args")
        elif self.mode == "args":
            self._args(ch, deltas)

    def _literal(self, expect: str, after: str) -> None:
        self.mode, self.expect, self.after, self.pending = "literal", expect, after, ""

    def _args(self, ch: str, deltas: list[ToolCallDelta]) -> None:
        call = self.calls[-1]
        call.function.arguments += ch
        index = len(self.calls) - 1
        if deltas and deltas[-1].index == index and not deltas[-1].id:
            deltas[-1].arguments += ch
        else:
            deltas.append(ToolCallDelta(index=index, arguments=ch))
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._literal(CALL_SUFFIX, "between")

    @property
    def text(self) -> str:
        return "".join(self.content)
