"""The stage's books, sans-IO: KV slots, token budgets, LRU eviction, TTL and batch assembly.

A stage serves many sessions, each in one llama.cpp sequence (a *slot*). These
books decide who gets a slot, how many KV tokens each session and all of them
may hold, whom to evict when they run out (the session of an asker with much less credit than
the claimant's, above the newcomers' floor; else the heaviest source's or node's session, else the
least recently used idle one, else the session of the source that has held a slot longest), when
an idle session expires, which queued work goes into the next engine call, and when a sampled token
ends a session. They take the time as
``now`` and report ``next_timer()``; the trio service around them moves
streams, channels and engine calls, and sleeps until that timer.

A session's phase::

    OPENING ─opened()─► PREFILL ─all prompt positions queued─► DECODE ─eog/stop/max─► DONE
       └──────────────────────┴───────────── fail() ──────────────┴──► FAILED

A session leaves the books (``release``) in any phase; its slot is free at
once and its KV is listed dirty until the service has cleared it.
"""

from __future__ import annotations

import collections
import enum
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from meshd import steps
from meshd.mesh.addresses import source_group
from meshd.mesh.credit import NEWCOMER_FLOOR
from meshd.stage.prefix import PrefixCache
from wire.errors import ErrorCode, ProtocolError

T = TypeVar("T")

# The longest token piece a tokenizer we load has is far below this; a prompt
# of more bytes than this many per token of the session budget cannot fit it,
# and is refused before anyone tokenizes it.
MAX_TOKEN_BYTES = 256

# How many sources that left per session slot the books remember (``StageBooks._left``): enough for
# every slot to have turned over a few times within ``tenure``; a bound on what strangers can make
# them keep.
_LEFT_CAP = 4
# A claimant takes the slot of an asker with less credit only if its own is this many times more: two
# members of about the same credit do not take a slot back and forth.
CREDIT_MARGIN = 2.0


@dataclass(frozen=True)
class StageLimits:
    """KV budgets: sessions (llama.cpp sequences), tokens per session and in all, idle time."""

    max_sessions: int = 16
    max_session_tokens: int = 2048
    max_total_tokens: int = 4096
    ttl: float = 300.0
    # an idle session this old may be evicted to make room for a new one
    evict_after: float = 2.0
    # When every slot is busy and no source holds more than its share, the source that has held a
    # slot longest gives one up, once it has held one this long: the quantum a busy slot is kept, so
    # claimants do not thrash each other's sessions. A session on a stage answers in seconds (a
    # 256-token answer at 25 tokens/s takes 10 s), so an honest answer mostly ends within it, and an
    # evicted one fails over with the same answer. A source is also remembered this long after its
    # last session here leaves, so closing and re-opening does not make it new again.
    tenure: float = 10.0
    prefill_chunk: int = 128
    n_batch: int = 512
    retry_after_ms: int = 1000
    # how long opening a session's stream to the next stage may take
    hop_timeout: float = 10.0
    # Per-peer quotas: sessions and KV tokens one node, and one source address, may hold here at
    # once (0: no cap below the stage's own); beyond them a peer is refused, retryable elsewhere.
    peer_sessions: int = 0
    peer_tokens: int = 0
    # the prefix cache (meshd.stage.prefix): KV tokens of finished sessions' prompts kept in sequences
    # no session holds (0: none kept)
    cache_tokens: int = 0


class Phase(enum.Enum):
    OPENING = "opening"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"
    FAILED = "failed"


LIVE = frozenset({Phase.PREFILL, Phase.DECODE})


