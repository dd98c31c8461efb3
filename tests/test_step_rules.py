"""One set of step rules (meshd.steps) for both data planes: the stage service's checks of an
activation and the fast path's checks of a worker-to-worker step give the same verdict, code and
words for the same stream of steps, whatever a peer sends.

Both planes are driven as a middle stage (and as a head, for what comes around the ring) without
llama.cpp: the service on a fake engine it never calls here, the fast plane on a fake model and
context (each named as a fake). Hypothesis writes the step streams: positions at, before, inside
the drafts of and past the stage's KV end, drafted rows before and after the prompt, ids carried or
not, in and out of the vocabulary, rows with a NaN, steps past the session's budget.
"""

from __future__ import annotations

import selectors
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio
from hypothesis import given
from hypothesis import strategies as st

from meshd import steps
from meshd.engine import ops
from meshd.engine.engine import RangeReport
from meshd.engine.fastpath import FastPlane
from meshd.stage.books import StageLimits
from meshd.stage.outlet import Outlet
from meshd.stage.service import StageService
from meshd.stage.state import Session
from wire.errors import ProtocolError
from wire.fastlink import ROWS, ROWS_IDS, TOKENS, Step
from wire.message import encode
from wire.stage import Open
from wire.tensors import Activation, TensorEntry

WIDTH = 4
N_VOCAB = 100
BUDGET = 24
PROMPT = 6


def report(head: bool) -> RangeReport:
    return RangeReport(layer_begin=0 if head else 2, layer_end=4, n_layer=6, has_input=head, has_output=False,
                       n_tensors=1, n_bytes=1, n_embd=WIDTH, n_vocab=N_VOCAB, n_ctx_train=512, arch="fake",
                       stage_width=WIDTH, gpu_layers=(4, 4), gpu_output=False, n_bytes_gpu=0)


class FakeEngine:
    """Never called: the checks come before any engine call."""

    generation = 1
    is_up = True
    restarts = 0


@dataclass
class FakeModel:
    report: RangeReport


class FakeContext:
    """A fake engine context (not llama.cpp): only what the fast plane's checks touch."""

    n_seq_max, n_ctx_seq, n_batch = 4, 4096, 64

    def remove(self, seq: int, p0: int, p1: int) -> None:
        pass


@dataclass(frozen=True)
class Sent:
    """One step as a peer sends it."""

    pos: int
    n: int
    drafts: int
    ids: tuple[int, ...] | None
    nan: bool


def sent_steps() -> st.SearchStrategy[list[tuple[int, Sent]]]:
    """Steps as (where the position goes: -1 one back, 0 the KV's end, 1 one past, 2 anywhere, 3 an
    honest peer's step there; the step). Honest steps keep a stream going, so later steps meet a
    session deep in its positions and drafts."""
    step = st.builds(
        lambda where, pos, n, drafts, ids, bad_id, nan: (where, Sent(pos, n, drafts, (
            tuple(N_VOCAB if bad_id and i == 0 else i % N_VOCAB for i in range(n)) if ids else None), nan)),
        st.sampled_from([-1, 0, 0, 1, 2, 3, 3, 3, 3]), st.integers(0, BUDGET + 4), st.integers(1, 6),
        st.integers(0, 3), st.booleans(), st.integers(0, 5).map(lambda k: k == 0),
        st.integers(0, 9).map(lambda k: k == 0))
    return st.lists(step, min_size=1, max_size=12)


def honest(sent: Sent, head: bool, gets_ids: bool, next_pos: int) -> Sent:
    """What an honest upstream sends at ``next_pos``, of ``sent``'s size: ids where they go, in the
    vocabulary, finite rows; at the head a token and its drafts; drafts only after the prompt."""
    drafts = sent.drafts if next_pos >= PROMPT else 0
    n = drafts + 1 if head else max(sent.n, drafts + 1)
    return Sent(next_pos, n, drafts, tuple(range(n)) if head or gets_ids else None, False)


def verdict(check: Any) -> tuple[str, str] | None:
    try:
        check()
    except ProtocolError as exc:
        return exc.code.value, exc.message
    return None


class SlowPlane:
    """The stage service's checks of an activation (``_checked_activation``) and the books' state after it."""

    def __init__(self, head: bool, gets_ids: bool) -> None:
        self.head = head
        self.service = StageService(None, FakeEngine(), report(head), "d" * 64, "fake",  # type: ignore[arg-type]
                                    StageLimits(max_sessions=2, max_session_tokens=BUDGET))
        book, _ = self.service.books.open("s", 0, 1, 64, (), 0.0, owner="o")
        self.service.books.opened(book)
        self.service.books.set_prompt(book, PROMPT)
        self.session = Session(book=book, open=Open(session="s", epoch=0), to_asker=Outlet(encode))
        self.session.gets_ids = gets_ids
        self.service.state.sessions[book] = self.session

    def take(self, sent: Sent) -> tuple[str, str] | None:
        rows = np.full((sent.n, WIDTH), np.nan if sent.nan else 0.5, np.float32)
        tensors = [] if self.head else [TensorEntry.from_array("hidden_states", rows)]
        msg = Activation.unvalidated({"type": "activation", "v": 1, "session": "s", "epoch": 0, "step": 0,
                                      "pos": sent.pos, "n_tokens": sent.n, "tensors": tensors,
                                      "tokens": list(sent.ids) if sent.ids is not None else None,
                                      "deadline_ms": None, "drafts": sent.drafts, "receipts": None})

        def check() -> None:
            checked = self.service.hops.checked_activation(self.session, msg, None)
            if checked is not None:
                from meshd.stage.hops import decoded
                decoded(checked[0])
                books = self.service.books
                books.enqueue(self.session.book, sent.pos, sent.n, None, 0.0, sent.drafts)
            # the engine ran the step (the head's was queued by the check itself)
            for work in self.service.books.next_batch():
                self.service.books.ran(work, 0.0)

        return verdict(check)

    @property
    def next_pos(self) -> int:
        return self.session.book.next_pos


