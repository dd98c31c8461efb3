"""The fast path's receipt spans: what a worker hashes (meshd.engine.spans), and what the asker checks of
them (meshd.client.audit.SpanAudit), sans-IO.

A span's hashes are those of its final rows in order, however the steps that ran them were cut and
whatever drafts were dropped on the way, so a replica that replays the span as one step signs the same
bytes. The asker takes each stage's receipts off its own stream and checks a span once every stage's is
in: the head's input is the answer's tokens, each stage's input the one before's output, the tail's
output the tokens it sampled; a stage that sends out of turn, for another range, or short before the
seal is blamed, and two stages disagreeing on the rows between them are both routed around.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshd.client.ask import AskResult
from meshd.client.audit import SpanAudit, StageLied
from meshd.engine.spans import SpanBook, SpanError
from meshd.stage.receipts import SessionReceipts, Signer
from wire.identity import NodeIdentity
from wire.receipt import SPAN, row_hash, sampling_bytes, span_end
from wire.stage import Sampling, StageInfo

MODEL = "ab" * 32
RANGES = [(0, 2), (2, 4), (4, 6)]
SIGNERS = [Signer(NodeIdentity.generate()) for _ in RANGES]


def row(pos: int, salt: bytes = b"") -> bytes:
    return row_hash(salt + pos.to_bytes(4, "little")) * 4


@given(st.integers(1, 80), st.integers(1, 80), st.lists(st.integers(1, 9), min_size=1, max_size=30), st.data())
def test_spans_hash_the_final_rows_however_the_steps_were_cut(total: int, prompt_len: int, cuts: list[int],
                                                              data: st.DataObject) -> None:
    cut = SpanBook(SPAN, prompt_len, keep=True)
    closed = []
    pos = 0
    for n in cuts:
        n = min(n, total - pos)
        if n <= 0:
            break
        # a step may run drafted rows past its last final one: wrong ones, which the next step drops
        drafts = data.draw(st.integers(0, 3))
        rows = [row(p) for p in range(pos, pos + n)] + [row(p, b"draft") for p in range(pos + n, pos + n + drafts)]
        outs = [row(p, b"out") for p in range(pos, pos + n)] + [b"x"] * drafts
        closed += cut.step(pos, rows, outs, drafts=drafts)
        pos += n
    closed += cut.seal(pos)
    # the same rows as one step (a replica's replay), sealed where the cut ones end
    whole = SpanBook(SPAN, prompt_len)
    expected = whole.step(0, [row(p) for p in range(pos)], [row(p, b"out") for p in range(pos)])
    expected += whole.seal(pos)
    assert [(s.pos, s.n, s.h_in, s.h_out) for s in closed] == [(s.pos, s.n, s.h_in, s.h_out) for s in expected]
    assert all(s.pos + s.n in (span_end(s.pos, prompt_len), pos) for s in closed)
    assert b"".join(s.rows_in for s in cut.take(pos)) == b"".join(row(p) for p in range(pos))
    assert cut.kept == []


def test_spans_are_cut_where_the_prompt_ends_and_at_every_32_positions() -> None:
    assert [span_end(p, 10) for p in (0, 10, 31, 32)] == [10, 32, 32, 64]
    assert [span_end(p, 40) for p in (0, 32, 40, 64)] == [32, 40, 64, 96]


def test_a_span_closes_once_its_rows_are_final_and_steps_must_follow() -> None:
    book = SpanBook(4, 2)
    # the prompt's span closes with the step that ran it: its rows are no drafts
    (prompt,) = book.step(0, [b"a", b"b"], [b"", b"1"])
    assert (prompt.pos, prompt.n, prompt.h_in, prompt.h_out) == (0, 2, row_hash(b"ab"), row_hash(b"1"))
    assert prompt.rows_in == b""  # kept only where asked (every stage but the head)
    # a drafted row waits for the next step, which says whether it stood
    assert book.step(2, [b"c", b"d"], [b"2", b"3"], drafts=1) == []
    (span,) = book.step(3, [b"D"], [b"4"])  # the draft at 3 was wrong: the step at 3 drops it
    assert (span.pos, span.n, span.h_in, span.h_out) == (2, 2, row_hash(b"cD"), row_hash(b"24"))
    assert book.step(4, [b"e", b"f"], [b"5", b"6"], drafts=1) == []  # the span [4, 8) is still open
    assert book.step(6, [b"g"], [b"7"]) == []  # the draft at 5 stood
    (last,) = book.seal(7)
    assert (last.pos, last.n, last.h_in) == (4, 3, row_hash(b"efg"))
    with pytest.raises(SpanError):
        book.step(8, [b"x"], [b"y"])  # past the rows held
    with pytest.raises(SpanError):
        book.step(6, [b"x"], [b"y"])  # into a closed span
    with pytest.raises(SpanError):
        book.step(7, [b"x"], [])
    with pytest.raises(SpanError):
        book.step(7, [b"x"], [b"y"], drafts=2)


def test_a_span_signs_its_steps_own_time_a_step_across_its_end_in_the_first() -> None:
    book = SpanBook(4, 2)
    (prompt,) = book.step(0, [b"a", b"b"], [b"", b"1"], held=0.25)
    assert prompt.us == 250_000
    assert book.step(2, [b"c"], [b"2"], held=0.001) == []
    # a step of three rows across the span's end at 4: its time counts in the span it started in
    (span,) = book.step(3, [b"d", b"e", b"f"], [b"3", b"4", b"5"], held=0.002)
    assert (span.pos, span.n, span.us) == (2, 2, 3000)
    (last,) = book.seal(6)
    assert (last.pos, last.n, last.us) == (4, 2, 0)
    # a clock's step back times nothing, never less
    assert book.step(6, [b"g"], [b"6"], held=-5.0) == [] and book.held == 0.0


class Route:
    """Three honest stages' receipts of an answer (a prompt of 5, then tokens), span by span."""

    def __init__(self, prompt: list[int], tokens: list[int]) -> None:
        self.prompt, self.tokens = prompt, tokens
        self.ids = prompt + tokens
        self.sampling = Sampling()
        self.ledgers = [SessionReceipts(s, "s1", 0, MODEL, *r) for s, r in zip(SIGNERS, RANGES, strict=True)]
        self.ledgers[-1].sampling = sampling_bytes(self.sampling, len(prompt))

    def hashes(self, index: int, pos: int, n: int) -> tuple[bytes, bytes]:
        rows = [row_hash(bytes([index]) + p.to_bytes(4, "little")) for p in range(pos, pos + n + 1)]
        h_in = row_hash(np.asarray(self.ids[pos:pos + n], np.int32).tobytes()) if index == 0 else \
            row_hash(b"".join(rows[:n]))
        if index == len(RANGES) - 1:
            sampled = self.ids[max(pos, len(self.prompt) - 1) + 1:pos + n + 1]
            return h_in, row_hash(np.asarray(sampled, np.int32).tobytes())
        return h_in, row_hash(b"".join(row_hash(bytes([index + 1]) + p.to_bytes(4, "little"))
                                       for p in range(pos, pos + n)))

    def receipt(self, index: int, pos: int, n: int, t_us: int = 0) -> bytes:
        return self.ledgers[index].sign_wire(pos, n, *self.hashes(index, pos, n), t_us=t_us)


