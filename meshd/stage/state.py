"""What every part of the stage service shares.

A session's trio side (``Session``, and the ``Rows`` it queues for the engine),
and ``StageState``: the books, the engine, the sessions by book, the wake-ups
of the scheduler and the timer, and the few moves every part makes on them
(queue rows, fail or end a session, call the engine, wait for the prompt's ids).
The parts (``meshd.stage.sessions``, ``hops``, ``fast``, ``cached_prefix``,
``batching``, ``ring``, ``signing``) each hold one concern and this state; the
service (``meshd.stage.service``) wires them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from meshd.engine import ops
from meshd.engine.draft import DraftLength, DraftModelKV, NgramDrafter
from meshd.engine.engine import RangeReport
from meshd.engine.supervisor import EngineSupervisor, WorkerDown, WorkerRefused
from meshd.net.peers import Peers
from meshd.stage.books import SessionBook, StageBooks, StageLimits
from meshd.stage.metrics import StageMetrics
from meshd.stage.outlet import Outlet
from meshd.stage.receipts import SessionReceipts, Signer
from wire.errors import ErrorCode, ProtocolError
from wire.message import Message
from wire.receipt import PackedChain
from wire.stage import MAX_TOP_LOGPROBS, Grammar, Open, StepInput

# the tensor a step's hidden states travel as
HIDDEN = "hidden_states"


@dataclass(eq=False)
class Rows:
    """What one work item carries into the engine: token ids (head) or hidden states."""

    session: Session
    tokens: np.ndarray | None
    hidden: np.ndarray | None
    # token ids riding with the rows, to stages whose layers (or a later stage's) route by token id
    carry: Sequence[int] | None
    # with receipts on: the hash of the input as it travelled, and the checked chain that came with it
    h_in: bytes = b""
    chain: PackedChain | None = None
    # at the tail: the prompt's ids of these rows, its sampler's penalty history (from the asker)
    history: Sequence[int] | None = None


@dataclass(eq=False)
class Session:
    """The trio side of a session: its streams, channels and cancel scope."""

    book: SessionBook
    open: Open
    # messages for the asker, on the session's control stream
    to_asker: Outlet[Message]
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    # encoded activations for the next stage (or the ring to the head)
    downstream: Outlet[bytes] | None = None
    hop_info: trio.Event = field(default_factory=trio.Event)
    steps: int = 0
    # the tail's speculation: its drafter over the session's tokens, k, and the drafts in flight
    drafter: NgramDrafter | None = None
    draft_length: DraftLength | None = None
    drafts: list[int] = field(default_factory=list)
    # with a draft model: what its KV holds of this session (of which worker generation), and the
    # steps (token, position, k) waiting for its drafts
    draft_kv: DraftModelKV | None = None
    draft_generation: int = -1
    to_draft: trio.MemorySendChannel[tuple[int, int, int]] | None = None
    # the receipts this stage signs for the session (None: the asker did not ask for them)
    receipts: SessionReceipts | None = None
    # the tail: its receipt of the step whose sampled token goes around the ring next, and the
    # route's chain of that step, which rides to the asker inside the token (packed, as they travel)
    ring_receipt: bytes | None = None
    asker_chain: bytes | None = None
    # a check session: its receipts not yet sent (they go together once its queued steps have run)
    check_receipts: list[bytes] = field(default_factory=list)
    # and, across numerics (``Open.sketch``), a sketch of each one's output (wire.sketch)
    check_sketches: list[bytes] = field(default_factory=list)
    # with receipts on, past the head: each step's input as it came, until the asker takes it
    # (bounded by the session's token budget: one entry per position at most)
    kept: list[StepInput] = field(default_factory=list)
    # how many stages after this one get the token ids with the rows (the head's Prompt says, each
    # Hop one less); whether this stage's own rows come with them
    carry: int = 0
    gets_ids: bool = False
    # the tail: the prompt's token ids, as the asker sent them (no stage before it needs to see them)
    prompt_ids: list[int] | None = None
    prompt_ids_known: trio.Event = field(default_factory=trio.Event)
    # the tail: the grammar its sampler obeys and the tokens it read first (a sampler made anew takes both)
    grammar: tuple[Grammar, list[int]] | None = None
    # the fast path (meshd.engine.fastpath): this session's tag in the engine worker's events, and
    # whether the worker has taken it (it takes the session's connections only after that)
    fast_tag: int = 0
    fast_opened: trio.Event = field(default_factory=trio.Event)
    fast_ended: bool = False
    # the prefix cache: the keys of the prompt the asker looked up (an entry is kept of them when the
    # session ends cleanly), and at the head the prompt's ids, held until the asker's CacheUse
    prefix_keys: list[bytes] | None = None
    held_prompt: list[int] | None = None


class StageState:
    """The books, the engine and the sessions of one stage service, and the moves every part makes on them."""

    def __init__(self, peers: Peers, engine: EngineSupervisor, report: RangeReport, model_digest: str,
                 model_name: str, limits: StageLimits) -> None:
        self.peers = peers
        self.engine = engine
        self.report = report
        self.digest = model_digest
        self.model_name = model_name
        self.books: StageBooks[Rows] = StageBooks(limits)
        self.metrics = StageMetrics()
        self.sessions: dict[SessionBook, Session] = {}
        # fast sessions by the tag the engine worker's events name them by (unique to this service)
        self.fast: dict[int, Session] = {}
        # the scheduler sleeps until rows are queued or a slot is to be cleared
        self.wake = trio.Event()
        self.idle = trio.Event()
        self._timer_wake = trio.Event()
        self._timer_at: float | None = None
        # the prefix cache is on (--cache-tokens) and the model's memory allows it (a copy said so)
        self.caching = limits.cache_tokens > 0

    @functools.cached_property
    def signer(self) -> Signer:
        """This node's key for receipts, worked out when a session first asks for them."""
        return Signer(self.peers.identity)

    @property
    def limits(self) -> StageLimits:
        return self.books.limits

    def enqueue(self, session: Session, pos: int, n: int, rows: Rows, drafts: int = 0) -> None:
        for other in self.books.enqueue(session.book, pos, n, rows, trio.current_time(), drafts):
            self.ended(other)
        self.wake.set()

    async def expire(self) -> None:
        """Sleeps until the books' next timer, or until a session opens or goes idle."""
        while True:
            self._timer_wake = trio.Event()
            self._timer_at = self.books.next_timer()
            with trio.move_on_at(math.inf if self._timer_at is None else self._timer_at):
                await self._timer_wake.wait()
            for book in self.books.handle_timer(trio.current_time()):
                self.ended(book)

    def changed(self) -> None:
        """A session opened or went idle. Its expiry (now + TTL) is never before one already set,
        so only a timer task that sleeps without a deadline needs waking."""
        if self._timer_at is None:
            self._timer_wake.set()

    def fail(self, session: Session, error: ProtocolError) -> None:
        self.books.fail(session.book, error)
        session.scope.cancel()

    def ended(self, book: SessionBook) -> None:
        """The books failed or released ``book``: its task ends, the scheduler clears its KV."""
        session = self.sessions.get(book)
        if session is not None:
            session.scope.cancel()
        self.wake.set()

    def detach(self, session: Session) -> None:
        """Takes the session off the books now; the scheduler clears its KV before the next engine call."""
        self.books.release(session.book)
        if self.sessions.get(session.book) is session:
            del self.sessions[session.book]
        self.fast.pop(session.fast_tag, None)
        self.wake.set()
        if not self.books.sessions:
            self.idle.set()

    async def engine_call(self, op: ops.Op, payload: bytes | memoryview = b"",
                          fds: tuple[int, ...] = ()) -> tuple[dict[str, Any], bytearray]:
        try:
            return await self.engine.call(op.header(), payload, fds=fds)
        except WorkerDown as exc:
            raise ProtocolError(ErrorCode.INTERNAL, f"engine worker unavailable: {exc}") from exc
        except WorkerRefused as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"the engine refused: {exc}") from exc

    async def history(self, session: Session, pos: int, n: int) -> list[int] | None:
        """The prompt's ids of the rows at ``pos``, once the asker's have come (they race the rows)."""
        prompt_len = session.book.prompt_len or 0
        if pos >= prompt_len:
            return None
        with trio.move_on_after(self.limits.hop_timeout):
            await session.prompt_ids_known.wait()
        ids = session.prompt_ids
        if ids is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the asker sent this tail no token ids of the prompt")
        if len(ids) != prompt_len:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{len(ids)} token ids for a prompt of {prompt_len}")
        return ids[pos:min(pos + n, prompt_len)]


def sampler_new(session: Session, history: list[int] | None = None) -> ops.SamplerNew:
    """The tail's request for a sampler of the session's parameters, which reads ``history`` first."""
    return ops.SamplerNew(sid=session.book.slot, params=session.open.sampling, history=history or [],
                          # a check session across numerics: each pick's likeliest tokens go into its sketch (wire.sketch)
                          logprobs=min(session.open.sketch, MAX_TOP_LOGPROBS) if session.open.sketch
                          else session.open.logprobs)
