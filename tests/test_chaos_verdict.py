"""The chaos drill's verdict on hand-made logs and client outcomes (the drill itself: tests/test_chaos.py).

Each case is one way the guarantee can break; the log events are the real schema types."""

from __future__ import annotations

from schemas import Completion, SafetyVerdict, TokenChunk
from tokenstream.chaos.clients import Outcome
from tokenstream.chaos.verify import LogAnswer, judge

RID = "r1"


def chunk(seq: int, text: str) -> TokenChunk:
    return TokenChunk(request_id=RID, conversation_id=RID, tenant="t", seq=seq, text=text, token_ids=[seq])


def completion(seq: int, text: str, reason: str = "stop") -> Completion:
    return Completion(
        request_id=RID, conversation_id=RID, tenant="t", seq=seq, finish_reason=reason, text=text
    )


def log(*events) -> dict[str, LogAnswer]:
    answer = LogAnswer()
    for event in events:
        answer.add(event)
    return {RID: answer}


def outcome(*texts: str, done: bool = True, error_texts: tuple[str, ...] = ()) -> Outcome:
    o = Outcome(RID, 0.0, frames=list(enumerate(texts)), done=done)
    o.error_texts = list(error_texts)
    return o


def test_a_client_with_the_logs_answer_passes_also_after_an_error_and_a_resume():
    v = judge([outcome("A", "B", error_texts=("A",))], log(chunk(0, "A"), chunk(1, "B"), completion(2, "AB")))
    assert (v.completed, v.interrupted, v.broken) == (1, 1, False)


def test_a_client_short_of_the_log_lost_tokens():
    v = judge([outcome("A")], log(chunk(0, "A"), chunk(1, "B"), completion(2, "AB")))
    assert v.lost == [RID] and not v.differs


def test_text_held_at_an_error_must_be_a_prefix_of_the_log():
    v = judge([outcome("A", "B", error_texts=("X",))], log(chunk(0, "A"), chunk(1, "B"), completion(2, "AB")))
    assert v.differs == [RID]


def test_a_chunk_then_a_completion_that_says_nothing_was_emitted_is_not_one_answer():
    """What the loaded chaos run found: an expelled worker's chunk 0, then the new owner's Completion
    with seq 0 (its takeover read came before that chunk)."""
    v = judge(
        [outcome("A")], log(chunk(0, "A"), completion(0, "", "cancelled"), completion(1, "A", "cancelled"))
    )
    assert v.inconsistent == [RID]


def test_a_chunk_written_after_the_end_or_a_gap_is_not_one_answer():
    assert judge([outcome("A")], log(chunk(0, "A"), completion(1, "A"), chunk(1, "B"))).inconsistent == [RID]
    assert judge([outcome("AC")], log(chunk(0, "A"), chunk(2, "C"), completion(3, "AC"))).inconsistent == [
        RID
    ]


def test_a_blocking_verdict_ends_the_answer_where_the_gateway_cuts_it():
    verdict = SafetyVerdict(request_id=RID, conversation_id=RID, tenant="t", stage="output", blocked=True)
    v = judge([outcome("A")], log(chunk(0, "A"), verdict, chunk(1, "B"), completion(2, "AB", "cancelled")))
    assert not v.broken


def test_unfinished_and_repeated_positions_are_counted():
    repeated = outcome("A")
    repeated.errors.append("position 0 delivered again")
    v = judge([outcome("A", done=False), repeated], log(chunk(0, "A"), completion(1, "A")))
    assert v.unfinished == [RID] and v.duplicates == [RID]
