"""A response run's events (token chunks, completions and tool results of every step, in log order)
-> the Responses API's stream events, and the response object they build.

The fold is a function of the log alone: one event per token chunk (no coalescing), numbered by
`sequence_number` from 0, so a resume replays the run from the log and sends exactly the events
after the one the client saw (SSE id `<run id>:<sequence_number>`), on any gateway instance.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from schemas import Completion, Event, RunSpec, SafetyVerdict, TokenChunk, ToolCallDelta, ToolResult
from schemas import keys as K
from schemas.ids import response_id, step_request_id
from schemas.tools import notebook_logs

IMAGE_TYPES = (".png", ".jpg", ".jpeg", ".gif")  # a code interpreter's files shown as image outputs

ITEM_PREFIX = {"code_interpreter": "ci_", "file_search": "fs_", "web_fetch": "ws_"}
ITEM_TYPE = {
    "code_interpreter": "code_interpreter_call",
    "file_search": "file_search_call",
    "web_fetch": "web_search_call",
}


def base_response(run_id: str, created: int, model: str, params: dict[str, Any]) -> dict[str, Any]:
    """The response object before any output (params: the request fields it echoes)."""
    return {
        "id": response_id(run_id),
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "model": model,
        "output": [],
        "usage": None,
        "reasoning": {"effort": None, "summary": None},
        "truncation": "auto",
        "completed_at": None,
        # fields the Open Responses object requires, at the values this server runs with
        "top_logprobs": 0,
        "max_tool_calls": None,
        "background": False,
        "service_tier": "default",
        "prompt_cache_key": None,
        **params,
    }


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    """A client function's call as an output (or conversation) item."""
    return {
        "id": f"fc_{call_id}",
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def usage_of(prompt: int, completion: int, cached: int, written: int) -> dict[str, Any]:
    """A response's usage over its steps (written: prompt tokens the workers put into their prefix caches)."""
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _args(call_arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(call_arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _logprob(entry) -> dict[str, Any]:
    """A schemas.TokenLogprob as a Responses output_text logprob."""
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": entry.bytes,
        "top_logprobs": [
            {"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in entry.top_logprobs
        ],
    }


class ResponseFramer:
    """Folds a run's events into stream events (dicts with `type` and `sequence_number`)."""

    def __init__(
        self,
        run_id: str,
        spec: RunSpec,
        response: dict[str, Any],
        conversation_id: str,
        preface: list[dict[str, Any]] = (),
        moderated: bool = False,
    ) -> None:
        """`preface`: items the gateway made before the run (a compaction), first in the output;
        `moderated`: the response reports moderation results (its end waits for the last verdict)."""
        self.run_id, self.spec, self.response = run_id, spec, response
        self.preface = [dict(item) for item in preface]
        self.response["output"] = [dict(item) for item in preface]
        self.container = K.container_id(conversation_id)
        self.steps = {step_request_id(run_id, k): k for k in range(spec.max_steps)}
        self.seq = 0
        self.next_chunk: dict[str, int] = {}
        self.ended_steps: set[str] = set()
        self.message: dict[str, int] = {}  # step request id -> output index of its open message
        self.calls: dict[tuple[str, int], int] = {}  # (step, call index) -> output index
        self.by_call: dict[str, int] = {}  # call id -> output index (server calls awaiting results)
        self.kept_files: list[dict] = []  # files the run's code wrote, for the next message's citations
        self.tokens = [0, 0, 0, 0]  # prompt, completion, cached, cache-written tokens of the steps so far
        self.done = False
        self.moderation = ModerationResults(moderated)
        self.pending_end: dict[str, Any] | None = None  # an end held until the last step's verdict is in

    @property
    def output(self) -> list[dict[str, Any]]:
        return self.response["output"]

    def _ev(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.response))

    def start(self) -> list[dict[str, Any]]:
        out = [
            self._ev("response.created", response=self._snapshot()),
            self._ev("response.in_progress", response=self._snapshot()),
        ]
        for index, item in enumerate(self.preface):
            out += [
                self._ev("response.output_item.added", output_index=index, item=dict(item)),
                self._ev("response.output_item.done", output_index=index, item=dict(item)),
            ]
        return out

    def feed(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ev in events:
            if self.done:
                break
            step = self.steps.get(ev.request_id)
            if step is None:
                continue
            if isinstance(ev, TokenChunk):
                out += self._chunk(ev)
            elif isinstance(ev, Completion):
                out += self._completion(ev, step)
            elif isinstance(ev, ToolResult):
                out += self._result(ev)
            elif isinstance(ev, SafetyVerdict):
                out += self._verdict(ev, step)
        return out

    def _verdict(self, ev: SafetyVerdict, step: int) -> list[dict[str, Any]]:
        self.moderation.note(ev, step)
        if ev.blocked:
            return self._end("incomplete", incomplete={"reason": "content_filter"}, hold=False)
        if self.pending_end is not None and self.moderation.complete():
            return self._end(**self.pending_end, hold=False)
        return []

    # ------------------------------------------------------------------ text and calls as they come
    def _chunk(self, ev: TokenChunk) -> list[dict[str, Any]]:
        rid = ev.request_id
        if ev.seq < self.next_chunk.get(rid, 0) or rid in self.ended_steps:
            return []  # a duplicate (at-least-once writes)
        self.next_chunk[rid] = ev.seq + 1
        out: list[dict[str, Any]] = []
        if ev.text:
            out += self._open_message(rid)
            index = self.message[rid]
            part = self.output[index]["content"][0]
            part["text"] += ev.text
            logprobs = [_logprob(e) for e in ev.logprobs]  # when asked: one per token of the chunk
            part["logprobs"] += logprobs
            out.append(
                self._ev(
                    "response.output_text.delta",
                    item_id=self.output[index]["id"],
                    output_index=index,
                    content_index=0,
                    delta=ev.text,
                    logprobs=logprobs,
                )
            )
        for delta in ev.tool_calls:
            out += self._call_delta(rid, delta)
        return out

    def _open_message(self, rid: str) -> list[dict[str, Any]]:
        if rid in self.message:
            return []
        index = len(self.output)
        self.message[rid] = index
        item = {
            "id": f"msg_{rid}",
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.output.append(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        added = self._ev("response.output_item.added", output_index=index, item=json.loads(json.dumps(item)))
        item["content"].append(part)
        return [
            added,
            self._ev(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=dict(part),
            ),
        ]

    def _call_delta(self, rid: str, d: ToolCallDelta) -> list[dict[str, Any]]:
        key = (rid, d.index)
        if d.id:
            index = self.calls[key] = len(self.output)
            if d.name in self.spec.server_tools:
                item = self._server_item(d.id, d.name)
                self.output.append(item)
                return [
                    self._ev("response.output_item.added", output_index=index, item=dict(item)),
                    self._ev(f"response.{item['type']}.in_progress", item_id=item["id"], output_index=index),
                ]
            item = function_call_item(d.id, d.name, d.arguments, "in_progress")
            self.output.append(item)
            return [self._ev("response.output_item.added", output_index=index, item=dict(item))]
        index = self.calls.get(key)
        if index is None or self.output[index]["type"] != "function_call":
            return []  # a server call's arguments are shown whole at the step's end
        self.output[index]["arguments"] += d.arguments
        return [
            self._ev(
                "response.function_call_arguments.delta",
                item_id=self.output[index]["id"],
                output_index=index,
                delta=d.arguments,
            )
        ]

    def _server_item(self, call_id: str, name: str) -> dict[str, Any]:
        item: dict[str, Any] = {
            "id": ITEM_PREFIX[name] + call_id,
            "type": ITEM_TYPE[name],
            "status": "in_progress",
        }
        if name == "code_interpreter":
            item.update(code="", container_id=self.container, outputs=None)
        elif name == "file_search":
            item.update(queries=[], results=None)
        else:
            item.update(action={"type": "open_page", "url": ""})
        return item

    # ------------------------------------------------------------------------- the end of a step
    def _completion(self, done: Completion, step: int) -> list[dict[str, Any]]:
        rid = done.request_id
        if rid in self.ended_steps:
            return []
        self.ended_steps.add(rid)
        self.moderation.ended(done)
        for i, n in enumerate(
            (
                done.usage.prompt_tokens,
                done.usage.completion_tokens,
                done.usage.cached_tokens,
                done.usage.cache_write_tokens,
            )
        ):
            self.tokens[i] += n
        out = self._close_message(rid, "commentary" if done.tool_calls else "final_answer")
        if done.finish_reason == "error":
            return out + self._end(
                "failed",
                error={
                    "code": done.error_code or "server_error",
                    "message": done.error or "generation failed",
                },
                hold=False,
            )
        for i, call in enumerate(done.tool_calls):
            out += self._close_call(rid, i, call.id, call.function.name, call.function.arguments)
        if self.spec.continues(step, done, self.tokens[1]):
            return out  # the results, then the next step, follow
        if self.spec.out_of_tokens(done, self.tokens[1]):  # max_output_tokens spent with calls to answer
            return out + self._end("incomplete", incomplete={"reason": "max_output_tokens"})
        if done.finish_reason == "content_filter":
            return out + self._end("incomplete", incomplete={"reason": "content_filter"}, hold=False)
        if done.finish_reason == "length":
            return out + self._end("incomplete", incomplete={"reason": "max_output_tokens"})
        if done.finish_reason == "cancelled":
            return out + self._end("cancelled", hold=False)
        return out + self._end("completed", at=int(done.created_at))

    def _close_message(self, rid: str, phase: str) -> list[dict[str, Any]]:
        """The step's text done; `phase`: "commentary" when the step goes on to calls, else "final_answer"."""
        index = self.message.get(rid)
        if index is None:
            return []
        item = self.output[index]
        item.update(status="completed", phase=phase)
        part = item["content"][0]
        out = []
        for kept in self.kept_files:  # the files the run's code wrote, cited at the end of the text
            at = len(part["text"])
            part["annotations"].append(
                {
                    "type": "container_file_citation",
                    "container_id": self.container,
                    "file_id": kept["file_id"],
                    "filename": posixpath.basename(kept["path"]),
                    "start_index": at,
                    "end_index": at,
                }
            )
            out.append(
                self._ev(
                    "response.output_text.annotation.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    annotation_index=len(part["annotations"]) - 1,
                    annotation=part["annotations"][-1],
                )
            )
        self.kept_files = []
        return out + [
            self._ev(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=list(part["logprobs"]),
            ),
            self._ev(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=dict(part),
            ),
            self._ev("response.output_item.done", output_index=index, item=json.loads(json.dumps(item))),
        ]

    def _close_call(self, rid: str, i: int, call_id: str, name: str, arguments: str) -> list[dict[str, Any]]:
        index = self.calls.get((rid, i))
        if index is None:  # deltas never seen (cannot happen in one log; kept total)
            out = self._call_delta(rid, ToolCallDelta(index=i, id=call_id, name=name))
            index = self.calls[(rid, i)]
        else:
            out = []
        item = self.output[index]
        if item["type"] == "function_call":
            item.update(arguments=arguments, status="completed")
            return out + [
                self._ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=name,
                    arguments=arguments,
                ),
                self._ev("response.output_item.done", output_index=index, item=dict(item)),
            ]
        args = _args(arguments)
        self.by_call[call_id] = index
        if name == "code_interpreter":
            item["code"] = str(args.get("code", ""))
            item["status"] = "interpreting"
            return out + [
                self._ev(
                    "response.code_interpreter_call_code.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=item["code"],
                ),
                self._ev(
                    "response.code_interpreter_call_code.done",
                    item_id=item["id"],
                    output_index=index,
                    code=item["code"],
                ),
                self._ev(
                    "response.code_interpreter_call.interpreting", item_id=item["id"], output_index=index
                ),
            ]
        if name == "file_search":
            item["queries"] = [str(args.get("query", ""))]
        else:
            item["action"] = {"type": "open_page", "url": str(args.get("url", ""))}
        item["status"] = "searching"
        return out + [self._ev(f"response.{item['type']}.searching", item_id=item["id"], output_index=index)]

    def _result(self, result: ToolResult) -> list[dict[str, Any]]:
        index = self.by_call.pop(result.call_id, None)
        if index is None:
            return []  # a duplicate, or a call this run does not wait for
        item = self.output[index]
        output = _args(result.output)  # a failed run still reports what it printed
        item["status"] = "completed" if result.ok else "failed"
        if not result.ok:
            item["error"] = result.error
        if item["type"] == "code_interpreter_call":
            logs = notebook_logs(result)
            kept = [f for f in json.loads(result.meta.get("files") or "[]") if f.get("kept")]
            self.kept_files += kept
            item["outputs"] = [
                {"type": "logs", "logs": logs},
                *(
                    {"type": "image", "url": f"/v1/containers/{self.container}/files/{f['file_id']}/content"}
                    for f in kept
                    if posixpath.splitext(f["path"])[1].lower() in IMAGE_TYPES
                ),
            ]
            item["result"] = {k: output.get(k) for k in ("value", "files", "exit_code", "truncated")}
        elif item["type"] == "file_search_call":
            item["results"] = [
                {
                    "file_id": r.get("file_id"),
                    "filename": r.get("filename"),
                    "score": r.get("score"),
                    "text": r.get("text"),
                    "attributes": {
                        "vector_store_id": r.get("vector_store_id"),
                        "chunk_index": r.get("chunk_index"),
                    },
                }
                for r in output.get("results", [])
            ]
        else:
            item["result"] = output
        return [
            self._ev(f"response.{item['type']}.completed", item_id=item["id"], output_index=index),
            self._ev("response.output_item.done", output_index=index, item=json.loads(json.dumps(item))),
        ]

    def _end(
        self,
        status: str,
        *,
        error: dict | None = None,
        incomplete: dict | None = None,
        at: int | None = None,
        hold: bool = True,
    ) -> list[dict[str, Any]]:
        """End the response; `at` is when its last step completed (completed_at, for status completed).
        A moderated answer's end is held (`hold`) until the verdict over its last step is in."""
        if hold and not self.moderation.complete():
            self.pending_end = {"status": status, "error": error, "incomplete": incomplete, "at": at}
            return []
        self.done, self.pending_end = True, None
        if self.moderation.asked:
            self.response["moderation"] = self.moderation.results()
        self.response["completed_at"] = at if status == "completed" else None
        for item in self.output:  # calls left without a result (a step that also called a function)
            if item.get("status") in ("in_progress", "interpreting", "searching"):
                item["status"] = "incomplete"
        self.response.update(
            status=status, error=error, incomplete_details=incomplete, usage=usage_of(*self.tokens)
        )
        name = {
            "completed": "response.completed",
            "failed": "response.failed",
            "incomplete": "response.incomplete",
            "cancelled": "response.failed",
        }[status]
        return [self._ev(name, response=self._snapshot())]


class ModerationResults:
    """A moderated response's results (`moderation` in the response object), from the safety processor's
    verdicts in band: the input's (step 0), and each category's highest score over every step's output,
    complete once the verdict over the last step's whole answer (its Completion's seq) is in."""

    def __init__(self, asked: bool) -> None:
        self.asked = asked
        self.input: SafetyVerdict | None = None
        self.peak: dict[str, float] = {}
        self.flagged: set[str] = set()
        self.policy = ""
        self.completion_seq: dict[str, int] = {}
        self.last_step = ""
        self.whole: set[str] = set()  # steps whose whole-answer verdict is in

    def note(self, verdict: SafetyVerdict, step: int) -> None:
        self.policy = verdict.policy_version or self.policy
        if verdict.stage == "input":
            if step == 0 and self.input is None:
                self.input = verdict
            return
        for category, score in verdict.scores.items():
            self.peak[category] = max(score, self.peak.get(category, 0.0))
        self.flagged |= set(verdict.categories)
        if verdict.window_end_seq == self.completion_seq.get(verdict.request_id):
            self.whole.add(verdict.request_id)

    def ended(self, done: Completion) -> None:
        self.completion_seq[done.request_id], self.last_step = done.seq, done.request_id

    def complete(self) -> bool:
        return not self.asked or (self.input is not None and self.last_step in self.whole)

    def results(self) -> dict[str, Any]:
        model = "tokenstream-safety" + (f":{self.policy}" if self.policy else "")
        if self.input is not None:
            given = _result(model, self.input.scores, set(self.input.categories))
        else:
            given = {"type": "error", "code": "unavailable", "message": "the input's verdict did not arrive"}
        if self.peak:
            said = _result(model, self.peak, self.flagged)
        else:
            said = {
                "type": "error",
                "code": "not_generated",
                "message": "no output was judged (the input was blocked, or the run ended before any answer)",
            }
        return {"input": given, "output": said}


def _result(model: str, scores: dict[str, float], flagged: set[str]) -> dict[str, Any]:
    return {
        "type": "moderation_result",
        "model": model,
        "flagged": bool(flagged),
        "categories": {c: c in flagged for c in scores},
        "category_scores": dict(scores),
        "category_applied_input_types": {c: ["text"] for c in scores},
    }
