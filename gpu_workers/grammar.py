"""Grammar-constrained decoding with llguidance: what a request's OutputSpec allows, as a token mask.

    OutputSpec --grammar_text--> Lark grammar --compile (thread pool, time limit, cache)--> LLMatcher
    per request: a deep copy of the cached matcher (its own parser state) in `Sequence.grammar`
    per step:    mask_rows(logits, seqs)  (one bitmask for every constrained row, filled in parallel)
    per token:   advance(seq, token)

Calls are written in one documented format (also how tools are described to the model, see
schemas/prompt.py):

    <tool_call>{"name": "NAME", "arguments": {...}}</tool_call>

`required` and a named choice allow only calls; `auto` allows either text (that never contains
"<tool_call>") or calls, so the model chooses with its first tokens and a call, once begun, is
forced to completion; `parallel_tool_calls: false` and a named choice allow exactly one call, and
otherwise at most `max_calls` (worker option max_parallel_calls, default 2: a small model tends
to repeat one call until max_tokens, leaving the last one cut).
`none` with tools allows only text that writes no call. Arguments follow the tool's JSON schema
(a tool without parameters gets `{}`). `response_format` json_object / json_schema allow one JSON
value of that schema.

Compilation runs in a small thread pool off the step loop, bounded by a wall-clock limit and by
llguidance's own parser limits (grammar size, lexer fuel, Earley items per step), so no schema can
stall the batch: a request whose grammar does not compile in time, or at all, ends with an error.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from schemas import OutputSpec
from schemas.prompt import CALL_CLOSE, CALL_OPEN
from schemas.structured import schema_key

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
EMPTY_OBJECT = {"type": "object", "properties": {}, "additionalProperties": False}
# values not walked by closed(): literals, and allOf (closing its parts would change the intersection)
KEPT_AS_IS = {"enum", "const", "default", "examples", "description", "title", "pattern", "format", "allOf"}
TEXT = f"TEXT: /(.|\\n)+/ & ~/(.|\\n)*{CALL_OPEN}(.|\\n)*/"  # any text that does not write a call
MAX_PARALLEL_CALLS = 2  # default calls in one answer when parallel calls are allowed (a small model repeats)


class GrammarError(Exception):
    """The request's grammar cannot be used: invalid, too large, or not compiled in time."""


def closed(schema):
    """`schema` with additionalProperties false wherever an object schema leaves it open.

    The answer still validates against the client's schema (it only omits extra keys); a small
    model is kept from inventing keys, as OpenAI's strict mode does."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in KEPT_AS_IS else closed(v) for k, v in schema.items()}
    combined = any(k in out for k in ("allOf", "anyOf", "oneOf", "$ref"))  # closing would change its meaning
    if "properties" in out and "additionalProperties" not in out and not combined:
        out["additionalProperties"] = False
    return out


def _json(schema: dict) -> str:
    schema = closed(schema)
    schema["x-guidance"] = {**JSON_OPTIONS, **schema.get("x-guidance", {})}
    return json.dumps(schema, separators=(",", ":"))


def grammar_text(spec: OutputSpec, max_calls: int = MAX_PARALLEL_CALLS) -> str | None:
    """The Lark grammar of what `spec` allows, or None when the answer is free text."""
    tools = spec.callable_tools
    if not tools:
        if spec.response_format == "text" and spec.tools:  # tool_choice none: text that calls nothing
            return f"start: TEXT\n{TEXT}\n"
        if spec.response_format == "json_object":
            return f"start: %json {_json({'type': 'object'})}\n"
        if spec.response_format == "json_schema":
            return f"start: %json {_json(spec.json_schema or {})}\n"
        return None
    lines = []
    alternatives = []
    for i, tool in enumerate(tools):
        fn = tool.function
        prefix = json.dumps(f'{{"name": "{fn.name}", "arguments": ')
        lines.append(f'f{i}: {prefix} a{i} "}}"')
        lines.append(f"a{i}: %json {_json(fn.parameters or EMPTY_OBJECT)}")
        alternatives.append(f"f{i}")
    call = f'call: "{CALL_OPEN}" ({" | ".join(alternatives)}) "{CALL_CLOSE}"'
    parallel = spec.parallel_tool_calls and spec.tool_choice != "function"  # a named choice: one call
    calls = f'calls: call ("\\n" call){{0,{max_calls - 1}}}' if parallel and max_calls > 1 else "calls: call"
    if spec.tool_choice == "auto":
        text = f"start: TEXT | calls\n{TEXT}\n"
        if spec.response_format != "text":  # auto with a JSON answer: JSON or calls
            answer = {"type": "object"} if spec.response_format == "json_object" else spec.json_schema or {}
            text = f"start: answer | calls\nanswer: %json {_json(answer)}\n"
    else:
        text = "start: calls\n"
    return text + "\n".join([calls, call, *lines]) + "\n"


def stop_scope(spec: OutputSpec) -> str:
    """Where a request's stop strings apply: never inside what the grammar forces.

    "all": the answer is free text (tool_choice none); "text": free text unless the model opens a
    call with its first characters (auto); "none": the answer is calls or JSON the grammar forces
    (required, a named choice, json_object, json_schema), which a stop string would cut into an
    invalid call or document. The same rule as vLLM's for reasoning (stops apply to content only).
    """
    if spec.callable_tools:
        return "text" if spec.tool_choice == "auto" and spec.response_format == "text" else "none"
    return "all" if spec.response_format == "text" else "none"


class GrammarState:
    """One request's position in its grammar."""

    def __init__(
        self, owner: Grammars, matcher: llguidance.LLMatcher, stops: str = "all", text: str = ""
    ) -> None:
        self.owner = owner
        self.text = text  # the llguidance (lark) grammar: what a backend with its own structured outputs runs
        self.matcher = matcher
        self.stops = stops  # stop_scope of its spec
        self.error: str | None = None

    def stop_region(self, text: str) -> str | None:
        """The part of the answer `text` stop strings apply to; None while that is not known yet (auto:
        text that could still become the opening of a call)."""
        if self.stops == "all":
            return text
        if self.stops == "none" or text.startswith(CALL_OPEN):
            return ""
        return None if CALL_OPEN.startswith(text) else text

    def advance(self, token: int) -> None:
        if self.error is None and not self.matcher.consume_token(token):
            self.error = "generated token rejected by the grammar: " + self.matcher.get_error()[:300]


