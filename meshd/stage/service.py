"""The stage service: one layer range served to many sessions over the stage protocol.

Each session holds one llama.cpp sequence (its KV) in the engine worker. Work
arrives as prefill chunks and decode steps (tokens at the head, residual rows
elsewhere); one scheduler task puts the ready work of all sessions into one
engine call per step (continuous batching) and hands each session's rows on:
downstream as an activation, or at the tail as a sampled token that goes to
the asker and around the ring to the head.

A session on the fast path (``Open.fast``) skips all of that per step: its
rows go from this stage's engine worker straight to the next one's
(meshd.engine.fastpath). Here it is admitted, its KV reserved whole in the
books, its connections set up (``Hop.fast``, meshd.stage.fast) and handed to
the worker, the tail's tokens streamed to the asker as the worker reports
them, and it is ended like any other.

What is decided (slots, budgets, eviction, expiry, batches, when a session
ends) lives in the sans-IO books (``books.py``); this file moves streams,
channels and engine calls, and sleeps until the books' next timer.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import trio
from pydantic import ValidationError

from meshd import steps
from meshd.engine.draft import DraftLength, DraftModelKV, NgramDrafter
from meshd.engine.engine import RangeReport
from meshd.engine.supervisor import EngineSupervisor, WorkerDown, WorkerRefused, WorkerSpec
from meshd.mesh.models import ModelNotFound
from meshd.mesh.records import host_of
from meshd.net.fastconn import accepted, detach
from meshd.net.fastpunch import RELAYED_HOP, connect_fast, fast_reaches
from meshd.net.peers import Peers, PeersConfig, open_peers
from meshd.net.stream import Stream
from meshd.stage.books import LIVE, Emitted, SessionBook, StageBooks, StageLimits, Work
from meshd.stage.fast import FastDoor, new_offer
from meshd.stage.outlet import Outlet
from meshd.stage.receipts import SessionReceipts, Signer
from meshd.stage.verify import chain_of, check_incoming, receipts_message
from meshd.store.manifest import Manifest, manifest_for
from relay.protocol import CIRCUIT_MARK
from wire.codec import Message, encode, error_message
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.receipt import MAX_CHAIN, SPAN, PackedChain, read_chain, row_hash, sampling_bytes
from wire.stage import (
    MAX_INPUTS_BYTES,
    PREFIX_BLOCK,
    STAGE_PROTOCOL,
    CacheFound,
    CacheLookup,
    CacheUse,
    Cancel,
    ChatTemplate,
    Done,
    Grammar,
    Hop,
    Inputs,
    InputsRequest,
    Metrics,
    MetricsRequest,
    Open,
    Opened,
    PeerRef,
    Prompt,
    PromptTokens,
    Released,
    Seal,
    StageInfo,
    StepInput,
    Token,
    TopLogprob,
)
from wire.tensors import Activation, TensorEntry, encode_activation, tensor_fields

__all__ = ["STAGE_PROTOCOL", "StageLimits", "StageNode", "StageService", "answer_typed", "stage_node"]

log = logging.getLogger(__name__)

HIDDEN = "hidden_states"
# Hidden states up to this size (float32, decoded) are decoded on the event
# loop: a decode step's row costs less than the hop to a thread. Larger ones
# (prefill chunks) go to a thread.
INLINE_DECODE_BYTES = 256 << 10


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


# how the draft model picks its drafts: its most likely token
GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0, "repeat_last_n": 0,
          "seed": 0}


# Whether a stage may dial a peer an Open names (its next stage, or the head for the
# ring): returns quietly, or raises a ProtocolError saying why not.
DialCheck = Callable[[PeerRef], None]


def plain_address(ref: PeerRef) -> None:
    """Without a member table (a bare stage): ``host:port`` or a relay circuit, never a URL with a
    path, a query or another scheme, so an Open cannot aim the stage at some other service."""
    relay, mark, _ = ref.address.partition(CIRCUIT_MARK)
    address = relay if mark else ref.address
    try:
        parts = urlsplit(address if address.startswith("ws://") else f"ws://{address}")
        port = parts.port
    except ValueError:
        port = None
    if port is None or not parts.hostname or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a stage dials only host:port addresses")


class StageMetrics:
    def __init__(self) -> None:
        self.engine_calls = 0
        self.rows = 0
        # rows past their session's prompt: one per generated token, the console's live tok/s
        self.decode_rows = 0
        self.session_slots = 0
        self.multi_session_calls = 0
        self.max_sessions_per_call = 0
        self.step_ms: collections.deque[float] = collections.deque(maxlen=512)
        # the engine worker's own counts of the fast sessions' batches (meshd.engine.fastpath), as
        # it last told them, and those of the workers before it (the counts only grow: the console's
        # live figures are their differences)
        self.fast: dict[str, int] = {}
        self.fast_before: collections.Counter[str] = collections.Counter()

    def fast_count(self, key: str) -> int:
        """The workers' counts of ``key`` as one: a maximum stays a maximum, a count adds up."""
        before, now = self.fast_before[key], self.fast.get(key, 0)
        return max(before, now) if key == "max_sessions_per_call" else before + now

    def worker_gone(self) -> None:
        """The worker and its counts are gone: what it last told is kept."""
        for key in self.fast:
            self.fast_before[key] = self.fast_count(key)
        self.fast = {}

    def record_call(self, sessions: int, rows: int, seconds: float, decode_rows: int) -> None:
        self.engine_calls += 1
        self.rows += rows
        self.decode_rows += decode_rows
        self.session_slots += sessions
        self.multi_session_calls += sessions > 1
        self.max_sessions_per_call = max(self.max_sessions_per_call, sessions)
        self.step_ms.append(seconds * 1000.0)