def audit_of(route: Route) -> SpanAudit:
    result = AskResult(prompt_tokens=route.prompt, tokens=list(route.tokens))
    result.route = [StageInfo(node_id=s.node_id, model_digest=MODEL, model_name="m", layer_begin=b, layer_end=e,
                              n_layer=6, stage_width=8, ready=True) for s, (b, e) in zip(SIGNERS, RANGES, strict=True)]
    audit = SpanAudit("s1", 0, [s.node_id for s in SIGNERS], 6, result, model=MODEL)
    audit.tokens_before = 0
    audit.prompt_known(len(route.prompt))
    return audit


def test_the_asker_checks_a_span_once_every_stage_signed_it() -> None:
    route = Route([1, 2, 3, 4, 5], list(range(10, 40)))
    audit = audit_of(route)
    until = len(route.ids) - 1
    audit.seal(until)
    spans, pos = [], 0
    while pos < until:
        spans.append((pos, min(span_end(pos, len(route.prompt)), until) - pos))
        pos += spans[-1][1]
    # cut where the prompt ends, then at SPAN's multiples
    assert [p for p, _ in spans] == [0, 5, 32]
    for index in (2, 0):
        for pos, n in spans:
            audit.on_stage(index, "s1", 0, route.receipt(index, pos, n))
    assert audit.next_pos == 0  # the middle's receipts are not in
    for pos, n in spans:
        audit.on_stage(1, "s1", 0, route.receipt(1, pos, n))
    assert audit.sealed and audit.by_stage[1][5].n_tokens == 27 and audit.by_stage[1][SPAN].n_tokens == 2