@dataclass(eq=False)
class SessionBook:
    """One session's entry: its slot, positions, generation state and failure."""

    id: str
    epoch: int
    slot: int
    # the authenticated node that opened the session: only it may re-open or drive it
    owner: str
    # the only node whose hop (or ring) stream this session takes
    upstream: str
    # the engine worker generation whose KV the slot is in
    generation: int
    max_tokens: int
    stop: tuple[bytes, ...]
    last_used: float
    phase: Phase = Phase.OPENING
    next_pos: int = 0
    prompt_len: int | None = None
    generated: int = 0
    in_flight: int = 0
    # a fast-path session (``reserve``): its rows run in the engine worker, none queued here, so its
    # standing reservation is not work in flight: it may be evicted as an idle session may (its KV
    # is cleared, and the worker drops it, through the slot's clearing)
    fast: bool = False
    failure: ProtocolError | None = None
    # the end of the generated text, long enough to hold any stop string but the last byte
    tail: bytes = b""
    # speculative decoding: positions [draft_from, next_pos) hold drafted tokens not yet verified;
    # the next rows may start at any of them, and the KV from there on is dropped
    draft_from: int | None = None
    # the source group of the opener's link (``source_group``; "": unknown): quotas and eviction
    # count per source too, so many identities from one address weigh as one peer
    source: str = ""
    # since when the source has held a slot here without a break longer than ``tenure``: every
    # session of one source has the same
    since: float = 0.0
    # its queued steps may share one engine call (a check session's replay: nothing of a step goes
    # downstream, so nothing waits on one step's rows before the next's run; the engine is
    # batch-invariant, so the rows are the ones the steps give one by one)
    joins: bool = False
    # the credit of the member the session asks for (meshd.mesh.credit.priority): under contention a
    # member with much more takes the slot of one with less, above the newcomers' floor
    credit: float = 0.0
    # the prefix cache: positions its sequence holds of an entry (a lookup copied them), and the position
    # its rows begin at (the part of them the session uses; the books count them as its KV)
    found: int = 0
    start: int = 0


# What a quota or an eviction counts of a session, and whose it is.
Weight = Callable[[SessionBook], int]


def _one(book: SessionBook) -> int:
    return 1


def _tokens(book: SessionBook) -> int:
    return book.next_pos


def _by_owner(book: SessionBook) -> str:
    return book.owner


def _by_source(book: SessionBook) -> str:
    return book.source


@dataclass(eq=False)
class Work(Generic[T]):
    """Rows of one session for one engine call: positions [pos, pos + n) and what they carry."""

    session: SessionBook
    pos: int
    n: int
    payload: T
    # the last ``drafts`` rows are drafted tokens: the tail samples after each of them too
    drafts: int = 0


@dataclass(frozen=True)
class Emitted:
    """What to do with a sampled token: send it (as number ``index``), finish, feed it back."""

    index: int | None
    done: Literal["eog", "stop", "max_tokens"] | None
    feed: bool


@dataclass
class Counts:
    evictions: int = 0
    expirations: int = 0
    overloaded: int = 0
    released: int = 0
    # rejected drafts dropped (speculative decoding)
    rewinds: int = 0