class StageService:
    def __init__(self, peers: Peers, engine: EngineSupervisor, report: RangeReport, model_digest: str,
                 model_name: str, limits: StageLimits = StageLimits(), may_dial: DialCheck = plain_address,
                 draft_engine: EngineSupervisor | None = None, door: FastDoor | None = None,
                 credit_of: Callable[[str], float] | None = None) -> None:
        self.peers = peers
        # a member's credit (meshd.mesh.credit.priority), which ranks its sessions under contention
        self.credit_of = credit_of
        # fast-path connections meet their sessions here (one door per node, shared by its services)
        self.door = door or FastDoor()
        # fast sessions by the tag the engine worker's events name them by (unique to this service)
        self._fast: dict[int, Session] = {}
        # the model's chat template, once an asker asked for it (Open.chat_template)
        self._chat: ChatTemplate | None = None
        self._fast_tags = itertools.count(1)
        # fast sessions the books ended before their worker did (a stop string): it is told to stop
        self._fast_end_send, self._fast_end_recv = trio.open_memory_channel[Session](math.inf)
        # the tail's draft model (same vocabulary), for sessions that speculate with "model"
        self.draft_engine = draft_engine
        self.may_dial = may_dial
        self.engine = engine
        self.report = report
        self.digest = model_digest
        self.model_name = model_name
        self.books: StageBooks[Rows] = StageBooks(limits)
        self.metrics = StageMetrics()
        self._sessions: dict[SessionBook, Session] = {}
        self._wake = trio.Event()
        self._idle = trio.Event()
        self._timer_wake = trio.Event()
        self._timer_at: float | None = None
        # one decode thread: zstd's module-level decompressor is not for concurrent use
        self._decoder = trio.CapacityLimiter(1)
        # the prefix cache is on (--cache-tokens) and the model's memory allows it (a copy said so)
        self.caching = limits.cache_tokens > 0

    @functools.cached_property
    def signer(self) -> Signer:
        """This node's key for receipts, worked out when a session first asks for them."""
        return Signer(self.peers.identity)

    @property
    def limits(self) -> StageLimits:
        return self.books.limits

    @property
    def sessions(self) -> dict[str, SessionBook]:
        return self.books.sessions

    # ----- wiring

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._schedule)
            nursery.start_soon(self._expire)
            nursery.start_soon(self._end_fast)
            task_status.started()

    def on_worker_down(self, generation: int, reason: str) -> None:
        """The worker's KV is gone: every session on it fails, typed and retryable."""
        error = ProtocolError(ErrorCode.INTERNAL, f"stage [{self.report.layer_begin}, {self.report.layer_end}) "
                                                   f"lost its engine worker ({reason})")
        for book in self.books.fail_all(error):
            self._ended(book)
        self.metrics.worker_gone()

    async def handle_stream(self, stream: Stream) -> None:
        await answer_typed(stream, self.handle_first)

    def holds(self, session: str) -> bool:
        return session in self.books.sessions

    async def wait_idle(self) -> None:
        """Returns once no session is held (a retiring range waits for its last one)."""
        while self.sessions:
            await self._idle.wait()
            self._idle = trio.Event()

    async def handle_first(self, stream: Stream, first: Message) -> None:
        """Serves a stage stream whose first message has been read."""
        if isinstance(first, MetricsRequest):
            try:
                reply, _ = await self._engine_call({"op": "fast_stats"})
                self.metrics.fast = dict(reply["stats"])
            except ProtocolError:
                pass  # the worker is down: its last counts stand
            await stream.send_message(Metrics(values=self.metric_values()))
        elif isinstance(first, Open):
            await self._serve_session(stream, first)
        elif isinstance(first, Hop):
            await self._serve_hop(stream, first)
        else:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"a stage stream cannot start with {first.type!r}")

    def info(self) -> StageInfo:
        r = self.report
        return StageInfo(node_id=self.peers.node_id, model_digest=self.digest, model_name=self.model_name,
                         layer_begin=r.layer_begin, layer_end=r.layer_end, n_layer=r.n_layer, stage_width=r.stage_width,
                         ready=self.engine.is_up, needs_tokens=r.needs_tokens, numerics=r.numerics,
                         cache_tokens=self.limits.cache_tokens if self.caching else 0)

    def metric_values(self) -> dict[str, float]:
        m, counts = self.metrics, self.books.counts
        steps = sorted(m.step_ms)
        # the slow path's engine calls (the daemon's) and the fast path's (the worker's), together
        fast = m.fast_count
        calls = m.engine_calls + fast("engine_calls")
        slots = m.session_slots + fast("session_slots")
        return {
            "sessions": float(len(self.books.sessions)),
            "kv_tokens": float(self.books.total_tokens),
            "engine_calls": float(calls),
            "rows": float(m.rows + fast("rows")),
            "decode_rows": float(m.decode_rows + fast("decode_rows")),
            "sessions_per_call": slots / calls if calls else 0.0,
            "max_sessions_per_call": float(max(m.max_sessions_per_call, fast("max_sessions_per_call"))),
            "multi_session_calls": float(m.multi_session_calls + fast("multi_session_calls")),
            "step_ms_p50": steps[len(steps) // 2] if steps else 0.0,
            "step_ms_p99": steps[min(len(steps) - 1, math.ceil(len(steps) * 0.99) - 1)] if steps else 0.0,
            "evictions": float(counts.evictions),
            "expirations": float(counts.expirations),
            "overloaded": float(counts.overloaded),
            "released": float(counts.released),
            "draft_rewinds": float(counts.rewinds + fast("draft_rewinds")),
            # the worker's software on fast-path decode hops (totals: FastPlane.stats)
            "fast_decode_calls": float(fast("decode_calls")),
            "fast_hop_in_us": float(fast("hop_in_us")),
            "fast_hop_out_us": float(fast("hop_out_us")),
            # the prefix cache: tokens its entries hold, lookups and hits, prompt tokens asked for and found
            "cache_tokens": float(self.books.cache.tokens),
            "cache_lookups": float(self.books.cache.counts.lookups),
            "cache_hits": float(self.books.cache.counts.hits),
            "cache_looked_tokens": float(self.books.cache.counts.looked_tokens),
            "cache_hit_tokens": float(self.books.cache.counts.hit_tokens),
            "cache_evictions": float(self.books.cache.counts.evictions),
            "worker_restarts": float(self.engine.restarts),
            "worker_up": float(self.engine.is_up),
        }

    # ----- sessions (the asker's control stream owns the session's lifetime)

    def _check_open(self, msg: Open) -> None:
        r = self.report
        if msg.receipts and msg.speculate != "off" and not msg.fast:
            # (the fast path signs spans of final rows: meshd.engine.spans)
            raise ProtocolError(ErrorCode.BAD_REQUEST, "receipts on the daemons' path sign one step at a time: "
                                                       "not with speculation")
        if msg.check and not msg.receipts:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a check session is there for its receipts")
        if msg.fast and (msg.check or msg.speculate == "model" or (msg.wire_dtype, msg.wire_codec) != ("f32", "raw")
                         or r.has_input and r.has_output):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the fast path carries f32 rows of a split route, without "
                                                       "a draft model")
        if msg.model_digest is not None and msg.model_digest != self.digest:
            raise ProtocolError(ErrorCode.MODEL_MISMATCH, f"this stage serves model {self.digest[:16]}, "
                                                          f"not {msg.model_digest[:16]}")
        wanted = (msg.layer_begin, msg.layer_end)
        if wanted != (None, None) and wanted != (r.layer_begin, r.layer_end):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"this stage serves layers [{r.layer_begin}, {r.layer_end}), "
                                                       f"not [{msg.layer_begin}, {msg.layer_end})")
        if self.engine.gone is not None:
            # Not OVERLOADED: asked again, this stage never serves it (the node withdrew the range).
            # Why in full (a local path) is for the log; the asker learns that it will not come back.
            raise ProtocolError(ErrorCode.NOT_FOUND, f"layers [{r.layer_begin}, {r.layer_end}) of {self.model_name} "
                                                     f"are withdrawn here: the engine worker failed to start "
                                                     f"{self.engine.give_up_after} times in a row")
        if not self.engine.is_up:
            raise ProtocolError(ErrorCode.OVERLOADED, "the engine worker is restarting",
                                retry_after_ms=self.limits.retry_after_ms)

    def _credit(self, stream: Stream, msg: Open) -> float:
        """The credit of the member the session asks for: the opener's own, or the member whose voucher
        for the opener it carries (an identity of `meshd ask`'s or a front door's own)."""
        if self.credit_of is None:
            return 0.0
        payer = stream.remote_node_id
        if msg.payer is not None and msg.payer.valid_for(payer, time.time()):
            payer = msg.payer.payer
        return self.credit_of(payer)

    def _downstream_target(self, msg: Open) -> tuple[PeerRef, bool] | None:
        """Where this stage's output goes: the next stage, or (the tail) the ring to the head."""
        if not self.report.has_output:
            return None if msg.next is None else (msg.next, False)
        if not self.report.has_input:
            return None if msg.head is None else (msg.head, True)
        return None

    def _check_downstream(self, session: Session) -> None:
        """Work needs somewhere to go. An Open without it is still answered, with what this stage
        serves, so an asker given bare addresses can tell what its route leaves uncovered."""
        if session.downstream is not None or session.open.check or self.report.has_input and self.report.has_output:
            return
        if not self.report.has_output:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a stage before the tail needs the next stage's address")
        raise ProtocolError(ErrorCode.BAD_REQUEST, "the tail needs the head's address for the token ring")

    async def _serve_session(self, stream: Stream, msg: Open) -> None:
        self._check_open(msg)
        target = self._downstream_target(msg)
        if target is not None:
            self.may_dial(target[0])
            if msg.fast and not fast_reaches(target[0].address, self.peers.link_to(target[0].node_id or "")):
                raise ProtocolError(ErrorCode.BAD_REQUEST, RELAYED_HOP)
        book, gone = self.books.open(msg.session, msg.epoch, self.engine.generation, msg.max_tokens, msg.stop,
                                     trio.current_time(), owner=stream.remote_node_id, upstream=msg.upstream,
                                     source=host_of(stream.link.address), credit=self._credit(stream, msg))
        for other in gone:
            self._ended(other)
        # a check session's replay runs the steps fed together in one engine call (``SessionBook.joins``)
        book.joins = msg.check
        session = Session(book=book, open=msg, to_asker=Outlet(encode))
        if msg.fast:
            session.fast_tag = next(self._fast_tags)
            self._fast[session.fast_tag] = session
        if msg.receipts:
            session.receipts = SessionReceipts(self.signer, book.id, book.epoch, self.digest,
                                               self.report.layer_begin, self.report.layer_end)
        draft_recv: trio.MemoryReceiveChannel[tuple[int, int, int]] | None = None
        if self.report.has_output and msg.speculate != "off":
            # exact for seeded sampling too: the worker samples a step's rows in order and stops
            # at the first pick that is not the draft, so the sampler draws what it would without drafts
            if msg.speculate == "model":
                if self.draft_engine is None:
                    raise ProtocolError(ErrorCode.BAD_REQUEST, "this tail has no draft model (meshd serve "
                                                               "--draft-model); speculate with ngram")
                session.draft_kv = DraftModelKV()
                session.to_draft, draft_recv = trio.open_memory_channel[tuple[int, int, int]](math.inf)
            # the model drafter keeps the session's tokens in it too
            session.drafter = NgramDrafter()
            session.draft_length = DraftLength(msg.max_draft)
        self._sessions[book] = session
        self._changed()
        hop_stream: Stream | None = None
        try:
            with session.scope:
                await self._engine_call({"op": "remove", "seq": book.slot})
                if self.report.has_output:
                    s = msg.sampling
                    await self._engine_call({"op": "sampler_new", "sid": book.slot, "params": {
                        "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                        "repeat_penalty": s.repeat_penalty, "repeat_last_n": s.repeat_last_n, "seed": s.seed},
                        "logprobs": msg.logprobs})
                if target is not None:
                    # The next stage is dialled now, not once the prompt's length is
                    # known: every stage of a cold route pays its handshake while the
                    # others pay theirs. The ring waits for the prompt: in a two-stage
                    # route the head is dialling this stage right now, and the ring then
                    # reuses that link instead of racing it with a duplicate.
                    if not target[1]:
                        hop_stream = await self._open_hop(target[0], False)
                    session.downstream = Outlet(bytes)
                self.books.opened(book)
                chat = await self._chat_template() if msg.chat_template and self.report.has_input else None
                await stream.send_message(Opened(session=book.id, epoch=book.epoch, info=self.info(), chat=chat))
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(session.to_asker.run, stream)
                    if draft_recv is not None:
                        nursery.start_soon(self._model_drafts, session, draft_recv)
                    if target is not None and session.downstream is not None:
                        nursery.start_soon(self._downstream, session, target[0], target[1], hop_stream,
                                           session.downstream)
                    await self._control_loop(stream, session)
                    nursery.cancel_scope.cancel()
                if book.failure is None:
                    await self._keep_prefix(session)
            # off the books before the asker hears of the failure
            self._detach(session)
            if book.failure is not None:
                await stream.send_message(error_message(book.failure))
        finally:
            with trio.CancelScope(shield=True):
                if hop_stream is not None:
                    await hop_stream.aclose()
            self._detach(session)
        try:
            await stream.send_message(Released(session=book.id))
        except ProtocolError:
            pass

    async def _open_hop(self, target: PeerRef, ring: bool) -> Stream:
        what = "the head" if ring else "the next stage"
        try:
            with trio.fail_after(self.limits.hop_timeout):
                return await self.peers.open_stream(target.address, STAGE_PROTOCOL, node_id=target.node_id)
        except (trio.TooSlowError, ProtocolError):
            # what the far side said (a status, a reason) stays here: an Open must not make this
            # stage a probe of other services
            raise ProtocolError(ErrorCode.UNREACHABLE, f"{what} {target.address} is unreachable") from None

    async def _control_loop(self, stream: Stream, session: Session) -> None:
        try:
            await self._control_messages(stream, session)
        except ProtocolError as exc:
            self._fail(session, exc)

    async def _control_messages(self, stream: Stream, session: Session) -> None:
        book = session.book
        while True:
            try:
                msg = await stream.receive_message()
            except trio.EndOfChannel:
                return
            self.books.touch(book, trio.current_time())
            if isinstance(msg, Cancel):
                return
            if isinstance(msg, Prompt):
                if msg.session != book.id or msg.epoch != book.epoch:
                    raise ProtocolError(ErrorCode.EPOCH_STALE, "prompt for another session or epoch")
                await self._prompt(session, msg)
            elif isinstance(msg, PromptTokens):
                await self._take_prompt_ids(session, msg)
            elif isinstance(msg, CacheLookup):
                await self._cache_lookup(session, msg)
            elif isinstance(msg, CacheUse):
                await self._cache_use(session, msg)
            elif isinstance(msg, InputsRequest):
                if session.open.fast and session.receipts is not None and not self.report.has_input:
                    await self._fast_inputs(session, msg)
                else:
                    self._send_inputs(session, msg)
            elif isinstance(msg, Seal):
                await self._seal(session, msg)
            else:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected {msg.type!r} on a session stream")

    async def _prompt(self, session: Session, msg: Prompt) -> None:
        book = session.book
        if not self.report.has_input:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "only the head stage takes the prompt")
        if book.prompt_len is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the session already has its prompt")
        self._check_downstream(session)
        given = [msg.messages is not None, msg.text is not None, msg.tokens is not None]
        if sum(given) != 1:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a prompt has exactly one of messages, text or tokens")
        if msg.tokens is not None:
            tokens = list(msg.tokens)
            self.books.set_prompt(book, len(tokens))
            steps.check_ids(tokens, self.report.n_vocab)
        else:
            # Bounded before the engine worker sees it: the text must fit the session budget.
            request: dict[str, Any] = {"op": "tokenize", "special": msg.special}
            if msg.messages is not None:
                self.books.check_prompt_bytes(sum(len(m.role.encode()) + len(m.content.encode())
                                                  for m in msg.messages))
                request["messages"] = [{"role": m.role, "content": m.content} for m in msg.messages]
            else:
                assert msg.text is not None
                self.books.check_prompt_bytes(len(msg.text.encode()))
                request["text"] = msg.text
            reply, _ = await self._engine_call(request)
            tokens = reply["tokens"]
            self.books.set_prompt(book, len(tokens))
        if msg.grammar is not None:
            if not self.report.has_output:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "a grammar goes to the tail, with the prompt's token ids")
            await self._set_grammar(session, msg.grammar, tokens[len(tokens) - min(msg.generated, len(tokens)):])
        session.carry = msg.carry_tokens
        if msg.cache:
            # the asker looks the prompt's prefix up on every stage first, and then says where it begins
            session.held_prompt = tokens
            session.to_asker.send_nowait(PromptTokens(session=book.id, epoch=book.epoch, tokens=tokens))
            return
        await self._run_prompt(session, tokens, tell=True)

    async def _run_prompt(self, session: Session, tokens: list[int], tell: bool) -> None:
        """Runs the prompt's rows from where the session starts (past a cached prefix, if it has one)."""
        book = session.book
        if session.open.fast:
            # the worker runs the prompt and the ring's tokens itself, once its connections come
            await self._fast_open(session, prompt=tokens)
        session.hop_info.set()
        if tell:
            session.to_asker.send_nowait(PromptTokens(session=book.id, epoch=book.epoch, tokens=tokens))
        if session.open.fast:
            return
        arr = np.asarray(tokens, dtype=np.int32)
        chunk = self.limits.prefill_chunk
        whole = self.report.has_output
        for start in range(book.start, len(arr), chunk):
            part = arr[start:start + chunk]
            h_in = row_hash(part.tobytes()) if session.receipts is not None else b""
            ids = part.tolist()
            self._enqueue(session, start, len(part), Rows(session, part, None, ids if session.carry else None, h_in,
                                                          history=ids if whole else None))

    # ----- the prefix cache (meshd.stage.prefix)

    async def _cache_lookup(self, session: Session, msg: CacheLookup) -> None:
        """Copies the longest prefix of the asker's keys that an entry of the same asker holds into the
        session's sequence, before any of its rows run, and says how many positions that is."""
        book = session.book
        if (msg.session, msg.epoch) != (book.id, book.epoch):
            raise ProtocolError(ErrorCode.EPOCH_STALE, "a lookup for another session or epoch")
        if session.prefix_keys is not None or book.next_pos or book.in_flight or book.phase not in LIVE:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a session looks its prefix up once, before its rows")
        if session.receipts is not None and not session.open.fast or session.open.check:
            # a range's spot check replays the stage's kept inputs on a replica, and a cached prefix's were
            # never sent (the fast path's chain of replicas is fed the token ids: it computes the prefix)
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a session with receipts on the daemons' path takes no "
                                                       "cached prefix")
        if len(msg.keys) * PREFIX_BLOCK > self.limits.max_session_tokens:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{len(msg.keys)} prefix keys exceed this stage's session "
                                                       f"budget of {self.limits.max_session_tokens} tokens")
        session.prefix_keys = list(msg.keys)
        found = 0
        entry, shared = self.books.cache.find(book.owner, msg.keys, trio.current_time()) if self.caching \
            else (None, 0)
        if entry is not None:
            # the entry's sequence is not given to a new session while its cells are copied
            self.books.cache.pin(entry)
            try:
                await self._engine_call({"op": "prefix_copy", "src": entry.slot, "dst": book.slot,
                                         "n": shared * PREFIX_BLOCK})
                found = shared * PREFIX_BLOCK
            except ProtocolError as exc:
                if exc.code is not ErrorCode.BAD_REQUEST:
                    raise
                # this model's memory is more than its cells (a sliding window, a recurrent state)
                log.info("the prefix cache is off: %s", exc.message)
                self.caching = False
                self.books.drop_cache(self.engine.generation)
            finally:
                self.books.cache.unpin(entry)
        book.found = found
        session.to_asker.send_nowait(CacheFound(session=book.id, epoch=book.epoch, tokens=found))

    async def _cache_use(self, session: Session, msg: CacheUse) -> None:
        """The head: the asker's word on where the prompt's rows begin (the least every stage found)."""
        book = session.book
        tokens = session.held_prompt
        if (msg.session, msg.epoch) != (book.id, book.epoch):
            raise ProtocolError(ErrorCode.EPOCH_STALE, "a cache word for another session or epoch")
        if tokens is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "only a head holding a prompt for the cache takes CacheUse")
        session.held_prompt = None
        await self._start(session, msg.tokens, tokens[:msg.tokens])
        await self._run_prompt(session, tokens, tell=False)

    async def _start(self, session: Session, pos: int, history: list[int] | None = None) -> None:
        """The session's rows begin at ``pos``, past the cached prefix its sequence holds: the KV past it
        goes, and the daemons' tail samples with the prefix's ids in its penalty history."""
        book = session.book
        if not pos and not book.found:
            return
        for other in self.books.start_at(book, pos, trio.current_time()):
            self._ended(other)
        if book.found > pos:
            await self._engine_call({"op": "remove", "seq": book.slot, "p0": pos, "p1": -1})
        if pos and self.report.has_output and not session.open.fast:
            if history is None:
                history = await self._history(session, 0, pos)
            s = session.open.sampling
            await self._engine_call({"op": "sampler_new", "sid": book.slot, "history": history, "params": {
                "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                "repeat_penalty": s.repeat_penalty, "repeat_last_n": s.repeat_last_n, "seed": s.seed},
                "logprobs": session.open.logprobs})
            if session.grammar is not None:
                # the new sampler obeys the session's grammar as the one it replaces did
                await self._engine_call({"op": "sampler_grammar", "sid": book.slot,
                                         "spec": session.grammar[0].model_dump(), "generated": session.grammar[1]})

    async def _keep_prefix(self, session: Session) -> None:
        """A session that ended cleanly leaves its sequence's prompt prefix as a cache entry."""
        book, keys = session.book, session.prefix_keys
        if not self.caching or not keys or not self.books.holds(book) or book.generation != self.engine.generation:
            return
        try:
            reply, _ = await self._engine_call({"op": "prefix_keep", "seq": book.slot,
                                                "upto": len(keys) * PREFIX_BLOCK})
        except ProtocolError:
            return
        self.books.keep(book, keys[:int(reply["tokens"]) // PREFIX_BLOCK], trio.current_time())

    async def _chat_template(self) -> ChatTemplate:
        """The model's chat template, read once from the engine (it is the file's)."""
        if self._chat is None:
            reply, _ = await self._engine_call({"op": "chat_info"})
            try:
                self._chat = ChatTemplate(**reply["chat"])
            except ValidationError:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "the model's chat template is larger than the stage "
                                                           "protocol carries") from None
        return self._chat

    async def _set_grammar(self, session: Session, grammar: Grammar, generated: list[int]) -> None:
        """The tail's sampler obeys ``grammar`` from its next pick; ``generated`` (a re-prefill's answer so
        far) is read by the grammar first. Neither a fast session nor speculation samples here."""
        if session.open.fast or session.open.speculate != "off":
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a grammar-constrained session takes neither the fast "
                                                       "path nor speculation")
        if session.grammar is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the session already has its grammar")
        await self._engine_call({"op": "sampler_grammar", "sid": session.book.slot,
                                 "spec": grammar.model_dump(), "generated": generated})
        session.grammar = (grammar, generated)

    async def _take_prompt_ids(self, session: Session, msg: PromptTokens) -> None:
        """The tail's penalty history and drafter text, from the asker: the head sends the ids on
        only as far as a stage needs them."""
        book = session.book
        if (msg.session, msg.epoch) != (book.id, book.epoch):
            raise ProtocolError(ErrorCode.EPOCH_STALE, "prompt tokens of another session or epoch")
        # a check session of the whole model, which its opener feeds rows and ids, takes them for its grammar
        whole_check = self.report.has_input and session.open.check and msg.grammar is not None
        if not self.report.has_output or self.report.has_input and not whole_check:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "only a tail after the head takes the prompt's token ids")
        if session.prompt_ids is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the session already has the prompt's token ids")
        if len(msg.tokens) > self.limits.max_session_tokens:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{len(msg.tokens)} token ids exceed this stage's session "
                                                       f"budget of {self.limits.max_session_tokens} tokens")
        if book.prompt_len is not None and len(msg.tokens) != book.prompt_len:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{len(msg.tokens)} token ids for a prompt of "
                                                       f"{book.prompt_len}")
        steps.check_ids(msg.tokens, self.report.n_vocab)
        if msg.grammar is not None:
            # before the rows' history is known, so before the first pick
            await self._set_grammar(session, msg.grammar, list(msg.tokens[len(msg.tokens) - min(msg.generated,
                                                                                                len(msg.tokens)):]))
        session.prompt_ids = list(msg.tokens)
        session.prompt_ids_known.set()

    async def _history(self, session: Session, pos: int, n: int) -> list[int] | None:
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

    async def _downstream(self, session: Session, target: PeerRef, ring: bool, hop_stream: Stream | None,
                          outlet: Outlet[bytes]) -> None:
        """Sends this session's output to the next stage (or, at the tail, the ring to the head)."""
        await session.hop_info.wait()
        if hop_stream is None:
            try:
                hop_stream = await self._open_hop(target, ring)
            except ProtocolError as exc:
                self._fail(session, exc)
                return
            # this task dialled it, so it closes it
            async with hop_stream:
                await self._downstream_to(session, target, ring, hop_stream, outlet)
        else:
            await self._downstream_to(session, target, ring, hop_stream, outlet)

    async def _downstream_to(self, session: Session, target: PeerRef, ring: bool, hop_stream: Stream,
                             outlet: Outlet[bytes]) -> None:
        book = session.book
        offer = new_offer() if session.open.fast else None
        try:
            await hop_stream.send_message(Hop(session=book.id, epoch=book.epoch, ring=ring,
                                              prompt_tokens=book.prompt_len or 0,
                                              carry_tokens=0 if ring else session.carry, fast=offer,
                                              start=0 if ring else book.start))
            if offer is None:
                # from now on a step's rows go straight onto the stream when they can (Outlet)
                await outlet.run(hop_stream)
                return
            conn = await connect_fast(target.address, hop_stream.link, offer.token, self.limits.hop_timeout)
            async with conn:
                with trio.fail_after(self.limits.hop_timeout):
                    await session.fast_opened.wait()
                # the worker writes at once: the far daemon hands on what came after the preamble
                # with the connection, so its answer costs the session no round trip
                sock = detach(conn)
                try:
                    await self._engine_call({"op": "fast_link", "seq": book.slot, "tag": session.fast_tag,
                                             "out": True, "key": offer.key}, fds=(sock.fileno(),))
                finally:
                    sock.close()
                await accepted(conn, target.address, self.limits.hop_timeout)
            # the rows go on the fast connection; the stream ends when the next stage lets the session go
            msg = await hop_stream.receive_message()
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected {msg.type!r} on a fast hop stream")
        except trio.EndOfChannel:
            return
        except trio.TooSlowError:
            self._fail(session, ProtocolError(ErrorCode.INTERNAL, "the session's engine worker never took it"))
        except ProtocolError as exc:
            if exc.message.startswith(RELAYED_HOP):
                # no fast-path connection opened to a stage behind a NAT: nobody is lost, and the asker
                # goes on on the daemons' path
                self._fail(session, exc)
                return
            what = "the head" if ring else "the next stage"
            self._fail(session, ProtocolError(ErrorCode.UNREACHABLE, f"lost {what} {target.address}: {exc}"))

    async def _serve_hop(self, stream: Stream, hop: Hop) -> None:
        book = self.books.sessions.get(hop.session)
        session = None if book is None else self._sessions.get(book)
        if book is None or session is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no session {hop.session} on this stage")
        # refused without failing the session: a stranger's hop must not end someone else's work
        self.books.check_upstream(book, stream.remote_node_id)
        if hop.epoch != book.epoch:
            raise ProtocolError(ErrorCode.EPOCH_STALE, f"session {hop.session} is at epoch {book.epoch}")
        if hop.ring != self.report.has_input:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "ring streams go to the head, hop streams elsewhere")
        try:
            self._check_downstream(session)
            if not hop.ring or session.open.check:
                self.books.set_prompt(book, hop.prompt_tokens)
            if not hop.ring:
                await self._start(session, hop.start)
            if not hop.ring:
                session.gets_ids = hop.carry_tokens > 0
                if self.report.needs_tokens and not session.gets_ids:
                    raise ProtocolError(ErrorCode.BAD_REQUEST, "this stage routes experts by token id: "
                                                               "the session must send it the token ids")
                session.carry = max(0, hop.carry_tokens - 1)
            if not hop.ring or session.open.check:
                session.hop_info.set()
            if session.open.fast:
                await self._serve_fast_hop(stream, session, hop)
                return
            # a check session's rows come from its opener, who has no receipt to give for them
            wanted = session.receipts is not None and not session.open.check
            # a decode step's rows are queued as they arrive, without waking this task
            stream.set_message_hook(functools.partial(self._activation_nowait, session, wanted,
                                                      stream.remote_node_id))
            while True:
                try:
                    msg = await stream.receive_message()
                except trio.EndOfChannel:
                    return
                if not self.books.holds(book) or book.phase not in LIVE:
                    return
                if not isinstance(msg, Activation):
                    raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected {msg.type!r} on a hop stream")
                await self._accept_activation(session, msg, chain_of(msg, wanted, stream.remote_node_id))
        except ProtocolError as exc:
            self._fail(session, exc)
            raise

    # ----- the fast path: rows go worker to worker (meshd.engine.fastpath); the daemon sets it up

    async def _fast_open(self, session: Session, prompt: list[int] | None = None) -> None:
        """Reserves the session's KV in the books and hands the session to the engine worker."""
        book = session.book
        prompt_len = book.prompt_len or 0
        history = None
        if self.report.has_output:
            history = await self._history(session, 0, prompt_len)
        for other in self.books.reserve(book, prompt_len + book.max_tokens, trio.current_time()):
            self._ended(other)
        await self._engine_call({"op": "fast_open", "seq": book.slot, "tag": session.fast_tag,
                                 "max_pos": book.next_pos, "prompt_len": prompt_len, "max_tokens": book.max_tokens,
                                 "start": book.start,
                                 "carry": session.carry, "gets_ids": session.gets_ids, "prompt": prompt,
                                 "history": history, "chunk": self.limits.prefill_chunk,
                                 "span": SPAN if session.receipts is not None else 0,
                                 "max_draft": session.open.max_draft if session.open.speculate == "ngram" else 0})
        session.fast_opened.set()

    async def _serve_fast_hop(self, stream: Stream, session: Session, hop: Hop) -> None:
        """A fast session's rows (at the head, the ring's tokens) come on the connection the Hop
        offers: the worker takes it once it has the session; the stream only ends."""
        offer = hop.fast
        if offer is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the session takes the fast path: its hop must offer "
                                                       "the connection")
        expected = self.door.expect(offer.token)
        try:
            if not hop.ring:
                await self._fast_open(session)
            with trio.move_on_after(self.limits.hop_timeout):
                await expected.arrived.wait()
                await session.fast_opened.wait()
            if expected.sock is None or not session.fast_opened.is_set():
                raise ProtocolError(ErrorCode.UNREACHABLE, "the fast-path connection from the previous stage "
                                                           "never came")
            await self._engine_call({"op": "fast_link", "seq": session.book.slot, "tag": session.fast_tag,
                                     "out": False, "key": offer.key}, fds=(expected.sock.fileno(),))
        finally:
            self.door.forget(offer.token)
            expected.close()
        try:
            msg = await stream.receive_message()
        except trio.EndOfChannel:
            return
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected {msg.type!r} on a fast hop stream")

    def on_engine_event(self, event: dict[str, Any]) -> None:
        """What the engine worker says of a fast session unasked: a sampled token (the tail), a failure."""
        if event.get("ev") == "stats":
            self.metrics.fast = dict(event["stats"])
            return
        session = self._fast.get(int(event.get("tag", 0)))  # tags count from 1
        if session is None or not self.books.holds(session.book):
            return
        if event.get("ev") == "error":
            code = ErrorCode(event["code"]) if event.get("code") in ErrorCode.__members__ else ErrorCode.INTERNAL
            self._fail(session, ProtocolError(code, str(event.get("message"))))
        elif event.get("ev") == "span":
            self._sign_span(session, int(event["pos"]), int(event["n"]), bytes(event["h_in"]), bytes(event["h_out"]))
        elif event.get("ev") == "token":
            if session.draft_length is not None and "drafted" in event:
                # the worker drafts and verifies; Done reports its counts
                session.draft_length.drafted, session.draft_length.accepted = event["drafted"], event["accepted"]
            if not self._emit(session, int(event["token"]), bool(event["eog"]), bytes(event["piece"]),
                              trio.current_time()) and not session.fast_ended:
                # the books ended it (a stop string): the worker stops too
                session.fast_ended = True
                self._fast_end_send.send_nowait(session)

    def _sign_span(self, session: Session, pos: int, n: int, h_in: bytes, h_out: bytes) -> None:
        """Signs a fast session's span as its worker hashed it and sends it to the asker, this stage's
        receipt alone: the asker checks that each stage's input is the one before's output."""
        receipts = session.receipts
        if receipts is None:
            return
        if self.report.has_output and not receipts.hist:
            receipts.sampling = sampling_bytes(session.open.sampling, session.book.prompt_len or 0)
        session.to_asker.send_nowait(receipts_message(session.book.id, session.book.epoch,
                                                      receipts.sign_wire(pos, n, h_in, h_out)))

    async def _seal(self, session: Session, msg: Seal) -> None:
        """The answer is in: this stage's last span, up to where the asker says the rows end."""
        book = session.book
        if (msg.session, msg.epoch) != (book.id, book.epoch):
            raise ProtocolError(ErrorCode.EPOCH_STALE, "a seal of another session or epoch")
        if session.receipts is None or not session.open.fast:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "only a fast session with receipts is sealed")
        await session.fast_opened.wait()
        # the worker tells the last spans as events, after the ones it told before (``on_engine_event``)
        await self._engine_call({"op": "fast_seal", "seq": book.slot, "tag": session.fast_tag, "until": msg.until})

    async def _fast_inputs(self, session: Session, msg: InputsRequest) -> None:
        """A fast session's kept inputs, span by span, from its engine worker (``_send_inputs``)."""
        book = session.book
        reply, body = await self._engine_call({"op": "fast_inputs", "seq": book.slot, "tag": session.fast_tag,
                                               "until": msg.until})
        offset = 0
        for pos, n, size, ids in reply["spans"]:
            rows = np.frombuffer(body, dtype=np.float32, count=size // 4, offset=offset).reshape(n, -1)
            offset += size
            entry = tensor_fields(HIDDEN, rows, "f32", "raw")
            session.kept.append(StepInput.unvalidated({
                "pos": pos, "n_tokens": n, "tensor": TensorEntry.unvalidated(entry),
                "tokens": np.frombuffer(ids, dtype=np.int32).tolist() if ids else None}))
        self._send_inputs(session, msg)

    async def _end_fast(self) -> None:
        async for session in self._fast_end_recv:
            if self.books.holds(session.book):
                try:
                    await self._engine_call({"op": "fast_end", "seq": session.book.slot, "tag": session.fast_tag})
                except ProtocolError:
                    pass

    def _activation_nowait(self, session: Session, wanted: bool, sender: str, msg: Message) -> bool:
        """An activation checked, decoded and queued as it arrives (``Stream.set_message_hook``), if
        that needs no wait; False leaves the message to the hop stream's task."""
        book = session.book
        if not isinstance(msg, Activation) or not self.books.holds(book) or book.phase not in LIVE:
            return False
        if not self.report.has_input:
            # what ``_accept_activation`` would await: a thread to decode in, the prompt's ids
            entry = msg.tensors[0] if len(msg.tensors) == 1 else None
            if entry is None or not self._inline(entry, msg.n_tokens) or \
                    self.report.has_output and msg.pos < (book.prompt_len or 0):
                return False
        checked = self._checked_activation(session, msg, chain_of(msg, wanted, sender))
        if checked is not None:
            entry, h_in, chain = checked
            self._enqueue(session, msg.pos, msg.n_tokens, Rows(session, None, _decoded(entry), msg.tokens, h_in,
                                                               chain), msg.drafts)
        return True

    async def _accept_activation(self, session: Session, msg: Activation,
                                 chain: tuple[str, bytes] | None = None) -> None:
        """Checks an activation against the session before decoding a byte of it, then queues it."""
        checked = self._checked_activation(session, msg, chain)
        if checked is None:
            return
        entry, h_in, rows_chain = checked
        book = session.book
        if self._inline(entry, msg.n_tokens):
            hidden = _decoded(entry)
        else:
            hidden = await trio.to_thread.run_sync(_decoded, entry, limiter=self._decoder)
        history = await self._history(session, msg.pos, msg.n_tokens) if self.report.has_output else None
        if self.books.holds(book) and book.phase in LIVE:
            self._enqueue(session, msg.pos, msg.n_tokens, Rows(session, None, hidden, msg.tokens, h_in, rows_chain,
                                                               history), msg.drafts)

    def _inline(self, entry: TensorEntry, n_tokens: int) -> bool:
        """Whether these hidden states are decoded on the event loop (INLINE_DECODE_BYTES), not a thread."""
        return entry.codec == "raw" and 4 * n_tokens * self.report.stage_width <= INLINE_DECODE_BYTES

    def _checked_activation(self, session: Session, msg: Activation, chain: tuple[str, bytes] | None,
                            ) -> tuple[TensorEntry, bytes, PackedChain | None] | None:
        """Every check of an activation against the session, before a byte of it is decoded: the
        head's token ids are queued here (None); hidden states come back with their hash and chain."""
        book = session.book
        if msg.session != book.id:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "activation for another session")
        if msg.epoch != book.epoch:
            raise ProtocolError(ErrorCode.EPOCH_STALE, f"activation of epoch {msg.epoch}, session is at {book.epoch}")
        if msg.tokens is not None and len(msg.tokens) != msg.n_tokens:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{len(msg.tokens)} token ids for {msg.n_tokens} rows")
        h_in, checked = self._checked_chain(session, msg, chain)
        self.books.check_rows(book, msg.pos, msg.n_tokens, msg.drafts)
        steps.check_kind(self.report.has_input, msg.tokens is not None, bool(msg.tensors), msg.n_tokens, msg.drafts,
                         session.gets_ids, ring=not session.open.check)
        if msg.tokens is not None:
            # carried ids reach the engine in the same call as everyone's rows
            steps.check_ids(msg.tokens, self.report.n_vocab)
        if self.report.has_input:
            assert msg.tokens is not None
            tokens = np.asarray(msg.tokens, dtype=np.int32)
            # a whole-model stage's sampler reads the prompt's ids as its penalty history: in a check
            # session they come as rows do, so they are these (as its own prompt's are, ``_prompt``)
            prompt_ids = max(0, (book.prompt_len or 0) - msg.pos) if self.report.has_output else 0
            history = list(msg.tokens[:prompt_ids]) if prompt_ids else None
            # the ids ride on downstream only to a stage with hash-routed layers (deepseek4), or before one
            self._enqueue(session, msg.pos, msg.n_tokens,
                          Rows(session, tokens, None, list(msg.tokens) if session.carry else None, h_in, checked,
                               history),
                          msg.drafts)
            return None
        entry = msg.tensor(HIDDEN)
        o = session.open
        if (entry.dtype, entry.codec) != (o.wire_dtype, o.wire_codec):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"hidden states as {entry.dtype}/{entry.codec}, this "
                                                       f"session travels as {o.wire_dtype}/{o.wire_codec}")
        want = (msg.n_tokens, self.report.stage_width)
        if tuple(entry.shape) != want:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"hidden states of shape {tuple(entry.shape)}, "
                                                       f"this stage needs {want}")
        return entry, h_in, checked

    def _checked_chain(self, session: Session, msg: Activation, chain: tuple[str, bytes] | None,
                       ) -> tuple[bytes, PackedChain | None]:
        """With receipts on: the hash of the rows as they came, and their chain, checked before the
        rows' position or a byte of them is looked at, so a sender that moved or changed them is
        the one blamed, not this stage's books."""
        if session.receipts is None:
            return b"", None
        if self.report.has_input:
            # the ring: the tail's receipt of the step before signs the token it sampled
            if msg.tokens is None:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "the head takes token ids, not hidden states")
            h = row_hash(np.asarray(msg.tokens, dtype=np.int32).tobytes())
            prompt_len = session.book.prompt_len or 0
            return h, None if chain is None else check_incoming(chain, msg, self.report.n_layer, h, True, prompt_len,
                                                              self.digest)
        entry = msg.tensor(HIDDEN)
        h = row_hash(entry.data)
        checked = None if chain is None else check_incoming(chain, msg, self.report.layer_begin, h, False,
                                                          session.book.prompt_len or 0, self.digest)
        if not session.open.check:
            session.kept.append(StepInput.unvalidated({"pos": msg.pos, "n_tokens": msg.n_tokens, "tensor": entry,
                                                       "tokens": msg.tokens}))
        return h, checked

    def _send_inputs(self, session: Session, msg: InputsRequest) -> None:
        """Hands the asker the kept inputs before ``msg.until``, in messages of bounded size, and forgets them."""
        book = session.book
        if (msg.session, msg.epoch) != (book.id, book.epoch):
            raise ProtocolError(ErrorCode.EPOCH_STALE, "inputs of another session or epoch")
        if session.receipts is None or self.report.has_input:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "this stage keeps no inputs for the session")
        taken = 0
        while taken < len(session.kept) and session.kept[taken].pos < msg.until:
            taken += 1
        steps, session.kept = session.kept[:taken], session.kept[taken:]
        batch: list[StepInput] = []
        size = 0
        for step in steps:
            step_size = len(step.tensor.data) if step.tensor is not None else 0
            if batch and size + step_size > MAX_INPUTS_BYTES:
                session.to_asker.send_nowait(Inputs(session=book.id, epoch=book.epoch, steps=batch, more=True))
                batch, size = [], 0
            batch.append(step)
            size += step_size
        session.to_asker.send_nowait(Inputs(session=book.id, epoch=book.epoch, steps=batch, more=False))

    def _enqueue(self, session: Session, pos: int, n: int, rows: Rows, drafts: int = 0) -> None:
        for other in self.books.enqueue(session.book, pos, n, rows, trio.current_time(), drafts):
            self._ended(other)
        self._wake.set()

    # ----- ends of sessions

    async def _expire(self) -> None:
        """Sleeps until the books' next timer, or until a session opens or goes idle."""
        while True:
            self._timer_wake = trio.Event()
            self._timer_at = self.books.next_timer()
            with trio.move_on_at(math.inf if self._timer_at is None else self._timer_at):
                await self._timer_wake.wait()
            for book in self.books.handle_timer(trio.current_time()):
                self._ended(book)

    def _changed(self) -> None:
        """A session opened or went idle. Its expiry (now + TTL) is never before one already set,
        so only a timer task that sleeps without a deadline needs waking."""
        if self._timer_at is None:
            self._timer_wake.set()

    def _fail(self, session: Session, error: ProtocolError) -> None:
        self.books.fail(session.book, error)
        session.scope.cancel()

    def _ended(self, book: SessionBook) -> None:
        """The books failed or released ``book``: its task ends, the scheduler clears its KV."""
        session = self._sessions.get(book)
        if session is not None:
            session.scope.cancel()
        self._wake.set()

    def _detach(self, session: Session) -> None:
        """Takes the session off the books now; the scheduler clears its KV before the next engine call."""
        self.books.release(session.book)
        if self._sessions.get(session.book) is session:
            del self._sessions[session.book]
        self._fast.pop(session.fast_tag, None)
        self._wake.set()
        if not self.books.sessions:
            self._idle.set()

    async def _clear_dirty(self) -> None:
        """Clears released slots and drops rejected drafts' KV; rows queued meanwhile wait for their trim."""
        while self.books.dirty or self.books.trims:
            try:
                for slot, generation, pos in self.books.take_trims():
                    if generation == self.engine.generation:
                        await self._engine_call({"op": "remove", "seq": slot, "p0": pos, "p1": -1})
                for slot, generation in self.books.take_dirty():
                    if generation != self.engine.generation:
                        continue
                    await self._engine_call({"op": "remove", "seq": slot})
                    if self.report.has_output:
                        await self._engine_call({"op": "sampler_free", "sid": slot})
            except ProtocolError:
                return

    async def _engine_call(self, header: dict[str, Any], payload: bytes | memoryview = b"",
                           fds: tuple[int, ...] = ()) -> tuple[dict[str, Any], bytearray]:
        try:
            return await self.engine.call(header, payload, fds=fds)
        except WorkerDown as exc:
            raise ProtocolError(ErrorCode.INTERNAL, f"engine worker unavailable: {exc}") from exc
        except WorkerRefused as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"the engine refused: {exc}") from exc

    # ----- continuous batching

    async def _schedule(self) -> None:
        while True:
            if not self.books.queued and not self.books.dirty:
                self._wake = trio.Event()
                await self._wake.wait()
            await self._clear_dirty()
            batch = self.books.next_batch()
            if not batch:
                continue
            await self._run_batch(batch)
            self._changed()

    async def _run_batch(self, batch: list[Work[Rows]]) -> None:
        """One engine call for ``batch``. The engine refuses bad input before it computes, so a
        refused call of several sessions is run again one session at a time: only the offender fails."""
        t0 = trio.current_time()
        try:
            reply, body = await self._forward(batch)
        except ProtocolError as exc:
            if exc.code is ErrorCode.BAD_REQUEST and len(batch) > 1:
                for work in batch:
                    if self.books.holds(work.session) and work.session.phase in LIVE:
                        await self._run_batch([work])
                    else:
                        self.books.ran(work, trio.current_time())
                return
            for work in batch:
                self.books.ran(work, trio.current_time())
                self._fail(work.payload.session, exc)
            return
        self.metrics.record_call(len(batch), sum(w.n for w in batch), trio.current_time() - t0,
                                 sum(w.n - self.books.history(w) for w in batch))
        self._dispatch(batch, reply, body)

    async def _forward(self, batch: list[Work[Rows]]) -> tuple[dict[str, Any], bytearray]:
        seq = _joined([np.full(w.n, w.session.slot, dtype=np.int32) for w in batch])
        pos = _joined([np.arange(w.pos, w.pos + w.n, dtype=np.int32) for w in batch])
        header: dict[str, Any] = {"op": "forward", "seq": seq.tobytes(), "pos": pos.tobytes()}
        payload: bytes | memoryview = b""
        if self.report.has_input:
            header["tokens"] = _joined([w.payload.tokens for w in batch if w.payload.tokens is not None]).tobytes()
        else:
            payload = _joined([w.payload.hidden for w in batch if w.payload.hidden is not None]).data.cast("B")
            if self.report.needs_tokens:
                header["tokens"] = _joined([np.asarray(w.payload.carry, dtype=np.int32) for w in batch
                                            if w.payload.carry is not None]).tobytes()
        if self.report.has_output:
            want = np.zeros(len(pos), dtype=np.int8)
            sample = []
            row, out_row = 0, 0
            for w in batch:
                row += w.n
                drafts = w.payload.session.drafts
                for i, r in enumerate(range(row - self.books.sampled_rows(w), row)):
                    want[r] = 1
                    # a drafted row names the draft after it: the sampler stops at the first it does not pick
                    sample.append([out_row, w.session.slot, drafts[i] if i < len(drafts) else -1]
                                  if i < w.drafts else [out_row, w.session.slot])
                    out_row += 1
            header["want"] = want.tobytes()
            header["sample"] = sample
            header["history"] = [[w.session.slot, w.payload.history[:self.books.history(w)]]
                                 for w in batch if w.payload.history and self.books.history(w)]
        return await self._engine_call(header, payload)

    def _dispatch(self, batch: list[Work[Rows]], reply: dict[str, Any], body: bytearray) -> None:
        now = trio.current_time()
        if not self.report.has_output:
            hidden = np.frombuffer(body, dtype=np.float32).reshape(-1, self.report.stage_width)
            row = 0
            for w in batch:
                self.books.ran(w, now)
                out = hidden[row:row + w.n]
                row += w.n
                s = w.payload.session
                if w.session.phase not in LIVE:
                    continue
                if s.open.check:
                    self._check_receipt(s, w, out)
                if s.downstream is None:
                    continue
                fields = tensor_fields(HIDDEN, out, s.open.wire_dtype, s.open.wire_codec)
                # a check session with a next stage is a link of a chain of replicas (meshd.client.chain_check):
                # the next range's replica replays from these rows, and each signs for the asker alone
                chain = None if s.receipts is None or s.open.check else self._signed_chain(
                    s, w, row_hash(fields["data"]))
                s.downstream.send_nowait(encode_activation(
                    session=w.session.id, epoch=w.session.epoch, step=s.steps, pos=w.pos, n_tokens=w.n,
                    tensors=[fields], tokens=w.payload.carry if s.carry else None, drafts=w.drafts,
                    receipts=chain))
                s.steps += 1
            return
        picks = iter(reply.get("picks", []))
        for w in batch:
            self.books.ran(w, now)
            s = w.payload.session
            if s.drafter is not None and w.payload.history:
                s.drafter.extend(list(w.payload.history[:self.books.history(w)]))
            rows = [next(picks) for _ in range(self.books.sampled_rows(w))]
            if s.receipts is not None and w.session.phase in LIVE:
                self._tail_receipts(s, w, rows)
            if rows:
                self._verified(s, w, rows, now)
            self._send_chain(s)

    # ----- receipts (the logic is in meshd.stage.receipts and meshd.stage.verify)

    def _signed_chain(self, s: Session, w: Work[Rows], h_out: bytes) -> bytes:
        """Signs this step: the chain so far (packed as it came) and this stage's receipt after it,
        which ride downstream inside the step's rows."""
        assert s.receipts is not None
        return s.receipts.extend(w.payload.chain, w.pos, w.n, w.payload.h_in, h_out)[1]

    def _check_receipt(self, s: Session, w: Work[Rows], out: np.ndarray) -> None:
        """A check session's step: only its receipt goes anywhere (to the asker that checks it)."""
        if s.receipts is None:
            return
        fields = tensor_fields(HIDDEN, out, s.open.wire_dtype, s.open.wire_codec)
        self._check_receipts(s, s.receipts.sign_wire(w.pos, w.n, w.payload.h_in, row_hash(fields["data"])))

    def _check_receipts(self, s: Session, mine: bytes) -> None:
        """A check session's receipts go to the asker in one message once the steps it fed together
        have run (a probe's one at a time): one message per check, not one per step it replays."""
        s.check_receipts.append(mine)
        if s.book.in_flight == 0 or len(s.check_receipts) == MAX_CHAIN:
            s.to_asker.send_nowait(receipts_message(s.book.id, s.book.epoch, b"".join(s.check_receipts)))
            s.check_receipts = []

    def _tail_receipts(self, s: Session, w: Work[Rows], picks: list[Any]) -> None:
        """The tail signs the tokens it sampled (none for a prompt chunk before the last); the whole
        route's chain goes to the asker inside the token (``_emit``), its own receipt around the ring."""
        assert s.receipts is not None
        if not s.receipts.hist:
            s.receipts.sampling = sampling_bytes(s.open.sampling, s.book.prompt_len or 0)
        # (a check session's every pick: the span it replays sampled from each row)
        taken = picks if s.open.check else picks[:w.drafts + 1]
        sampled = np.asarray([p[0] for p in taken if p is not None], dtype=np.int32)
        mine, chain = s.receipts.extend(w.payload.chain, w.pos, w.n, w.payload.h_in, row_hash(sampled.tobytes()))
        if s.open.check:
            # a replica's receipt goes to the asker that checks it, on its own: nothing reads its tokens
            self._check_receipts(s, mine)
            return
        s.asker_chain = chain
        if picks:
            # the head needs only the tail's receipt of its token: it covers the chain before it by hash
            s.ring_receipt = mine

    def _send_chain(self, s: Session) -> None:
        """A chain no token took along (a prompt chunk before the last, the end of generation) goes alone."""
        if s.asker_chain is not None:
            s.to_asker.send_nowait(receipts_message(s.book.id, s.book.epoch, s.asker_chain))
            s.asker_chain = None

    def _verified(self, s: Session, w: Work[Rows], picks: list[Any], now: float) -> None:
        """Emits the sampled tokens the drafts agree with, and the one after them (the rows past
        that one were not sampled)."""
        accepted = 0
        if w.drafts:
            drafts, s.drafts = s.drafts, []
            # the worker stops sampling at the first pick that is not the draft: no pick after it (None)
            accepted = steps.accepted([p[0] for p in picks if p is not None], drafts[:w.drafts])
            if s.draft_length is not None:
                s.draft_length.record(w.drafts, accepted)
        taken: list[tuple[int, bytes, Emitted, Any]] = []
        for token, eog, raw, *logprobs in picks[:accepted + 1]:
            piece = bytes(raw)
            emitted = self._take(s, token, eog, piece, now)
            if emitted is None:
                break
            # the worker's [logprob, [[token, logprob, piece], ...]] where the session asked for them
            taken.append((token, piece, emitted, logprobs[0] if logprobs else None))
            if not emitted.feed:
                break
        else:
            # The ring's token goes before the asker hears of any: the head's next step is the critical
            # path, and each message to the asker is sealed and written here, at once (Outlet). Side by
            # side (tools/bench_hop.py, default model, 2 x 3 rounds alternated) the daemons' path decoded
            # 42.8 and 43.3 tok/s with the asker told first, 44.3 and 44.2 so (the in-process split 51.4
            # and 51.1, then 52.3 and 52.2). The last token taken goes at the first position the drafts
            # did not get right.
            self._feed(s, token, w.pos + w.n - w.drafts + accepted)
        for token, piece, emitted, logprobs in taken:
            self._tell(s, token, piece, emitted, logprobs)

    def _emit(self, s: Session, token: int, eog: bool, piece: bytes, now: float) -> bool:
        """Books a sampled token and sends it to the asker; True if the session goes on after it."""
        emitted = self._take(s, token, eog, piece, now)
        if emitted is None:
            return False
        self._tell(s, token, piece, emitted)
        return emitted.feed

    def _take(self, s: Session, token: int, eog: bool, piece: bytes, now: float) -> Emitted | None:
        """A sampled token on the books (and the drafter's history); None: the session is not live."""
        emitted = self.books.emit(s.book, eog, piece, now)
        if emitted is not None and s.drafter is not None and not eog:
            s.drafter.extend([token])
        return emitted

    def _tell(self, s: Session, token: int, piece: bytes, emitted: Emitted, logprobs: Any = None) -> None:
        """What the asker hears of a booked token: the token, and the end of the answer if it is one."""
        book = s.book
        if emitted.index is not None:
            # built unvalidated from our own values (the asker validates): this is per token
            chain, s.asker_chain = s.asker_chain, None
            lp, top = (None, None) if logprobs is None else (float(logprobs[0]), [TopLogprob.unvalidated(
                {"token": int(t), "logprob": float(v), "piece": bytes(p)}) for t, v, p in logprobs[1]])
            s.to_asker.send_nowait(Token.unvalidated({"type": "token", "v": 1, "session": book.id,
                                                   "epoch": book.epoch, "index": emitted.index, "token": token,
                                                   "piece": piece, "receipts": chain, "logprob": lp,
                                                   "top_logprobs": top}))
        if emitted.done is not None:
            self._send_chain(s)
            length = s.draft_length
            s.to_asker.send_nowait(Done(session=book.id, epoch=book.epoch, reason=emitted.done,
                                        generated=book.generated, drafted=length.drafted if length else 0,
                                        accepted=length.accepted if length else 0))

    def _feed(self, s: Session, token: int, pos: int) -> None:
        """Sends the token (at ``pos``) around the ring, with drafts after it."""
        book = s.book
        k = 0
        if s.drafter is not None and s.draft_length is not None:
            # drafts never run past the session's budget or its last token
            room = min(self.limits.max_session_tokens - pos, book.max_tokens - book.generated) - 1
            k = max(0, min(s.draft_length.next_k(), room))
        if s.to_draft is not None:
            # the draft model's calls are awaited in the session's own task, off the scheduler
            s.to_draft.send_nowait((token, pos, k))
            return
        self._send_step(s, token, pos, s.drafter.draft(k) if s.drafter is not None else [])

    async def _model_drafts(self, s: Session, steps: trio.MemoryReceiveChannel[tuple[int, int, int]]) -> None:
        async for token, pos, k in steps:
            drafts = await self._draft_with_model(s, k) if k else []
            if self.books.holds(s.book) and s.book.phase in LIVE:
                self._send_step(s, token, pos, drafts)

    async def _draft_with_model(self, s: Session, k: int) -> list[int]:
        """Up to ``k`` greedy tokens of the draft model after the session's tokens; none if its worker
        fails (the step then goes on without drafts: a draft is only ever a guess)."""
        engine, kv, slot = self.draft_engine, s.draft_kv, s.book.slot
        assert engine is not None and kv is not None and s.drafter is not None
        tokens = list(s.drafter.tokens)
        try:
            if s.draft_generation != engine.generation:
                # a new draft worker (or a slot another session used before): nothing of ours in its KV
                s.draft_generation = engine.generation
                kv.held = []
                await self._draft_call(engine, {"op": "sampler_new", "sid": slot, "params": GREEDY})
            keep, feed = kv.plan(tokens)
            await self._draft_call(engine, {"op": "remove", "seq": slot, "p0": keep, "p1": -1})
            drafts: list[int] = []
            pos = keep
            while len(drafts) < k:
                chunk = feed[:self.limits.n_batch] if feed else drafts[-1:]
                feed = feed[len(chunk):]
                reply = await self._draft_call(engine, {
                    "op": "forward", "seq": np.full(len(chunk), slot, dtype=np.int32).tobytes(),
                    "pos": np.arange(pos, pos + len(chunk), dtype=np.int32).tobytes(),
                    "tokens": np.asarray(chunk, dtype=np.int32).tobytes(),
                    "want": np.eye(1, len(chunk), len(chunk) - 1, dtype=np.int8).tobytes(),
                    "sample": [[0, slot]] if not feed else []})
                pos += len(chunk)
                if not feed:
                    drafts.append(int(reply["picks"][0][0]))
        except (ProtocolError, KeyError, IndexError, TypeError, ValueError):
            s.draft_generation = -1
            return []
        kv.ran(tokens, drafts)
        return drafts

    async def _draft_call(self, engine: EngineSupervisor, header: dict[str, Any]) -> dict[str, Any]:
        try:
            reply, _ = await engine.call(header)
        except (WorkerDown, WorkerRefused) as exc:
            raise ProtocolError(ErrorCode.INTERNAL, f"draft model: {exc}") from exc
        return reply

    def _send_step(self, s: Session, token: int, pos: int, drafts: list[int]) -> None:
        book = s.book
        s.drafts = drafts
        tokens = [token, *drafts]
        if self.report.has_input and not s.open.check:
            # a whole-model stage is its own ring (in a check session every step comes from the asker):
            # its receipt of the token starts the next step's chain, as the tail's does on a longer
            # route, so the asker checks one kind of chain
            ids = np.asarray(tokens, dtype=np.int32)
            h_in = row_hash(ids.tobytes()) if s.receipts is not None else b""
            ring, s.ring_receipt = s.ring_receipt, None
            chain = None if ring is None else read_chain(ring, book.id, book.epoch, self.digest)
            try:
                self._enqueue(s, pos, len(tokens), Rows(s, ids, None, None, h_in, chain), len(tokens) - 1)
            except ProtocolError as exc:
                self._fail(s, exc)
        elif s.downstream is not None:
            ring, s.ring_receipt = s.ring_receipt, None
            s.downstream.send_nowait(encode_activation(session=book.id, epoch=book.epoch, step=book.generated,
                                                       pos=pos, n_tokens=len(tokens), tensors=[], tokens=tokens,
                                                       drafts=len(tokens) - 1, receipts=ring))


