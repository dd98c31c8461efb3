"""The stage's books without trio: budgets, slots, LRU, TTL timers, batches and when a session ends."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from meshd.stage.books import Phase, SessionBook, StageBooks, StageLimits
from wire.errors import ErrorCode, ProtocolError

LIMITS = StageLimits(max_sessions=3, max_session_tokens=16, max_total_tokens=24, ttl=5.0, evict_after=1.0,
                     prefill_chunk=4, n_batch=8)
NAMES = st.sampled_from(["a", "b", "c", "d", "e"])


def books(**limits: float) -> StageBooks[None]:
    return StageBooks(StageLimits(**({"max_sessions": 2, "max_session_tokens": 16, "max_total_tokens": 32,
                                      "ttl": 10.0, "evict_after": 0.0} | limits)))


def opened(b: StageBooks[None], name: str, now: float, max_tokens: int = 4, stop: tuple[str, ...] = (),
           epoch: int = 0) -> SessionBook:
    book, _ = b.open(name, epoch, 1, max_tokens, stop, now)
    b.opened(book)
    return book


def prefill(b: StageBooks[None], book: SessionBook, n: int, now: float) -> None:
    b.set_prompt(book, n)
    b.enqueue(book, 0, n, None, now)
    for work in b.next_batch():
        b.ran(work, now)


# ----- focused


def test_the_least_recently_used_idle_session_is_evicted_not_the_oldest() -> None:
    b = books()
    a = opened(b, "a", now=0.0)
    c = opened(b, "c", now=1.0)
    b.touch(a, 2.0)
    new, gone = b.open("n", 0, 1, 4, (), 3.0)
    assert gone == [c] and c.phase is Phase.FAILED and c.failure is not None
    assert c.failure.code is ErrorCode.CACHE_MISS and "least recently used" in c.failure.message
    assert set(b.sessions) == {"a", "n"} and new.slot == c.slot


def test_a_busy_or_recent_session_is_not_evicted_and_the_open_is_overloaded() -> None:
    b = books(evict_after=5.0)
    a = opened(b, "a", now=0.0)
    opened(b, "c", now=4.0)
    b.set_prompt(a, 2)
    b.enqueue(a, 0, 2, None, 4.5)
    with pytest.raises(ProtocolError) as err:
        b.open("n", 0, 1, 4, (), 6.0)
    assert err.value.code is ErrorCode.OVERLOADED and err.value.retry_after_ms
    assert set(b.sessions) == {"a", "c"}


def test_total_budget_evicts_others_but_never_the_session_that_needs_room() -> None:
    b = books(max_total_tokens=20)
    a = opened(b, "a", 0.0)
    prefill(b, a, 12, 0.0)
    c = opened(b, "c", 1.0)
    b.set_prompt(c, 10)
    gone = b.enqueue(c, 0, 10, None, 2.0)
    assert gone == [a] and b.total_tokens == 10 and a.failure is not None
    assert b.dirty == [(a.slot, 1)]


def test_an_idle_session_expires_at_its_timer_and_not_before() -> None:
    b = books(ttl=10.0)
    assert b.next_timer() is None
    a = opened(b, "a", 1.0)
    prefill(b, a, 3, 2.0)
    assert b.next_timer() == 12.0
    assert b.handle_timer(11.999) == []
    assert b.handle_timer(12.0) == [a]
    assert a.failure is not None and "expired" in a.failure.message
    assert b.sessions == {} and b.total_tokens == 0 and b.next_timer() is None and b.dirty == [(a.slot, 1)]


def test_a_session_with_work_in_flight_has_no_timer() -> None:
    b = books()
    a = opened(b, "a", 0.0)
    b.set_prompt(a, 2)
    b.enqueue(a, 0, 2, None, 0.0)
    assert b.next_timer() is None and b.handle_timer(100.0) == []
    b.ran(b.next_batch()[0], 50.0)
    assert b.next_timer() == 60.0


def test_rows_and_prompts_beyond_the_session_budget_are_refused_naming_the_limit() -> None:
    b = books(max_session_tokens=16)
    a = opened(b, "a", 0.0)
    with pytest.raises(ProtocolError, match=r"prompt of 17 tokens exceeds this stage's session budget of 16 tokens$"):
        b.set_prompt(a, 17)
    with pytest.raises(ProtocolError, match=r"session needs 17 tokens.*budget is 16"):
        b.check_rows(a, 0, 17)
    with pytest.raises(ProtocolError, match=r"prompt of 4097 bytes exceeds .* 16 tokens can hold \(4096 bytes\)"):
        b.check_prompt_bytes(16 * 256 + 1)
    with pytest.raises(ProtocolError) as gap:
        b.check_rows(a, 3, 1)
    assert gap.value.code is ErrorCode.CACHE_MISS


def test_rows_for_a_session_not_yet_opened_or_finished_are_refused() -> None:
    b = books()
    book, _ = b.open("a", 0, 1, 1, (), 0.0)
    with pytest.raises(ProtocolError, match="opening"):
        b.check_rows(book, 0, 1)
    b.opened(book)
    prefill(b, book, 2, 0.0)
    assert b.emit(book, False, b"x", 0.0) is not None and book.phase is Phase.DONE
    with pytest.raises(ProtocolError, match="done"):
        b.check_rows(book, 2, 1)


def test_a_stale_epoch_is_refused_and_a_newer_one_replaces_the_session() -> None:
    b = books()
    old = opened(b, "a", 0.0, epoch=3)
    with pytest.raises(ProtocolError) as err:
        b.open("a", 3, 1, 4, (), 1.0)
    assert err.value.code is ErrorCode.EPOCH_STALE
    new, gone = b.open("a", 4, 1, 4, (), 1.0)
    assert gone == [old] and old.failure is not None and old.failure.code is ErrorCode.EPOCH_STALE
    assert b.sessions == {"a": new}


def test_a_reused_slot_drops_its_pending_clear() -> None:
    b = books(max_sessions=1)
    a = opened(b, "a", 0.0)
    b.fail(a, ProtocolError(ErrorCode.CANCELLED, "gone"))
    b.release(a)
    assert b.dirty == [(a.slot, 1)]
    opened(b, "n", 1.0)
    assert b.dirty == []


def three_prompted(n_batch: int) -> tuple[StageBooks[None], list[SessionBook]]:
    """Books of three sessions, "a", "c" and "d", each with a prompt of 8 tokens."""
    b = books(max_sessions=3, max_session_tokens=64, max_total_tokens=64, n_batch=n_batch)
    sessions = [opened(b, n, 0.0) for n in "acd"]
    for book in sessions:
        b.set_prompt(book, 8)
    return b, sessions


def next_batch(b: StageBooks[None]) -> list[tuple[str, int]]:
    return [(w.session.id, w.pos) for w in b.next_batch()]


def test_a_batch_takes_one_item_per_session_within_the_row_limit_and_skips_failed_sessions() -> None:
    b, (a, c, d) = three_prompted(n_batch=6)
    b.enqueue(a, 0, 4, None, 0.0)
    b.enqueue(a, 4, 4, None, 0.0)
    b.enqueue(c, 0, 4, None, 0.0)
    b.enqueue(d, 0, 2, None, 0.0)
    b.fail(c, ProtocolError(ErrorCode.BAD_REQUEST, "bad"))
    assert next_batch(b) == [("a", 0), ("d", 0)]
    assert next_batch(b) == [("a", 4)]
    assert b.next_batch() == []


def test_a_session_that_joins_gives_its_queued_steps_in_order_and_no_session_runs_a_step_before_an_earlier_one(
) -> None:
    b, (a, c, d) = three_prompted(n_batch=8)
    c.joins = True
    b.enqueue(a, 0, 2, None, 0.0)
    b.enqueue(c, 0, 2, None, 0.0)
    b.enqueue(c, 2, 1, None, 0.0)
    b.enqueue(d, 0, 6, None, 0.0)
    b.enqueue(c, 3, 1, None, 0.0)
    b.enqueue(d, 6, 1, None, 0.0)
    b.enqueue(c, 4, 1, None, 0.0)
    # c's steps ride together, up to the rows' limit; d's first chunk does not fit, so its second,
    # which would, waits for it
    assert next_batch(b) == [("a", 0), ("c", 0), ("c", 2), ("c", 3), ("c", 4)]
    assert next_batch(b) == [("d", 0)]
    assert next_batch(b) == [("d", 6)]


def test_sampling_starts_at_the_prompt_end_and_history_is_the_prompt_part() -> None:
    b = books()
    a = opened(b, "a", 0.0)
    b.set_prompt(a, 6)
    b.enqueue(a, 0, 4, None, 0.0)
    first = b.next_batch()[0]
    assert not b.samples(first) and b.history(first) == 4 and a.phase is Phase.PREFILL
    b.enqueue(a, 4, 4, None, 0.0)
    second = b.next_batch()[0]
    assert b.samples(second) and b.history(second) == 2 and a.phase is Phase.DECODE


def test_a_stop_string_split_across_pieces_ends_the_session() -> None:
    b = books()
    a = opened(b, "a", 0.0, max_tokens=10, stop=("</end>",))
    prefill(b, a, 1, 0.0)
    decisions = [b.emit(a, False, piece, 0.0) for piece in (b"one </e", b"n", b"d> two")]
    assert [(d.index, d.done, d.feed) for d in decisions if d] == [(0, None, True), (1, None, True), (2, "stop", False)]
    assert a.phase is Phase.DONE and b.emit(a, False, b"more", 0.0) is None


def test_end_of_generation_ends_the_session_without_a_token() -> None:
    b = books()
    a = opened(b, "a", 0.0, max_tokens=5)
    prefill(b, a, 1, 0.0)
    eog = b.emit(a, True, b"", 0.0)
    assert eog is not None and (eog.index, eog.done, eog.feed) == (None, "eog", False)
    assert a.generated == 0 and a.phase is Phase.DONE


def test_max_tokens_ends_after_exactly_that_many() -> None:
    b = books()
    a = opened(b, "a", 0.0, max_tokens=2)
    prefill(b, a, 1, 0.0)
    one, two = b.emit(a, False, b"x", 0.0), b.emit(a, False, b"y", 0.0)
    assert one is not None and two is not None
    assert (one.index, one.done, two.index, two.done) == (0, None, 1, "max_tokens")
    assert b.emit(a, False, b"z", 0.0) is None and a.generated == 2


def test_a_lost_worker_fails_every_session_and_drops_queued_work() -> None:
    b = books()
    a = opened(b, "a", 0.0)
    b.set_prompt(a, 4)
    b.enqueue(a, 0, 4, None, 0.0)
    c = opened(b, "c", 0.0)
    failed = b.fail_all(ProtocolError(ErrorCode.INTERNAL, "worker died"))
    assert failed == [a, c] and all(s.phase is Phase.FAILED and s.in_flight == 0 for s in failed)
    assert b.next_batch() == [] and not b.queued


# ----- the state machine


class BooksMachine(RuleBasedStateMachine):
    """Opens, prompts, engine steps, releases, the clock and evictions in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.books: StageBooks[None] = StageBooks(LIMITS)
        self.now = 0.0
        self.epochs: dict[str, int] = {}
        # every session object the books ever held, to check that a freed one never comes back
        self.gone: list[SessionBook] = []

    def _idle_candidates(self, keep: SessionBook | None) -> dict[SessionBook, float]:
        return {s: s.last_used for s in self.books.sessions.values()
                if s is not keep and s.in_flight == 0 and self.now - s.last_used >= LIMITS.evict_after}

    def _check_evicted(self, gone: list[SessionBook], candidates: dict[SessionBook, float]) -> None:
        for victim in gone:
            self.gone.append(victim)
            if victim.failure is not None and "evicted" in victim.failure.message:
                # least recently used among the evictable, at the time of the eviction
                assert candidates.pop(victim) == min([victim.last_used, *candidates.values()])

    @rule(name=NAMES)
    def open(self, name: str) -> None:
        epoch = self.epochs.get(name, -1) + 1
        old = self.books.sessions.get(name)
        candidates = self._idle_candidates(old)
        try:
            book, gone = self.books.open(name, epoch, 1, 6, ("!",), self.now)
        except ProtocolError as exc:
            assert exc.code is ErrorCode.OVERLOADED
            assert len(self.books.sessions) - (old is not None) >= LIMITS.max_sessions and not candidates
            return
        self.epochs[name] = epoch
        self.books.opened(book)
        assert old is None or old in gone
        self._check_evicted([g for g in gone if g is not old], candidates)

    @rule(name=NAMES, n=st.integers(1, 20))
    def prompt(self, name: str, n: int) -> None:
        book = self.books.sessions.get(name)
        if book is None or book.prompt_len is not None or book.phase is not Phase.PREFILL:
            return
        try:
            self.books.set_prompt(book, n)
        except ProtocolError as exc:
            assert n > LIMITS.max_session_tokens and exc.code is ErrorCode.OVERLOADED
            return
        for start in range(0, n, LIMITS.prefill_chunk):
            size = min(LIMITS.prefill_chunk, n - start)
            if not self._enqueue(book, start, size):
                return

    def _enqueue(self, book: SessionBook, pos: int, n: int) -> bool:
        candidates = self._idle_candidates(book)
        try:
            gone = self.books.enqueue(book, pos, n, None, self.now)
        except ProtocolError as exc:
            assert exc.code is ErrorCode.OVERLOADED
            self.books.fail(book, exc)
            return False
        self._check_evicted(gone, candidates)
        return True

    @rule(eog=st.booleans(), piece=st.sampled_from([b"a", b"b!", b"", b"cd"]))
    def step(self, eog: bool, piece: bytes) -> None:
        batch = self.books.next_batch()
        assert sum(w.n for w in batch) <= LIMITS.n_batch
        assert len({id(w.session) for w in batch}) == len(batch)
        for work in batch:
            assert self.books.holds(work.session) and work.session.phase is not Phase.FAILED
            self.books.ran(work, self.now)
            if self.books.samples(work):
                emitted = self.books.emit(work.session, eog, piece, self.now)
                if emitted is not None and emitted.feed:
                    self._enqueue(work.session, work.session.next_pos, 1)

    @rule(name=NAMES)
    def release(self, name: str) -> None:
        book = self.books.sessions.get(name)
        if book is not None:
            self.books.fail(book, ProtocolError(ErrorCode.CANCELLED, "released"))
            assert self.books.release(book)
            self.gone.append(book)

    @rule(name=NAMES)
    def touch(self, name: str) -> None:
        book = self.books.sessions.get(name)
        if book is not None:
            self.books.touch(book, self.now)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.0, 5.0, 7.5]))
    def advance(self, dt: float) -> None:
        timer = self.books.next_timer()
        self.now += dt
        if timer is None or self.now < timer:
            assert self.books.handle_timer(self.now) == []
        else:
            expired = self.books.handle_timer(self.now)
            assert expired and all((s.slot, s.generation) in self.books.dirty for s in expired)
            self.gone.extend(expired)

    @precondition(lambda self: self.books.next_timer() is not None)
    @rule()
    def sleep_until_timer(self) -> None:
        timer = self.books.next_timer()
        assert timer is not None
        self.now = timer
        expired = self.books.handle_timer(self.now)
        assert expired
        self.gone.extend(expired)

    @invariant()
    def budgets_hold(self) -> None:
        sessions = self.books.sessions.values()
        assert self.books.total_tokens == sum(s.next_pos for s in sessions) <= LIMITS.max_total_tokens
        assert all(s.next_pos <= LIMITS.max_session_tokens for s in sessions)
        assert all(s.generated <= s.max_tokens for s in sessions)

    @invariant()
    def slots_are_unique_and_accounted(self) -> None:
        used = [s.slot for s in self.books.sessions.values()]
        assert len(used) == len(set(used)) <= LIMITS.max_sessions
        assert sorted(used + self.books._free) == list(range(LIMITS.max_sessions))

    @invariant()
    def no_idle_session_outlives_its_ttl(self) -> None:
        timer = self.books.next_timer()
        idle = [s for s in self.books.sessions.values() if s.in_flight == 0]
        assert (timer is None) == (not idle)
        if timer is not None:
            # every session idle for the TTL was freed when its timer came
            assert timer == min(s.last_used for s in idle) + LIMITS.ttl > self.now

    @invariant()
    def freed_sessions_stay_freed(self) -> None:
        held = set(map(id, self.books.sessions.values()))
        assert not any(id(s) in held for s in self.gone)


BooksMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestBooks = BooksMachine.TestCase