@dataclass
class StageBooks(Generic[T]):
    limits: StageLimits
    sessions: dict[str, SessionBook] = field(default_factory=dict)
    counts: Counts = field(default_factory=Counts)
    # (slot, generation) of released sessions whose KV the engine still holds
    dirty: list[tuple[int, int]] = field(default_factory=list)
    # (slot, generation, position): KV of rejected drafts to drop, from position on, before the next batch
    trims: list[tuple[int, int, int]] = field(default_factory=list)
    total_tokens: int = 0
    _free: list[int] = field(default_factory=list)
    _queue: collections.deque[Work[T]] = field(default_factory=collections.deque)
    # source group -> (since when it held a slot, when it was last seen holding one), for sources
    # whose sessions have all left less than ``tenure`` ago; at most ``_LEFT_CAP`` x max_sessions
    _left: dict[str, tuple[float, float]] = field(default_factory=dict)

    cache: PrefixCache = field(default_factory=PrefixCache)

    def __post_init__(self) -> None:
        self._free = list(range(self.limits.max_sessions))
        self.cache.limit = self.limits.cache_tokens

    # ----- sessions

    def open(self, session: str, epoch: int, generation: int, max_tokens: int, stop: Iterable[str],
             now: float, owner: str = "", upstream: str | None = None,
             source: str = "", credit: float = 0.0) -> tuple[SessionBook, list[SessionBook]]:
        """A new session of node ``owner`` (its link from host ``source``, counted by its
        ``source_group``) in a slot, and the sessions that left the books to make room.

        ``upstream`` is the node whose hop stream feeds it (None: the owner feeds it itself);
        ``credit`` is its asker's (``meshd.mesh.credit.priority``), which ranks it under contention.
        Raises UNAUTHORIZED for a session another node holds, EPOCH_STALE for an epoch not above
        the one held, OVERLOADED when the peer's quota is full or no slot frees.
        """
        old = self.sessions.get(session)
        if old is not None and old.owner != owner:
            # a session id is no credential: who opened it is
            raise ProtocolError(ErrorCode.UNAUTHORIZED, f"session {session} belongs to another node")
        if old is not None and old.epoch >= epoch:
            raise ProtocolError(ErrorCode.EPOCH_STALE, f"session {session} is at epoch {old.epoch}")
        source = source_group(source)
        self._check_quota("sessions", self.limits.peer_sessions, owner, source, _one, 1, old)
        since = self._since(source, now)
        gone: list[SessionBook] = []
        if old is not None:
            self.fail(old, ProtocolError(ErrorCode.EPOCH_STALE, f"replaced by epoch {epoch}"))
            self.release(old)
            gone.append(old)
        if not self._free:
            # a cached prefix gives its sequence up before any session is evicted
            cached = self.cache.take_slot()
            if cached is not None:
                self._free.append(cached)
        if not self._free:
            why = f"all {self.limits.max_sessions} session slots are busy"
            gone.append(self._outranked(why, credit) or self._evict(why, now, None, owner, source, since, _one, 1))
        slot = self._free.pop(0)
        # the new session clears the slot itself; a pending clear would wipe its KV later
        self.dirty = [(s, g) for s, g in self.dirty if s != slot]
        self.trims = [t for t in self.trims if t[0] != slot]
        book = SessionBook(id=session, epoch=epoch, slot=slot, owner=owner, upstream=upstream or owner,
                           generation=generation, max_tokens=max_tokens, stop=tuple(s.encode() for s in stop),
                           last_used=now, source=source, since=since, credit=credit)
        self.sessions[session] = book
        self._left.pop(source, None)
        return book, gone

    def _since(self, source: str, now: float) -> float:
        """Since when ``source`` holds a slot if it opens one now: since its hold began, if it
        holds one or held one less than ``tenure`` ago; else now."""
        held = [s.since for s in self.sessions.values() if s.source == source]
        if held:
            return min(held)
        self._left = {k: v for k, v in self._left.items() if now - v[1] < self.limits.tenure}
        left = self._left.get(source)
        return left[0] if left is not None else now

    def opened(self, book: SessionBook) -> None:
        """The engine has cleared the slot (and set up sampling): work may come."""
        if book.phase is Phase.OPENING:
            book.phase = Phase.PREFILL

    def check_upstream(self, book: SessionBook, sender: str) -> None:
        """Refuses a hop (or ring) stream from any node but the upstream the opener named."""
        if sender != book.upstream:
            raise ProtocolError(ErrorCode.UNAUTHORIZED, f"session {book.id} takes its rows from another node")

    def holds(self, book: SessionBook) -> bool:
        return self.sessions.get(book.id) is book

    def touch(self, book: SessionBook, now: float) -> None:
        book.last_used = max(book.last_used, now)

    def fail(self, book: SessionBook, error: ProtocolError) -> bool:
        """Marks the session failed with ``error``; False if it had already finished or failed."""
        if book.phase in (Phase.DONE, Phase.FAILED):
            return False
        book.phase = Phase.FAILED
        book.failure = error
        return True

    def release(self, book: SessionBook) -> bool:
        """Takes the session off the books: its slot is free, its KV dirty. False if it was not on them."""
        if not self._leave(book):
            return False
        self._freed([book.slot], book.generation)
        return True

    def keep(self, book: SessionBook, keys: list[bytes] | tuple[bytes, ...], now: float) -> bool:
        """Takes a cleanly finished session off the books, its sequence kept as the prefix cache's entry
        for ``keys`` (the engine trimmed it to them), within the cache's budget. False if it was not on them."""
        if not self._leave(book):
            return False
        self._freed(self.cache.add(book.owner, book.slot, keys, now), book.generation)
        return True

    def _freed(self, slots: list[int], generation: int) -> None:
        for slot in slots:
            self.dirty.append((slot, generation))
            self._free.append(slot)

    @property
    def load(self) -> float:
        """How busy the stage is, for routes (its record's ``load``): the share of its slots live sessions
        hold, in halves (a cached prefix's slot is free for any session, so it does not count); a record
        changes only when this does, so halves keep its versions few."""
        return math.floor(2 * len(self.sessions) / self.limits.max_sessions) / 2

    def drop_cache(self, generation: int = -1) -> None:
        """Forgets every cache entry: their sequences are free, to be cleared in worker ``generation``
        (-1: the worker that held them is gone, and their KV with it)."""
        self._freed(self.cache.clear(), generation)

    def start_at(self, book: SessionBook, pos: int, now: float) -> list[SessionBook]:
        """The session's rows begin at ``pos``: the positions before it are the cached prefix a lookup
        found (``found``). Returns the sessions evicted to count them."""
        if book.phase not in LIVE or book.next_pos or book.in_flight:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"session {book.id} has run rows: it starts where it is")
        if pos > book.found:
            raise ProtocolError(ErrorCode.CACHE_MISS, f"the rows begin at {pos}, this stage found {book.found} "
                                                      f"positions of the prompt cached")
        if book.prompt_len is not None and pos >= book.prompt_len:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"the rows of a prompt of {book.prompt_len} cannot "
                                                       f"begin at {pos}")
        self._check_quota("KV tokens", self.limits.peer_tokens, book.owner, book.source, _tokens, pos)
        gone = []
        while self.total_tokens + pos > self.limits.max_total_tokens:
            gone.append(self._evict(f"the stage holds {self.limits.max_total_tokens} KV tokens in all", now, book,
                                    book.owner, book.source, book.since, _tokens, pos))
        book.start = book.next_pos = pos
        self.total_tokens += pos
        return gone

    def _leave(self, book: SessionBook) -> bool:
        if not self.holds(book):
            return False
        del self.sessions[book.id]
        if not any(s.source == book.source for s in self.sessions.values()):
            self._forget_later(book)
        self.total_tokens -= book.next_pos
        # the whole sequence is cleared: no trim of it is due any more
        self.trims = [t for t in self.trims if t[0] != book.slot]
        self.counts.released += 1
        return True

    def _forget_later(self, book: SessionBook) -> None:
        """Remembers the hold of ``book``'s source, whose last session it was, for ``tenure``.

        Its last use stands for when it left (``release`` is not told the time). The
        memory is capped: past the cap the source seen longest ago is forgotten, which
        can only make a source new again that has let its slots go for a while."""
        self._left[book.source] = (book.since, book.last_used)
        if len(self._left) > _LEFT_CAP * self.limits.max_sessions:
            del self._left[min(self._left, key=lambda k: self._left[k][1])]

    def fail_all(self, error: ProtocolError) -> list[SessionBook]:
        """The KV is gone (the engine worker died): every session fails, nothing queued runs."""
        self._queue.clear()
        self.drop_cache()
        for book in self.sessions.values():
            book.in_flight = 0
            self.fail(book, error)
        return list(self.sessions.values())

    def take_dirty(self) -> list[tuple[int, int]]:
        dirty, self.dirty = self.dirty, []
        return dirty

    def take_trims(self) -> list[tuple[int, int, int]]:
        trims, self.trims = self.trims, []
        return trims

    # ----- prompt and rows

    def check_prompt_bytes(self, size: int) -> None:
        """Refuses a prompt text that cannot fit the session budget, before it is tokenized."""
        limit = self.limits.max_session_tokens * MAX_TOKEN_BYTES
        if size > limit:
            self.counts.overloaded += 1
            raise ProtocolError(ErrorCode.OVERLOADED, f"prompt of {size} bytes exceeds what this stage's session "
                                                      f"budget of {self.limits.max_session_tokens} tokens can "
                                                      f"hold ({limit} bytes)")

    def set_prompt(self, book: SessionBook, n_tokens: int) -> None:
        """The session's prompt length, which decides where sampling begins."""
        if book.prompt_len is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the session already has its prompt")
        if n_tokens < 1:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the prompt is empty")
        if n_tokens > self.limits.max_session_tokens:
            self.counts.overloaded += 1
            raise ProtocolError(ErrorCode.OVERLOADED, f"prompt of {n_tokens} tokens exceeds this stage's session "
                                                      f"budget of {self.limits.max_session_tokens} tokens")
        book.prompt_len = n_tokens

    def check_rows(self, book: SessionBook, pos: int, n: int, drafts: int = 0) -> None:
        """Checks rows a peer sends before anything is decoded: position, count, drafts, the session's budget.

        Rows start where the stage's KV ends, or (speculation) at one of the drafted
        positions of the rows before, once those have run: the drafts from there on were rejected.
        """
        if book.phase not in LIVE:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"session {book.id} takes no rows ({book.phase.value})")
        # a rewind waits for the drafts' own step to have run (the fast path's worker runs one step of a
        # session at a time, so there it always has)
        rewind = steps.rewinds(pos, book.next_pos, book.draft_from) and book.in_flight == 0
        try:
            steps.check_rows(pos, n, drafts, book.next_pos, rewind, book.prompt_len, self.limits.max_session_tokens)
        except ProtocolError as exc:
            if exc.code is ErrorCode.OVERLOADED:
                self.counts.overloaded += 1
            raise

    def enqueue(self, book: SessionBook, pos: int, n: int, payload: T, now: float,
                drafts: int = 0) -> list[SessionBook]:
        """Queues rows for the engine and reserves their KV; returns the sessions evicted for it.

        Rows that start inside the drafts before drop those drafts' KV first (``trims``).
        """
        self.check_rows(book, pos, n, drafts)
        # a rewind gives back the drafts' KV before these rows take theirs
        self._check_quota("KV tokens", self.limits.peer_tokens, book.owner, book.source, _tokens,
                          n - max(0, book.next_pos - pos))
        if pos < book.next_pos:
            self.total_tokens -= book.next_pos - pos
            self.trims.append((book.slot, book.generation, pos))
            self.counts.rewinds += 1
            book.next_pos = pos
        gone = []
        while self.total_tokens + n > self.limits.max_total_tokens:
            gone.append(self._evict(f"the stage holds {self.limits.max_total_tokens} KV tokens in all", now, book,
                                    book.owner, book.source, book.since, _tokens, n))
        book.next_pos = pos + n
        book.draft_from = pos + n - drafts if drafts else None
        self.total_tokens += n
        book.in_flight += 1
        self.touch(book, now)
        if book.phase is Phase.PREFILL and book.prompt_len is not None and book.next_pos >= book.prompt_len:
            book.phase = Phase.DECODE
        self._queue.append(Work(book, pos, n, payload, drafts))
        return gone

    def reserve(self, book: SessionBook, positions: int, now: float) -> list[SessionBook]:
        """A fast session's KV, reserved whole: its rows run in the engine worker, not through
        ``enqueue``, so the books count every position it may take (prompt and answer, within the
        session budget) from the start, and keep it busy (never idle, so never evicted or expired
        under its asker) until it leaves. Returns the sessions evicted for it."""
        if book.phase not in LIVE:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"session {book.id} takes no rows ({book.phase.value})")
        positions = min(positions, self.limits.max_session_tokens)
        self._check_quota("KV tokens", self.limits.peer_tokens, book.owner, book.source, _tokens,
                          positions - book.next_pos)
        gone = []
        while self.total_tokens + positions - book.next_pos > self.limits.max_total_tokens:
            gone.append(self._evict(f"the stage holds {self.limits.max_total_tokens} KV tokens in all", now, book,
                                    book.owner, book.source, book.since, _tokens, positions - book.next_pos))
        self.total_tokens += positions - book.next_pos
        book.next_pos = positions
        book.in_flight += 1
        book.fast = True
        book.phase = Phase.DECODE
        self.touch(book, now)
        return gone

    def _check_quota(self, what: str, cap: int, owner: str, source: str, weight: Weight, more: int,
                     replaced: SessionBook | None = None) -> None:
        """Refuses ``more`` of ``what`` (counted by ``weight``) to a node, or a source address, that
        would then hold more than ``cap`` (0: no cap). A replaced session's share is its own again."""
        if cap <= 0 or more <= 0:
            return
        for kind, key, peer in (("node", _by_owner, owner), ("address", _by_source, source)):
            if not peer:
                continue
            held = sum(weight(s) for s in self.sessions.values() if key(s) == peer and s is not replaced)
            if held + more > cap:
                self.counts.overloaded += 1
                shown = peer[:16] if kind == "node" else peer
                raise ProtocolError(ErrorCode.OVERLOADED, f"{kind} {shown} holds {held} {what} on this stage, "
                                                          f"the most one peer may is {cap}",
                                    retry_after_ms=self.limits.retry_after_ms)

    def _evict(self, why: str, now: float, keep: SessionBook | None, owner: str, source: str, since: float,
               weight: Weight, need: int) -> SessionBook:
        """Frees room for node ``owner`` at ``source`` (holding a slot here since ``since``), which
        needs ``need`` more of what ``weight`` counts per session.

        The heaviest user pays first: a source address, else a node, holding more than the
        claimant's would after this loses its least recently used session even if that session
        is busy, so no one peer (opening many sessions, each kept warm, under one identity or
        many from one address) can lock the others out. Otherwise an idle session goes, the
        heaviest node's first, then the least recently used. Otherwise (every holder holds its
        share and keeps it busy: a few sources with one slow session each) the source that has
        held a slot longest gives up its session, once it has held one for ``tenure`` and
        longer than the claimant has: the slots go round, oldest hold first.

        Why by the source's hold and not the session's age: a source that closes and re-opens
        its session to look new keeps its old ``since`` (it is remembered for ``tenure`` after it
        leaves), so it cannot make itself the youngest; and since a claimant may only take the slot
        of a source that has held one longer than it has, an evicted source re-opening at once
        can take a slot only from holders older than itself, never the newcomer that took its
        own. ``tenure`` is the quantum a legitimate long answer keeps its slot under contention;
        past it the answer fails over (retryable CACHE_MISS) and comes out the same elsewhere.
        """
        # (a fast session's one step "in flight" is its reservation: four sources holding slow fast
        # sessions locked a stage otherwise)
        movable = [s for s in self.sessions.values() if s is not keep and (s.in_flight == 0 or s.fast)]
        owners = self._held(_by_owner, weight)
        if movable:
            for kind, key, claimant in (("address", _by_source, source), ("node", _by_owner, owner)):
                held = owners if key is _by_owner else self._held(key, weight)
                heaviest = key(max(movable, key=lambda s: (held[key(s)], -s.last_used)))
                if heaviest != claimant and held[heaviest] > held[claimant] + need:
                    victim = min((s for s in movable if key(s) == heaviest), key=lambda s: s.last_used)
                    return self._evicted(victim, f"evicted because {why} and its {kind} held the most of them "
                                                 f"({held[heaviest]})")
        idle = [s for s in movable if now - s.last_used >= self.limits.evict_after]
        if idle:
            victim = min(idle, key=lambda s: (-owners[s.owner], s.last_used))
            return self._evicted(victim, f"evicted (least recently used) because {why}")
        senior = [s for s in movable if s.since <= now - self.limits.tenure and s.since < since]
        if senior:
            victim = min(senior, key=lambda s: (s.since, s.last_used))
            return self._evicted(victim, f"evicted because {why} and its address has held a slot here longest "
                                         f"({now - victim.since:.0f} s)")
        self.counts.overloaded += 1
        raise ProtocolError(ErrorCode.OVERLOADED, why, retry_after_ms=self.limits.retry_after_ms)

    def _outranked(self, why: str, credit: float) -> SessionBook | None:
        """The session a claimant with ``credit`` takes the slot of, if any: the one whose asker has the
        least credit, if the claimant's is ``CREDIT_MARGIN`` times that (members who serve are served
        first), unless it is a newcomer's (no credit) and newcomers hold no more than their floor
        (``NEWCOMER_FLOOR`` of the slots, rounded down): so the mesh stays open to those yet to serve."""
        if credit <= 0.0:
            return None
        newcomers = sum(1 for s in self.sessions.values() if s.credit <= 0.0)
        floor = int(self.limits.max_sessions * NEWCOMER_FLOOR)
        # a busy session too (a one-stage route's is busy at every step): the step in the engine's hands
        # is dropped when it returns (the session has failed), and the answer fails over, the same elsewhere
        poorer = [s for s in self.sessions.values()
                  if s.credit * CREDIT_MARGIN < credit and (s.credit > 0.0 or newcomers > floor)]
        if not poorer:
            return None
        victim = min(poorer, key=lambda s: (s.credit, s.last_used))
        return self._evicted(victim, f"evicted because {why} and an asker with more credit "
                                     f"({credit:.0f} against {victim.credit:.0f}) wanted one")

    def _held(self, key: Callable[[SessionBook], str], weight: Weight) -> collections.Counter[str]:
        held: collections.Counter[str] = collections.Counter()
        for s in self.sessions.values():
            held[key(s)] += weight(s)
        return held

    def _evicted(self, victim: SessionBook, why: str) -> SessionBook:
        self.counts.evictions += 1
        self.fail(victim, ProtocolError(ErrorCode.CACHE_MISS, why))
        self.release(victim)
        return victim

    # ----- time

    def next_timer(self) -> float | None:
        """When the next idle session expires; None while none is idle."""
        idle = [s.last_used for s in self.sessions.values() if s.in_flight == 0]
        return min(idle) + self.limits.ttl if idle else None

    def handle_timer(self, now: float) -> list[SessionBook]:
        """Expires (fails and releases) every session idle for the TTL; returns them."""
        ttl = self.limits.ttl
        expired = [s for s in self.sessions.values() if s.in_flight == 0 and now - s.last_used >= ttl]
        for book in expired:
            self.counts.expirations += 1
            self.fail(book, ProtocolError(ErrorCode.CACHE_MISS, f"expired after {ttl:g} s idle"))
            self.release(book)
        return expired

    # ----- continuous batching

    @property
    def queued(self) -> bool:
        return bool(self._queue)

    def next_batch(self) -> list[Work[T]]:
        """Ready work of all sessions, one item per session so prefill chunks pipeline downstream; a
        session that ``joins`` gives every step it has queued, in order, up to the batch's rows."""
        batch: list[Work[T]] = []
        taken: set[int] = set()
        # sessions that left a step for the next call: their later steps wait too, so steps run in order
        held: set[int] = set()
        rows = 0
        rest: collections.deque[Work[T]] = collections.deque()
        while self._queue:
            work = self._queue.popleft()
            book = work.session
            if not self.holds(book) or book.phase is Phase.FAILED:
                continue
            if id(book) in held or id(book) in taken and not book.joins or rows + work.n > self.limits.n_batch:
                held.add(id(book))
                rest.append(work)
                continue
            batch.append(work)
            taken.add(id(book))
            rows += work.n
        self._queue = rest
        return batch

    def ran(self, work: Work[T], now: float) -> None:
        """The engine has run ``work``'s rows."""
        work.session.in_flight = max(0, work.session.in_flight - 1)
        self.touch(work.session, now)

    def samples(self, work: Work[T]) -> bool:
        """Whether the tail samples after ``work``'s last row (it reaches the end of the prompt)."""
        prompt_len = work.session.prompt_len
        return prompt_len is not None and work.pos + work.n >= prompt_len

    def sampled_rows(self, work: Work[T]) -> int:
        """How many of ``work``'s last rows the tail samples after: the last, and one per draft before it;
        in a check session, every row from the prompt's last on (a fast session's span, replayed as one
        step, whose receipt signs the token sampled from each of its rows)."""
        if work.session.joins:
            prompt_len = work.session.prompt_len
            return 0 if prompt_len is None else max(0, min(work.n, work.pos + work.n - prompt_len + 1))
        return work.drafts + 1 if self.samples(work) else 0

    def history(self, work: Work[T]) -> int:
        """How many of ``work``'s rows are prompt tokens (the sampler's penalty history)."""
        prompt_len = work.session.prompt_len
        return 0 if prompt_len is None else max(0, min(work.n, prompt_len - work.pos))

    def emit(self, book: SessionBook, eog: bool, piece: bytes, now: float) -> Emitted | None:
        """Decides what a sampled token does; None if the session takes no more tokens."""
        if book.phase is not Phase.DECODE:
            return None
        self.touch(book, now)
        if eog:
            book.phase = Phase.DONE
            return Emitted(index=None, done="eog", feed=False)
        index = book.generated
        book.generated += 1
        if book.stop:
            # a stop string newly complete ends inside this piece: look only at what precedes it
            text = book.tail + piece
            keep = max(len(s) for s in book.stop) - 1
            book.tail = text[-keep:] if keep else b""
            if any(s in text for s in book.stop):
                book.phase = Phase.DONE
                return Emitted(index=index, done="stop", feed=False)
        if book.generated >= book.max_tokens:
            book.phase = Phase.DONE
            return Emitted(index=index, done="max_tokens", feed=False)
        return Emitted(index=index, done=None, feed=True)
