"""The safety processor: judges each request's input before inference and each answer as it streams.

    inputs:  ts.requests.prepared -> ts.requests.screened, or a refusal (content_filter) on ts.tokens;
             a request screened in parallel (the router forwarded it already) gets its verdict in band
             on its tokens partition instead, and a Cancel to ts.control when blocked
    outputs: ts.tokens windows    -> verdicts; a block also goes in band to the answer's tokens
             partition (the gateway cuts the stream) and a Cancel to ts.control (the worker stops);
             read in batches, the windows due in a batch judged together (safety/batch.py), in calls
             of at most `judge_piece` windows that let a waiting input judgement go first (safety/turns.py)
    moderation requests (POST /v1/moderations): judged, the verdict in band, never forwarded
    moderated requests (a response's `moderation`): the input verdict in band too, and after the
             Completion a verdict over the whole answer (each category's highest score), which the
             gateway waits for before the response ends
Every verdict, allowed or not, is written to ts.safety.verdicts with the policy version. Where an input
verdict in band lies on its tokens partition goes to the durable Redis on its ack (common/first_records.py:
a resume seeks there instead of scanning from the request's admission).
"""

from __future__ import annotations

import contextlib
import functools
import logging

from common import tracing
from common.config import settings
from common.first_records import FirstRecords, verdict_in_band
from processors.effects import Ledger
from processors.faust_app import make_app, send, table, topic, traced, typed
from processors.safety.batch import batches
from processors.safety.held import HeldWindows
from processors.safety.turns import Turns
from processors.safety.watch import OutputWatch
from processors.safety.windows import WindowSettings
from safety_model import stand_in
from safety_model.classifier import Judgement, SafetyClassifier
from schemas import REFUSAL, Cancel, Completion, InferenceRequest, OutputWindow, SafetyVerdict, TokenChunk
from topics import CONTROL, DEAD_LETTER, PREPARED, SAFETY_WINDOWS, SCREENED, TOKENS, VERDICTS

log = logging.getLogger(__name__)

windows_cfg = WindowSettings()
app = make_app("safety")
ledger = Ledger("safety")
windows_table = table(app, SAFETY_WINDOWS, "windows")
windows = HeldWindows(windows_table, windows_cfg, lambda: app.consumer_generation_id)
prepared_in, tokens_in = topic(app, PREPARED), topic(app, TOKENS)
screened_out, tokens_out = topic(app, SCREENED), topic(app, TOKENS)
verdicts_out, control_out, dead_letters = topic(app, VERDICTS), topic(app, CONTROL), topic(app, DEAD_LETTER)
first_records = FirstRecords(settings().redis_url)  # written off the agent's path, a failure only logged
_classifier: SafetyClassifier | None = None


def classifier() -> SafetyClassifier:
    """The output and input checks' model: the bundled classifier, or the benchmark's stand-in for one on
    an accelerator where a benchmark's system enables it (safety_model/stand_in.py)."""
    global _classifier
    if _classifier is None:
        if stand_in.enabled():
            log.warning("judging with the benchmark's stand-in judge: every text is allowed")
            _classifier = stand_in.StandInJudge.load()
        else:
            _classifier = SafetyClassifier.load()
    return _classifier


def warm_up() -> None:
    """Load the classifier and run it once before consuming (see processors.faust_app.run for why)."""
    classifier().judge(["warm-up"])


turns = Turns(lambda texts: classifier().judge(texts), windows_cfg.judge_piece)


async def judge_all(texts: list[str]) -> list[Judgement]:
    """Output windows: classifier calls of at most `judge_piece` texts, each in a thread, after any
    input waiting (safety/turns.py)."""
    return await turns.outputs(texts)


async def judge(text: str) -> Judgement:
    """A request's input (or a moderated answer's whole): one call, before any output window waiting."""
    return (await turns.inputs([text]))[0]


def verdict(of, judgement: Judgement, stage: str, window_end_seq: int = -1) -> SafetyVerdict:
    return SafetyVerdict(
        request_id=of.request_id,
        conversation_id=of.conversation_id,
        tenant=of.tenant,
        stage=stage,
        blocked=judgement.blocked,
        categories=judgement.categories,
        scores=judgement.scores,
        policy_version=judgement.policy_version,
        window_end_seq=window_end_seq,
    )


@app.agent(prepared_in)
async def screen_inputs(stream):
    async for request, raw in typed(stream, {PREPARED.name: PREPARED}, dead_letters):
        # a request judged and forwarded before a restart is not judged again
        with traced(raw, f"screen_input {request.model}", tracing.request_attributes(request)) as span:
            await ledger.once("input", request.request_id, functools.partial(screen, request, span))


async def screen(request: InferenceRequest, span: tracing.Hop) -> None:
    """Judge the newest user message; forward the request, or refuse it where its client listens.

    In parallel screening the request is being generated already: the verdict goes in band to its
    tokens partition, where the gateway holds the answer until it arrives, and a block cancels it.
    """
    newest = next((m.content for m in reversed(request.messages) if m.role == "user"), "")
    result = await judge(newest)
    trace = span.trace
    span.set(verdict_attributes(result))
    judged_input = verdict(request, result, "input")
    await send(verdicts_out, VERDICTS, judged_input, key=request.request_id, trace=trace)
    if request.screening == "moderation":  # POST /v1/moderations: judged only, the verdict in band
        where = dict(key=request.request_id, partition=request.reply_partition, trace=trace)
        await send(tokens_out, TOKENS, judged_input, **where)
        return
    if verdict_in_band(request.screening, request.output.moderated):  # the gateway waits for it or reports it
        ack = await send(
            tokens_out,
            TOKENS,
            judged_input,
            key=request.request_id,
            partition=request.reply_partition,
            trace=trace,
        )
        first_records.note_verdict(request.request_id, ack)  # the worker's first record may come after it
    if request.screening == "parallel":
        if result.blocked:
            log.info(
                "input of %s blocked while generating: %s", request.request_id, ", ".join(result.categories)
            )
            await send(
                control_out,
                CONTROL,
                Cancel(
                    request_id=request.request_id,
                    conversation_id=request.conversation_id,
                    tenant=request.tenant,
                    reason="content_filter",
                ),
                key=request.request_id,
                trace=trace,
            )
    elif result.blocked:
        log.info("input of %s blocked: %s", request.request_id, ", ".join(result.categories))
        await refuse(request, result, trace)
    else:
        await send(screened_out, SCREENED, request, key=request.request_id, trace=trace)


