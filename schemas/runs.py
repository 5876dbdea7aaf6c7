"""Multi-step runs: a response whose model calls server tools goes on, step by step, as events.

A run is one `/v1/responses` request. Step 0 is the ChatRequest the gateway writes (its request id
is the run id); when a step's answer calls only server tools, the conversation processor waits for
their ToolResults (ts.tool.results, re-keyed by conversation), appends them to the history as tool
messages, writes each result in band to the run's tokens partition and prepares step k+1 under
`schemas.ids.step_request_id(run_id, k + 1)`. The last allowed step is forced to answer in text
(tool_choice "none"), so a run ends after at most `max_steps` inference requests.

`continues` is the one rule both sides apply: the conversation processor to decide whether to
prepare the next step, the gateway to know whether a step's Completion ends the response.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from schemas.structured import OutputSpec

if TYPE_CHECKING:
    from schemas.tokens import Completion

#: Tools the tool processor runs (tools/builtin); any other tool is a function the client answers.
SERVER_TOOLS = ("code_interpreter", "file_search", "web_fetch")
DEFAULT_MAX_STEPS = 8
#: A tool's output goes to the model cut to this many characters (the client gets all of it).
TOOL_MESSAGE_CHARS = 2000


class RunSpec(msgspec.Struct, kw_only=True, omit_defaults=True):
    """On a ChatRequest that starts a run: which of its tools are server tools, and how many steps."""

    server_tools: list[str] = msgspec.field(default_factory=list)
    max_steps: int = DEFAULT_MAX_STEPS
    # the response's `max_output_tokens`: all steps' answers together write at most this many tokens
    max_output_tokens: int | None = None
    # the response's `truncation`: "disabled" ends it (context_length_exceeded) where "auto" would drop
    # the oldest turns to fit the context
    truncation: str = "auto"
    # the response's `max_tool_calls`: at most this many server tool calls in the run (each step then
    # makes at most one; from step N on only the client's functions may be called)
    max_tool_calls: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.max_steps <= 64:
            raise ValueError("max_steps must be from 1 to 64")

    def continues(self, step: int, done: Completion, written: int) -> bool:
        """Whether the answer of step `step` is followed by step + 1 (its server calls' results);
        `written` is the tokens the answers of steps 0..step wrote together."""
        return (
            done.finish_reason == "tool_calls"
            and bool(done.tool_calls)
            and step + 1 < self.max_steps
            and all(c.function.name in self.server_tools for c in done.tool_calls)
            and self.tokens_left(written) != 0
        )

    def out_of_tokens(self, done: Completion, written: int) -> bool:
        """A step that would go on to its calls' results but the response's token budget is spent."""
        return (
            done.finish_reason == "tool_calls"
            and bool(done.tool_calls)
            and self.tokens_left(written) == 0
            and all(c.function.name in self.server_tools for c in done.tool_calls)
        )

    def tokens_left(self, written: int) -> int | None:
        """What the next step may still write (None: no budget for the whole response)."""
        return None if self.max_output_tokens is None else max(0, self.max_output_tokens - written)

    def output_for(self, step: int, output: OutputSpec) -> OutputSpec:
        """The output spec of step `step`: after step 0 the model chooses (a forced tool would loop),
        and the last allowed step must answer in text."""
        if step == 0:
            return output
        if step + 1 >= self.max_steps:
            return msgspec.structs.replace(output, tool_choice="none", tool_name=None, allowed=[])
        if self.max_tool_calls is not None and step >= self.max_tool_calls:  # one call a step: spent
            functions = [
                t.function.name for t in output.callable_tools if t.function.name not in self.server_tools
            ]
            if not functions:
                return msgspec.structs.replace(output, tool_choice="none", tool_name=None, allowed=[])
            return msgspec.structs.replace(output, tool_choice="auto", tool_name=None, allowed=functions)
        if output.tool_choice in ("function", "required"):
            return msgspec.structs.replace(output, tool_choice="auto", tool_name=None)
        return output