class Grammars:
    """Compiles and caches grammars for one tokenizer; fills and applies the masks of a batch."""

    def __init__(
        self,
        tokenizer,
        eos_ids: set[int],
        *,
        timeout_s: float = 5.0,
        cache_size: int = 256,
        threads: int = 2,
        max_calls: int = MAX_PARALLEL_CALLS,
        limits: llguidance.LLParserLimits | None = None,
    ) -> None:
        self.max_calls = max_calls
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=sorted(eos_ids) or None)
        self.vocab = self.tokenizer.vocab_size
        self.eos_ids = sorted(e for e in eos_ids if e < self.vocab)
        self.timeout_s = timeout_s
        self.limits = limits or llguidance.LLParserLimits(verbose_errors=False)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.cache: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self.cache_size = cache_size
        self.lock = threading.Lock()
        self.compile_seconds: list[float] = []  # the latest compile durations (for metrics and bench)
        self.bits = torch.arange(32, dtype=torch.int32)

    def compile_now(self, grammar: str) -> llguidance.LLMatcher:
        """A pristine matcher for `grammar` (cached by its hash); GrammarError when unusable."""
        key = schema_key(grammar)
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(matcher.get_error().splitlines()[0][:300])
        self.compile_seconds = [*self.compile_seconds[-999:], time.perf_counter() - started]
        with self.lock:
            self.cache[key] = matcher
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return matcher

    async def state_for(self, spec: OutputSpec, consumed: list[int] = ()) -> GrammarState | None:
        """The grammar state of a new request (None: unconstrained), after the tokens it already has.

        Compiles in the pool; waiting longer than the time limit raises GrammarError (the compile
        finishes in its thread and is cached, but this request has ended)."""
        text = grammar_text(spec, self.max_calls)
        if text is None:
            return None
        future = asyncio.get_running_loop().run_in_executor(self.pool, self.compile_now, text)
        try:
            matcher = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            raise GrammarError(
                f"the output grammar did not compile within {self.timeout_s:g} s (simplify the schema)"
            ) from None
        state = GrammarState(self, matcher.deep_copy(), stop_scope(spec), text)
        if consumed and not state.matcher.consume_tokens(list(consumed)):
            raise GrammarError(
                "the tokens already generated do not fit the grammar: " + state.matcher.get_error()[:300]
            )
        return state

    def mask(self, logits: torch.Tensor, states: list[GrammarState | None]) -> None:
        """Set to -inf, in place, every logit a row's grammar forbids (rows with None are free).

        A row whose grammar failed may only end (EOS); the caller reports its `error`."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return
        bitmask = torch.zeros(len(rows), (self.vocab + 31) // 32, dtype=torch.int32)
        llguidance.torch.fill_next_token_bitmask_par(
            self.executor, [(states[i].matcher, j) for j, i in enumerate(rows)], bitmask
        )
        allowed = ((bitmask.unsqueeze(-1) >> self.bits) & 1).bool().view(len(rows), -1)
        for j, i in enumerate(rows):
            state = states[i]
            if state.error is None and state.matcher.is_error():
                state.error = "grammar failed: " + state.matcher.get_error()[:300]
            if state.error is not None:
                allowed[j] = False
                allowed[j, self.eos_ids] = True
        width = logits.shape[-1]
        if allowed.shape[1] < width:
            allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]))
        index = torch.tensor(rows, device=logits.device)
        sub = logits.index_select(0, index)
        sub.masked_fill_(~allowed[:, :width].to(logits.device), float("-inf"))
        logits.index_copy_(0, index, sub)


def mask_rows(logits: torch.Tensor, seqs) -> None:
    """Engine hook, before sampling: mask every constrained row of `logits` ([len(seqs), V])."""
    states = [s.grammar for s in seqs]
    first = next((s for s in states if s is not None), None)
    if first is not None:
        first.owner.mask(logits, states)


def advance(seq, token: int) -> None:
    """Engine hook, after sampling: move the request's grammar past `token`."""
    if seq.grammar is not None:
        seq.grammar.advance(token)