class FastPlaneOf:
    """The fast path's checks of a step (``FastPlane._checked``) and where the session stands after it."""

    def __init__(self, head: bool, gets_ids: bool) -> None:
        self.head = head
        self.plane = FastPlane(FakeModel(report(head)), FakeContext(), {},  # type: ignore[arg-type]
                               selectors.DefaultSelector(), lambda events: None)
        self.plane.open(ops.FastOpen(seq=0, tag=1, max_pos=BUDGET, prompt_len=PROMPT, gets_ids=gets_ids,
                                     prompt=list(range(PROMPT))))
        self.session = self.plane.sessions[0]
        # the head has run its prompt: the ring's steps come next
        self.session.prompt = None
        self.session.next_pos = PROMPT if head else 0

    def take(self, sent: Sent) -> tuple[str, str] | None:
        kind = TOKENS if self.head else ROWS_IDS if sent.ids is not None else ROWS
        if self.head and sent.ids is None:
            kind = ROWS
        rows = b"" if kind == TOKENS else np.full((sent.n, WIDTH), np.nan if sent.nan else 0.5, np.float32).tobytes()
        ids = b"" if sent.ids is None else np.asarray(sent.ids, np.int32).tobytes()
        step = Step(kind, sent.pos, sent.n, sent.drafts, rows, ids)

        def check() -> None:
            work = self.plane._checked(self.session, step, 0.0)
            # as the pass that takes the step does (FastPlane.run)
            self.session.next_pos = work.pos + work.n

        return verdict(check)

    @property
    def next_pos(self) -> int:
        return self.session.next_pos


def drive(head: bool, gets_ids: bool, stream: list[tuple[int, Sent]]) -> None:
    """``stream`` through both planes, step by step (in a trio run: the service queues what it takes)."""
    async def run() -> None:
        take_all(head, gets_ids, stream)

    trio.run(run)


def take_all(head: bool, gets_ids: bool, stream: list[tuple[int, Sent]]) -> None:
    slow, fast = SlowPlane(head, gets_ids), FastPlaneOf(head, gets_ids)
    if head:
        # the slow head runs its prompt off the asker's Prompt: its KV ends where the fast one's does
        slow.service.books.enqueue(slow.session.book, 0, PROMPT, None, 0.0)
        for work in slow.service.books.next_batch():
            slow.service.books.ran(work, 0.0)
    for where, sent in stream:
        assert slow.next_pos == fast.next_pos
        if where == 3:
            sent = honest(sent, head, gets_ids, slow.next_pos)
        else:
            pos = sent.pos if where == 2 else max(0, slow.next_pos + where)
            sent = Sent(pos, sent.n, sent.drafts, sent.ids, sent.nan)
        got = slow.take(sent), fast.take(sent)
        assert got[0] == got[1], (sent, got)
        if got[0] is not None:
            # a refused step fails its session on either plane: nothing after it is taken
            return


@given(st.booleans(), sent_steps())
def test_a_middle_stage_gives_the_same_verdict_on_both_planes(gets_ids: bool, stream: list[tuple[int, Sent]]) -> None:
    drive(False, gets_ids, stream)


@given(sent_steps())
def test_a_head_gives_the_same_verdict_on_both_planes_for_what_comes_around_the_ring(
        stream: list[tuple[int, Sent]]) -> None:
    drive(True, False, stream)


def test_the_rules_refuse_what_they_say() -> None:
    # each rule can fail: a step off the KV's end, drafts in the prompt, past the budget, ids out of the
    # vocabulary, a NaN, a head given rows, and the tail's ring step that is not the one it sent
    refused = {
        "CACHE_MISS": lambda: steps.check_rows(3, 1, 0, 2, False, 0, 8),
        "drafts follow": lambda: steps.check_rows(2, 2, 1, 2, False, 4, 8),
        "budget is 8": lambda: steps.check_rows(7, 2, 0, 7, False, 0, 8),
        "outside the vocabulary": lambda: steps.check_ids([1, 100], 100),
        "NaN": lambda: steps.check_finite(np.array([1.0, np.nan])),
        "not hidden states": lambda: steps.check_kind(True, True, True, 1, 0, False),
        "the ring's token went at 5": lambda: steps.check_ring(6, 1, 0, 5, 0),
    }
    for words, check in refused.items():
        got = verdict(check)
        assert got is not None and words in " ".join(got), (words, got)
    steps.check_rows(3, 2, 1, 4, True, 2, 8)
    assert steps.rewinds(3, 4, 3) and not steps.rewinds(4, 4, 3) and not steps.rewinds(3, 4, None)
    assert [steps.accepted(p, [5, 6, 7]) for p in ([5, 6, 7, 8], [5, 9], [4], [])] == [3, 1, 0, 0]
    assert steps.ends(True, 0, 9) and steps.ends(False, 9, 9) and not steps.ends(False, 8, 9)