async def refuse(request: InferenceRequest, result: Judgement, trace) -> None:
    """End a blocked request where its client listens: one refusal chunk and a content_filter end."""
    ids = dict(request_id=request.request_id, conversation_id=request.conversation_id, tenant=request.tenant)
    where = dict(key=request.request_id, partition=request.reply_partition, trace=trace)
    await send(tokens_out, TOKENS, TokenChunk(**ids, seq=0, text=REFUSAL), **where)
    await send(
        tokens_out,
        TOKENS,
        Completion(
            **ids,
            seq=1,
            finish_reason="content_filter",
            text=REFUSAL,
            error="input flagged: " + ", ".join(result.categories),
            moderated=request.output.moderated,
        ),
        **where,
    )


@app.agent(tokens_in)
async def watch_outputs(stream):
    """Read ts.tokens in batches (what came while the last was handled, at most `batch_records`); judge
    the windows that come due in a batch in one classifier call, then handle each record in order as if
    alone: fold each chunk into its answer's window held in memory, send each due window's verdict (two
    due points of one answer: two windows, two verdicts, in order) and checkpoint, hold or end the window.
    Records are acknowledged only as checkpoints cover them (the rule: processors/safety/held.py; the
    batches: processors/safety/batch.py)."""
    records = typed(stream.noack(), {TOKENS.name: TOKENS}, dead_letters, wants=(TokenChunk, Completion))
    async with contextlib.aclosing(batches(records, windows_cfg.batch_records)) as read:
        async for batch in read:
            await watch.batch(batch)


def current(raw) -> bool:
    """Whether a record read ahead may be handled now: faust's own test when it hands one over (no
    rebalance on, and read in this consumer generation)."""
    return app.flow_control.is_active() and raw.message.generation_id == app.consumer_generation_id


@app.timer(interval=min(1.0, windows_cfg.checkpoint_s / 2))
async def checkpoint_overdue_windows() -> None:
    """The time bound on a held window's acknowledgements (not while a rebalance is on: faust reads the
    partitions again from their committed offsets after it)."""
    if app.flow_control.is_active():
        await windows.overdue()


async def screen_output(event: TokenChunk | Completion, window: OutputWindow, raw, result: Judgement) -> None:
    """Send `window`'s verdict to ts.safety.verdicts; a block also in band and as a Cancel."""
    with traced(
        raw,
        "screen_output",
        {"tokenstream.request_id": event.request_id, "tokenstream.safety.window_end_seq": window.last_seq},
    ) as span:
        span.set(verdict_attributes(result))
        trace = span.trace
        await send(
            verdicts_out,
            VERDICTS,
            verdict(event, result, "output", window.last_seq),
            key=event.request_id,
            trace=trace,
        )
        if result.blocked:
            await ledger.once(
                "block",
                event.request_id,
                functools.partial(block_output, event, result, window, raw.message.partition, trace),
            )


async def finish(done: Completion, window: OutputWindow, raw) -> None:
    """An answer ended: a moderated one's verdict over all of it."""
    if done.moderated:
        partial = functools.partial(moderation, done, window, raw.message.partition)
        await ledger.once("moderation", done.request_id, partial)


watch = OutputWatch(windows, windows_cfg, judge_all, screen_output, finish, current)


async def moderation(done: Completion, window: OutputWindow, partition: int) -> None:
    """A moderated answer's verdict over all of it, in band after its Completion: each category's highest
    score of its windows (an answer never judged, being empty, is judged now)."""
    peak = window.peak or (await judge(window.text)).scores
    policy = classifier().policy
    flagged = sorted((c for c, s in peak.items() if s >= policy.threshold(c)), key=lambda c: -peak[c])
    whole = Judgement(window.blocked or bool(flagged), flagged, peak, policy.version)
    await send(
        tokens_out, TOKENS, verdict(done, whole, "output", done.seq), key=done.request_id, partition=partition
    )


def verdict_attributes(result: Judgement) -> dict:
    return {
        "tokenstream.safety.blocked": result.blocked,
        "tokenstream.safety.policy": result.policy_version,
        "tokenstream.safety.categories": list(result.categories),
    }


async def block_output(event, result: Judgement, window: OutputWindow, partition: int, trace) -> None:
    log.info(
        "output of %s blocked at seq %d: %s", event.request_id, window.last_seq, ", ".join(result.categories)
    )
    await send(
        tokens_out,
        TOKENS,
        verdict(event, result, "output", window.last_seq),
        key=event.request_id,
        partition=partition,
        trace=trace,
    )
    await send(
        control_out,
        CONTROL,
        Cancel(
            request_id=event.request_id,
            conversation_id=event.conversation_id,
            tenant=event.tenant,
            reason="content_filter",
        ),
        key=event.request_id,
        trace=trace,
    )