def _decoded(entry: TensorEntry) -> np.ndarray:
    """An activation's hidden states as float32 rows; its shape, dtype and codec were checked."""
    hidden = np.ascontiguousarray(entry.to_array(), dtype=np.float32)
    steps.check_finite(hidden)
    return hidden


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    # one session's rows (every step of a lone session) need no copy
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


async def answer_typed(stream: Stream, serve: Callable[[Stream, Message], Awaitable[None]]) -> None:
    """Reads a stream's first message and serves it; a refusal is a typed error message, then the end."""
    try:
        await serve(stream, await stream.receive_message())
    except ProtocolError as exc:
        try:
            await stream.send_message(error_message(exc))
        except ProtocolError:
            pass


@dataclass
class StageNode:
    address: str
    service: StageService
    engine: EngineSupervisor
    peers: Peers


def model_manifest(path: Path, state_dir: Path | None) -> Manifest:
    """The manifest of a model file, whose hash is the model id the mesh knows it by (computed once,
    with a progress bar on a TTY, then cached); ModelNotFound, naming the file, if it is no usable GGUF."""
    try:
        return manifest_for(path, state_dir)
    except (ValueError, OSError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ModelNotFound(f"{path.name} is not a usable GGUF model ({reason})") from None


class DraftModelMismatch(ModelNotFound):
    """The draft model cannot draft for this stage's model."""


async def vocab_digest(engine: EngineSupervisor) -> str:
    reply, _ = await engine.call({"op": "vocab_digest"})
    return str(reply["digest"])


@asynccontextmanager
async def stage_node(model: Path, layers: tuple[int, int] | None, limits: StageLimits, identity: NodeIdentity,
                     config: PeersConfig | None = None, listen: tuple[str, int] = ("127.0.0.1", 0),
                     threads: int = 0, poll: int = 0, gpu_layers: int = 0,
                     draft_model: Path | None = None) -> AsyncIterator[StageNode]:
    """A stage serving ``layers`` of ``model`` on ``listen``, with its supervised engine worker.

    ``gpu_layers`` of the range (counted from its end) go to a GPU; -1: all of them. A tail may
    run ``draft_model`` (the whole of a small GGUF of the same vocabulary) in a worker of its own,
    to draft for the sessions that speculate with "model"."""
    digest = (await trio.to_thread.run_sync(model_manifest, model, None)).model_id
    spec = WorkerSpec(model, layers, n_ctx=limits.max_sessions * limits.max_session_tokens,
                      n_seq_max=limits.max_sessions, n_batch=limits.n_batch, threads=threads, poll=poll,
                      gpu_layers=gpu_layers)
    engine = EngineSupervisor(spec)
    async with trio.open_nursery() as nursery:
        report = await nursery.start(engine.run)
        drafter: EngineSupervisor | None = None
        if draft_model is not None:
            if not report.has_output:
                raise DraftModelMismatch(f"a draft model drafts at the tail: layers [{report.layer_begin}, "
                                         f"{report.layer_end}) of {model.name} end before its last layer")
            drafter = EngineSupervisor(WorkerSpec(draft_model, None, n_ctx=spec.n_ctx, n_seq_max=spec.n_seq_max,
                                                  n_batch=spec.n_batch, threads=threads, poll=poll))
            draft_report = await nursery.start(drafter.run)
            same_count = draft_report.n_vocab == report.n_vocab
            if not same_count or await vocab_digest(drafter) != await vocab_digest(engine):
                detail = "the same number of tokens, but other ones" if same_count else \
                    f"{draft_report.n_vocab} tokens, not {report.n_vocab}"
                raise DraftModelMismatch(f"draft model {draft_model.name} has another vocabulary than "
                                         f"{model.name} ({detail})")
        async with open_peers(identity, config) as peers:
            service = StageService(peers, engine, report, digest, model.name, limits, draft_engine=drafter)
            engine.on_down, engine.on_event = service.on_worker_down, service.on_engine_event
            engine.on_gone = functools.partial(log.error, "layers [%d, %d) of %s no longer served: %s",
                                               report.layer_begin, report.layer_end, model.name)
            peers.handle_fast(service.door.accept)
            await nursery.start(service.run)
            peers.handle(STAGE_PROTOCOL, service.handle_stream)
            port = await peers.listen(*listen)
            yield StageNode(f"{listen[0]}:{port}", service, engine, peers)
            nursery.cancel_scope.cancel()