def test_the_asker_sums_each_stages_signed_time_over_the_decode_spans_alone() -> None:
    route = Route([1, 2, 3, 4, 5], list(range(10, 40)))
    audit = audit_of(route)
    until = len(route.ids) - 1
    audit.seal(until)
    for pos, n in ((0, 5), (5, 27), (32, 2)):
        for index in range(3):
            # stage k says (k + 1) ms a position; the prompt's span 1 s, which no decode figure holds
            audit.on_stage(index, "s1", 0, route.receipt(index, pos, n, 1_000_000 if pos == 0 else (index + 1) * n * 1000))
    assert audit.sealed and audit.result.own_rows == 29
    assert audit.result.own_seconds == [pytest.approx((k + 1) * 0.029) for k in range(3)]


@pytest.mark.parametrize("lie", ["head input", "hop", "tail output", "out of turn", "other range", "cut short",
                                 "other session"])
def test_a_span_that_does_not_hold_is_laid_at_its_stage(lie: str) -> None:
    route = Route([1, 2, 3, 4, 5], list(range(10, 40)))
    audit = audit_of(route)
    first = len(route.prompt)  # the first span ends where the prompt does
    for index in range(3):
        h_in, h_out = route.hashes(index, 0, first)
        if lie == "head input" and index == 0:
            h_in = row_hash(b"other prompt")
        if lie == "hop" and index == 1:
            h_in = row_hash(b"other rows")
        if lie == "tail output" and index == 2:
            h_out = row_hash(b"other tokens")
        pos, n, layers, session = 0, first, RANGES[index], "s1"
        if index == 1:
            pos = first if lie == "out of turn" else 0
            n = first - 1 if lie == "cut short" else first
            layers = (2, 5) if lie == "other range" else layers
            session = "s2" if lie == "other session" else session
        signed = SessionReceipts(SIGNERS[index], session, 0, MODEL, *layers).sign_wire(pos, n, h_in, h_out)
        try:
            audit.on_stage(index, "s1", 0, signed)
        except StageLied as caught:
            culprit, also = caught.culprit, caught.also
            break
    else:
        pytest.fail("the lie went through")
    blamed = {"head input": 0, "hop": 1, "tail output": 2}.get(lie, 1)
    assert culprit == SIGNERS[blamed].node_id
    # a hop's two ends disagree on rows only they saw: both are routed around
    assert also == (SIGNERS[0].node_id if lie == "hop" else None)


def test_receipts_before_the_prompt_is_known_wait_for_it_and_are_bounded() -> None:
    route = Route([1, 2, 3, 4, 5], list(range(10, 40)))
    audit = audit_of(route)
    audit.prompt_len = None  # (the head's ids of the prompt have not come: the spans' cuts are not known)
    for index in range(3):
        audit.on_stage(index, "s1", 0, route.receipt(index, 0, 5))
    assert audit.next_pos == 0
    audit.prompt_known(5)
    assert audit.next_pos == 5
    flooded = audit_of(route)
    flooded.prompt_len = None
    with pytest.raises(StageLied, match="before the prompt"):
        for _ in range(13):
            flooded.on_stage(1, "s1", 0, route.receipt(1, 0, 5))
