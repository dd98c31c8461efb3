"""The stage service: one layer range served to many sessions over the stage protocol.

Each session holds one llama.cpp sequence (its KV) in the engine worker. Work
arrives as prefill chunks and decode steps (tokens at the head, residual rows
elsewhere); one scheduler task puts the ready work of all sessions into one
engine call per step (continuous batching) and hands each session's rows on:
downstream as an activation, or at the tail as a sampled token that goes to
the asker and around the ring to the head.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import trio

from meshd.engine.engine import RangeReport
from meshd.engine.supervisor import EngineSupervisor, WorkerDown, WorkerRefused, WorkerSpec
from meshd.mesh.models import file_digest
from meshd.net.link import Stream
from meshd.net.peers import Peers, PeersConfig, open_peers
from wire.codec import Message, error_message
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.stage import (
    STAGE_PROTOCOL,
    Cancel,
    Describe,
    Done,
    Hop,
    Metrics,
    MetricsRequest,
    Open,
    Opened,
    Prompt,
    PromptTokens,
    Released,
    StageInfo,
    Token,
)
from wire.tensors import Activation, encode_activation, tensor_fields

log = logging.getLogger(__name__)

HIDDEN = "hidden_states"


@dataclass(frozen=True)
class StageLimits:
    """KV budgets: sessions (llama.cpp sequences), tokens per session and in all, idle time."""

    max_sessions: int = 16
    max_session_tokens: int = 2048
    max_total_tokens: int = 4096
    ttl: float = 300.0
    # an idle session this old may be evicted to make room for a new one
    evict_after: float = 2.0
    prefill_chunk: int = 128
    n_batch: int = 512
    retry_after_ms: int = 1000


@dataclass
class Work:
    session: Session
    pos: int
    n: int
    tokens: np.ndarray | None
    hidden: np.ndarray | None
    carry: list[int] | None


@dataclass(eq=False)
class Session:
    id: str
    epoch: int
    slot: int
    open: Open
    generation: int
    last_active: float
    next_pos: int = 0
    prompt_len: int | None = None
    generated: int = 0
    text: bytearray = field(default_factory=bytearray)
    in_flight: int = 0
    steps: int = 0
    failed: ProtocolError | None = None
    done: bool = False
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    to_asker: trio.MemorySendChannel[Message] | None = None
    # encoded activations for the next stage (or the ring to the head)
    downstream: trio.MemorySendChannel[bytes] | None = None
    hop_info: trio.Event = field(default_factory=trio.Event)


class StageMetrics:
    def __init__(self) -> None:
        self.engine_calls = 0
        self.rows = 0
        self.session_slots = 0
        self.multi_session_calls = 0
        self.max_sessions_per_call = 0
        self.evictions = 0
        self.expirations = 0
        self.overloaded = 0
        self.released = 0
        self.step_ms: collections.deque[float] = collections.deque(maxlen=512)

    def record_call(self, sessions: int, rows: int, seconds: float) -> None:
        self.engine_calls += 1
        self.rows += rows
        self.session_slots += sessions
        self.multi_session_calls += sessions > 1
        self.max_sessions_per_call = max(self.max_sessions_per_call, sessions)
        self.step_ms.append(seconds * 1000.0)


class StageService:
    def __init__(self, peers: Peers, engine: EngineSupervisor, report: RangeReport, model_digest: str,
                 model_name: str, limits: StageLimits = StageLimits()) -> None:
        self.peers = peers
        self.engine = engine
        self.report = report
        self.digest = model_digest
        self.model_name = model_name
        self.limits = limits
        self.sessions: dict[str, Session] = {}
        self.metrics = StageMetrics()
        self._free_slots = list(range(limits.max_sessions))
        self._dirty: list[tuple[int, int]] = []
        self._queue: collections.deque[Work] = collections.deque()
        self._wake = trio.Event()
        self._idle = trio.Event()
        self._nursery: trio.Nursery | None = None

    # ----- wiring

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._schedule)
            nursery.start_soon(self._sweep)
            task_status.started()

    def on_worker_down(self, generation: int, reason: str) -> None:
        """The worker's KV is gone: every session on it fails, typed and retryable."""
        error = ProtocolError(ErrorCode.INTERNAL, f"stage [{self.report.layer_begin}, {self.report.layer_end}) "
                                                   f"lost its engine worker ({reason})")
        for session in list(self.sessions.values()):
            self._fail(session, error)
        self._queue.clear()

    async def handle_stream(self, stream: Stream) -> None:
        await answer_typed(stream, self.handle_first)

    def holds(self, session: str) -> bool:
        return session in self.sessions

    async def wait_idle(self) -> None:
        """Returns once no session is held (a retiring range waits for its last one)."""
        while self.sessions:
            await self._idle.wait()
            self._idle = trio.Event()

    async def handle_first(self, stream: Stream, first: Message) -> None:
        """Serves a stage stream whose first message has been read."""
        if isinstance(first, Describe):
            await stream.send_message(self._info())
        elif isinstance(first, MetricsRequest):
            await stream.send_message(Metrics(values=self.metric_values()))
        elif isinstance(first, Open):
            await self._serve_session(stream, first)
        elif isinstance(first, Hop):
            await self._serve_hop(stream, first)
        else:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"a stage stream cannot start with {first.type!r}")

    def _info(self) -> StageInfo:
        r = self.report
        return StageInfo(node_id=self.peers.node_id, model_digest=self.digest, model_name=self.model_name,
                         layer_begin=r.layer_begin, layer_end=r.layer_end, n_layer=r.n_layer, n_embd=r.n_embd,
                         ready=self.engine.is_up)

    def metric_values(self) -> dict[str, float]:
        m = self.metrics
        steps = sorted(m.step_ms)
        return {
            "sessions": float(len(self.sessions)),
            "kv_tokens": float(sum(s.next_pos for s in self.sessions.values())),
            "engine_calls": float(m.engine_calls),
            "rows": float(m.rows),
            "sessions_per_call": m.session_slots / m.engine_calls if m.engine_calls else 0.0,
            "max_sessions_per_call": float(m.max_sessions_per_call),
            "multi_session_calls": float(m.multi_session_calls),
            "step_ms_p50": steps[len(steps) // 2] if steps else 0.0,
            "step_ms_p99": steps[min(len(steps) - 1, math.ceil(len(steps) * 0.99) - 1)] if steps else 0.0,
            "evictions": float(m.evictions),
            "expirations": float(m.expirations),
            "overloaded": float(m.overloaded),
            "released": float(m.released),
            "worker_restarts": float(self.engine.restarts),
            "worker_up": float(self.engine.is_up),
        }

    # ----- sessions (the asker's control stream owns the session's lifetime)

    def _check_open(self, msg: Open) -> None:
        r = self.report
        if msg.model_digest != self.digest:
            raise ProtocolError(ErrorCode.MODEL_MISMATCH, f"this stage serves model {self.digest[:16]}, "
                                                          f"not {msg.model_digest[:16]}")
        if (msg.layer_begin, msg.layer_end) != (r.layer_begin, r.layer_end):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"this stage serves layers [{r.layer_begin}, {r.layer_end}), "
                                                       f"not [{msg.layer_begin}, {msg.layer_end})")
        if not r.has_output and msg.next is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a stage before the tail needs the next stage's address")
        if r.has_output and not r.has_input and msg.head is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the tail needs the head's address for the token ring")
        if not self.engine.is_up:
            raise ProtocolError(ErrorCode.OVERLOADED, "the engine worker is restarting",
                                retry_after_ms=self.limits.retry_after_ms)
        old = self.sessions.get(msg.session)
        if old is not None and old.epoch >= msg.epoch:
            raise ProtocolError(ErrorCode.EPOCH_STALE, f"session {msg.session} is at epoch {old.epoch}")

    async def _serve_session(self, stream: Stream, msg: Open) -> None:
        self._check_open(msg)
        old = self.sessions.get(msg.session)
        if old is not None:
            self._fail(old, ProtocolError(ErrorCode.EPOCH_STALE, f"replaced by epoch {msg.epoch}"))
            self._detach(old)
        slot = self._take_slot()
        now = trio.current_time()
        session = Session(id=msg.session, epoch=msg.epoch, slot=slot, open=msg,
                          generation=self.engine.generation, last_active=now)
        to_asker_send, to_asker_recv = trio.open_memory_channel[Message](math.inf)
        session.to_asker = to_asker_send
        self.sessions[session.id] = session
        try:
            await self._engine_call({"op": "remove", "seq": slot})
            if self.report.has_output:
                s = msg.sampling
                await self._engine_call({"op": "sampler_new", "sid": slot, "params": {
                    "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                    "repeat_penalty": s.repeat_penalty, "repeat_last_n": s.repeat_last_n, "seed": s.seed}})
            await stream.send_message(Opened(session=session.id, epoch=session.epoch))
            with session.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, to_asker_recv, stream)
                    if not self.report.has_output:
                        nursery.start_soon(self._downstream, session, msg.next.address, msg.next.node_id, False)
                    elif not self.report.has_input:
                        nursery.start_soon(self._downstream, session, msg.head.address, msg.head.node_id, True)
                    await self._control_loop(stream, session)
                    nursery.cancel_scope.cancel()
            if session.failed is not None:
                await stream.send_message(error_message(session.failed))
        finally:
            self._detach(session)
        try:
            await stream.send_message(Released(session=session.id))
        except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError):
            pass

    async def _control_loop(self, stream: Stream, session: Session) -> None:
        try:
            await self._control_messages(stream, session)
        except ProtocolError as exc:
            self._fail(session, exc)

    async def _control_messages(self, stream: Stream, session: Session) -> None:
        while True:
            try:
                msg = await stream.receive_message()
            except trio.EndOfChannel:
                return
            session.last_active = trio.current_time()
            if isinstance(msg, Cancel):
                return
            if isinstance(msg, Prompt):
                if msg.session != session.id or msg.epoch != session.epoch:
                    raise ProtocolError(ErrorCode.EPOCH_STALE, "prompt for another session or epoch")
                await self._prompt(session, msg)
            else:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected {msg.type!r} on a session stream")

    async def _prompt(self, session: Session, msg: Prompt) -> None:
        if not self.report.has_input:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "only the head stage takes the prompt")
        if session.prompt_len is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the session already has its prompt")
        given = [msg.messages is not None, msg.text is not None, msg.tokens is not None]
        if sum(given) != 1:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a prompt has exactly one of messages, text or tokens")
        if msg.tokens is not None:
            tokens = list(msg.tokens)
            bad = [t for t in tokens if t >= self.report.n_vocab]
            if bad:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"token id {bad[0]} is outside the vocabulary")
        else:
            request: dict[str, Any] = {"op": "tokenize"}
            if msg.messages is not None:
                request["messages"] = [{"role": m.role, "content": m.content} for m in msg.messages]
            else:
                request["text"] = msg.text
            reply, _ = await self._engine_call(request)
            tokens = reply["tokens"]
        if not tokens:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the prompt is empty")
        session.prompt_len = len(tokens)
        session.hop_info.set()
        assert session.to_asker is not None
        session.to_asker.send_nowait(PromptTokens(session=session.id, epoch=session.epoch, tokens=tokens))
        arr = np.asarray(tokens, dtype=np.int32)
        chunk = self.limits.prefill_chunk
        for start in range(0, len(arr), chunk):
            part = arr[start:start + chunk]
            self._enqueue(session, Work(session, start, len(part), part, None, part.tolist()))

    async def _pump(self, channel: trio.MemoryReceiveChannel[Message], stream: Stream) -> None:
        async for message in channel:
            await stream.send_message(message)

    async def _downstream(self, session: Session, address: str, node_id: str | None, ring: bool) -> None:
        """Sends this session's output to the next stage (or, at the tail, the ring to the head)."""
        send, recv = trio.open_memory_channel[bytes](math.inf)
        session.downstream = send
        await session.hop_info.wait()
        try:
            hop_stream = await self.peers.open_stream(address, STAGE_PROTOCOL, node_id=node_id)
        except (ProtocolError, OSError, trio.BrokenResourceError) as exc:
            self._fail(session, ProtocolError(ErrorCode.UNREACHABLE, f"cannot reach the next stage {address}: {exc}"))
            return
        async with hop_stream:
            try:
                await hop_stream.send_message(Hop(session=session.id, epoch=session.epoch, ring=ring,
                                                  prompt_tokens=session.prompt_len or 0))
                async for encoded in recv:
                    await hop_stream.send_all(encoded)
            except (ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._fail(session, ProtocolError(ErrorCode.UNREACHABLE, f"lost the next stage {address}: {exc}"))

    async def _serve_hop(self, stream: Stream, hop: Hop) -> None:
        session = self.sessions.get(hop.session)
        if session is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no session {hop.session} on this stage")
        if hop.epoch != session.epoch:
            raise ProtocolError(ErrorCode.EPOCH_STALE, f"session {hop.session} is at epoch {session.epoch}")
        if hop.ring != self.report.has_input:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "ring streams go to the head, hop streams elsewhere")
        if not hop.ring:
            session.prompt_len = hop.prompt_tokens
            session.hop_info.set()
        while True:
            try:
                msg = await stream.receive_message()
            except trio.EndOfChannel:
                return
            if session.done or session.failed or self.sessions.get(session.id) is not session:
                return
            if not isinstance(msg, Activation):
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected {msg.type!r} on a hop stream")
            try:
                self._accept_activation(session, msg)
            except ProtocolError as exc:
                self._fail(session, exc)
                raise

    def _accept_activation(self, session: Session, msg: Activation) -> None:
        if msg.session != session.id:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "activation for another session")
        if msg.epoch != session.epoch:
            raise ProtocolError(ErrorCode.EPOCH_STALE, f"activation of epoch {msg.epoch}, session is at {session.epoch}")
        if msg.pos != session.next_pos:
            raise ProtocolError(ErrorCode.CACHE_MISS, f"activation at position {msg.pos}, this stage holds "
                                                      f"positions up to {session.next_pos}")
        if msg.n_tokens < 1:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "an activation carries at least one token")
        if msg.tokens is not None and len(msg.tokens) != msg.n_tokens:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{len(msg.tokens)} token ids for {msg.n_tokens} rows")
        if self.report.has_input:
            if msg.tokens is None or msg.tensors:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "the head takes token ids, not hidden states")
            bad = [t for t in msg.tokens if t >= self.report.n_vocab]
            if bad:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"token id {bad[0]} is outside the vocabulary")
            tokens = np.asarray(msg.tokens, dtype=np.int32)
            self._enqueue(session, Work(session, msg.pos, msg.n_tokens, tokens, None, None))
            return
        entry = msg.tensor(HIDDEN)
        want = (msg.n_tokens, self.report.n_embd)
        if tuple(entry.shape) != want:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"hidden states of shape {tuple(entry.shape)}, "
                                                       f"this stage needs {want}")
        hidden = np.ascontiguousarray(entry.to_array(), dtype=np.float32)
        if not np.isfinite(hidden).all():
            raise ProtocolError(ErrorCode.PAYLOAD_CORRUPT, "hidden states hold NaN or infinity")
        self._enqueue(session, Work(session, msg.pos, msg.n_tokens, None, hidden, msg.tokens))

    def _enqueue(self, session: Session, work: Work) -> None:
        self._reserve(session, work.n)
        session.next_pos = work.pos + work.n
        session.in_flight += 1
        session.last_active = trio.current_time()
        self._queue.append(work)
        self._wake.set()

    # ----- budgets

    def _take_slot(self) -> int:
        if not self._free_slots:
            self._evict_one(f"all {self.limits.max_sessions} session slots are busy")
        slot = self._free_slots.pop(0)
        # the new session clears the slot itself; a pending clear would wipe its KV later
        self._dirty = [(s, g) for s, g in self._dirty if s != slot]
        return slot

    def _reserve(self, session: Session, n: int) -> None:
        if session.next_pos + n > self.limits.max_session_tokens:
            self.metrics.overloaded += 1
            raise ProtocolError(ErrorCode.OVERLOADED, f"session needs {session.next_pos + n} tokens, "
                                                      f"the limit per session is {self.limits.max_session_tokens}",
                                retry_after_ms=self.limits.retry_after_ms)
        while sum(s.next_pos for s in self.sessions.values()) + n > self.limits.max_total_tokens:
            self._evict_one(f"the stage holds {self.limits.max_total_tokens} KV tokens in all", keep=session)

    def _evict_one(self, why: str, keep: Session | None = None) -> None:
        now = trio.current_time()
        idle = [s for s in self.sessions.values()
                if s is not keep and s.in_flight == 0 and now - s.last_active >= self.limits.evict_after]
        if not idle:
            self.metrics.overloaded += 1
            raise ProtocolError(ErrorCode.OVERLOADED, why, retry_after_ms=self.limits.retry_after_ms)
        victim = min(idle, key=lambda s: s.last_active)
        self.metrics.evictions += 1
        self._fail(victim, ProtocolError(ErrorCode.CACHE_MISS, f"evicted (least recently used) because {why}"))
        self._detach(victim)

    async def _sweep(self) -> None:
        while True:
            await trio.sleep(min(1.0, self.limits.ttl / 4))
            now = trio.current_time()
            for s in list(self.sessions.values()):
                if s.in_flight == 0 and now - s.last_active > self.limits.ttl:
                    self.metrics.expirations += 1
                    self._fail(s, ProtocolError(ErrorCode.CACHE_MISS, f"expired after {self.limits.ttl:.0f} s idle"))
                    self._detach(s)

    def _fail(self, session: Session, error: ProtocolError) -> None:
        if session.failed is None and not session.done:
            session.failed = error
        session.scope.cancel()

    def _detach(self, session: Session) -> None:
        """Takes the session off the books now; the scheduler clears its KV before the next engine call."""
        if self.sessions.get(session.id) is session:
            del self.sessions[session.id]
            self.metrics.released += 1
            self._dirty.append((session.slot, session.generation))
            self._free_slots.append(session.slot)
            self._wake.set()
            if not self.sessions:
                self._idle.set()

    async def _clear_dirty(self) -> None:
        while self._dirty:
            slot, generation = self._dirty.pop()
            if generation != self.engine.generation:
                continue
            try:
                await self._engine_call({"op": "remove", "seq": slot})
                if self.report.has_output:
                    await self._engine_call({"op": "sampler_free", "sid": slot})
            except ProtocolError:
                return

    async def _engine_call(self, header: dict[str, Any], payload: bytes | memoryview = b"") -> tuple[dict[str, Any], bytearray]:
        try:
            return await self.engine.call(header, payload)
        except WorkerDown as exc:
            raise ProtocolError(ErrorCode.INTERNAL, f"engine worker unavailable: {exc}") from exc
        except WorkerRefused as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"the engine refused: {exc}") from exc

    # ----- continuous batching

    def _next_batch(self) -> list[Work]:
        """Ready work of all sessions, one item per session so prefill chunks pipeline downstream."""
        batch: list[Work] = []
        taken: set[int] = set()
        rows = 0
        rest: collections.deque[Work] = collections.deque()
        while self._queue:
            work = self._queue.popleft()
            live = self.sessions.get(work.session.id) is work.session and not work.session.failed
            if not live:
                continue
            if id(work.session) in taken or rows + work.n > self.limits.n_batch:
                rest.append(work)
                continue
            batch.append(work)
            taken.add(id(work.session))
            rows += work.n
        self._queue = rest
        return batch

    async def _schedule(self) -> None:
        while True:
            if not self._queue and not self._dirty:
                self._wake = trio.Event()
                await self._wake.wait()
            await self._clear_dirty()
            batch = self._next_batch()
            if not batch:
                continue
            t0 = trio.current_time()
            try:
                reply, body = await self._forward(batch)
            except ProtocolError as exc:
                for work in batch:
                    self._fail(work.session, exc)
                continue
            self.metrics.record_call(len(batch), sum(w.n for w in batch), trio.current_time() - t0)
            self._dispatch(batch, reply, body)

    async def _forward(self, batch: list[Work]) -> tuple[dict[str, Any], bytearray]:
        seq = _joined([np.full(w.n, w.session.slot, dtype=np.int32) for w in batch])
        pos = _joined([np.arange(w.pos, w.pos + w.n, dtype=np.int32) for w in batch])
        header: dict[str, Any] = {"op": "forward", "seq": seq.tobytes(), "pos": pos.tobytes()}
        payload: bytes | memoryview = b""
        if self.report.has_input:
            header["tokens"] = _joined([w.tokens for w in batch]).tobytes()
        else:
            payload = memoryview(_joined([w.hidden for w in batch])).cast("B")
        if self.report.has_output:
            want = np.zeros(len(pos), dtype=np.int8)
            sample = []
            row, out_row = 0, 0
            for w in batch:
                row += w.n
                if self._samples(w):
                    want[row - 1] = 1
                    sample.append([out_row, w.session.slot])
                    out_row += 1
            header["want"] = want.tobytes()
            header["sample"] = sample
            header["history"] = [[w.session.slot, w.carry[:max(0, w.session.prompt_len - w.pos)]]
                                 for w in batch if w.carry and w.session.prompt_len is not None
                                 and w.pos < w.session.prompt_len]
        return await self._engine_call(header, payload)

    def _samples(self, work: Work) -> bool:
        prompt_len = work.session.prompt_len
        return prompt_len is not None and work.pos + work.n >= prompt_len

    def _dispatch(self, batch: list[Work], reply: dict[str, Any], body: bytearray) -> None:
        if not self.report.has_output:
            hidden = np.frombuffer(body, dtype=np.float32).reshape(-1, self.report.n_embd)
            row = 0
            for w in batch:
                w.session.in_flight -= 1
                out = hidden[row:row + w.n]
                row += w.n
                s = w.session
                if s.downstream is None or s.failed:
                    continue
                s.downstream.send_nowait(encode_activation(
                    session=s.id, epoch=s.epoch, step=s.steps, pos=w.pos, n_tokens=w.n,
                    tensors=[tensor_fields(HIDDEN, out, s.open.wire_dtype)], tokens=w.carry))
                s.steps += 1
            return
        picks = iter(reply.get("picks", []))
        for w in batch:
            w.session.in_flight -= 1
            if self._samples(w):
                token, eog, piece = next(picks)
                self._emit(w.session, token, eog, bytes(piece))

    def _emit(self, s: Session, token: int, eog: bool, piece: bytes) -> None:
        if s.failed or s.done or s.to_asker is None:
            return
        o = s.open
        if eog:
            return self._finish(s, "eog")
        # built unvalidated from our own values (the asker validates): this is per token
        s.to_asker.send_nowait(Token.unvalidated({"type": "token", "v": 1, "session": s.id, "epoch": s.epoch,
                                               "index": s.generated, "token": token, "piece": piece}))
        s.generated += 1
        s.text += piece
        if o.stop and any(stop.encode() in s.text for stop in o.stop):
            return self._finish(s, "stop")
        if s.generated >= o.max_tokens:
            return self._finish(s, "max_tokens")
        if self.report.has_input:
            # a whole-model stage is its own ring
            self._enqueue(s, Work(s, s.next_pos, 1, np.asarray([token], dtype=np.int32), None, None))
        elif s.downstream is not None:
            s.downstream.send_nowait(encode_activation(session=s.id, epoch=s.epoch, step=s.generated,
                                                       pos=s.next_pos, n_tokens=1, tensors=[], tokens=[token]))
        s.last_active = trio.current_time()

    def _finish(self, s: Session, reason: str) -> None:
        s.done = True
        assert s.to_asker is not None
        s.to_asker.send_nowait(Done(session=s.id, epoch=s.epoch, reason=reason, generated=s.generated))


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
        except (ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass


@dataclass
class StageNode:
    address: str
    service: StageService
    engine: EngineSupervisor
    peers: Peers


@asynccontextmanager
async def stage_node(model: Path, layers: tuple[int, int] | None, limits: StageLimits, identity: NodeIdentity,
                     config: PeersConfig | None = None, listen: tuple[str, int] = ("127.0.0.1", 0),
                     threads: int = 0, poll: int = 0) -> AsyncIterator[StageNode]:
    """A stage serving ``layers`` of ``model`` on ``listen``, with its supervised engine worker."""
    digest = await trio.to_thread.run_sync(file_digest, model)
    spec = WorkerSpec(model, layers, n_ctx=limits.max_sessions * limits.max_session_tokens,
                      n_seq_max=limits.max_sessions, n_batch=limits.n_batch, threads=threads, poll=poll)
    engine = EngineSupervisor(spec)
    async with trio.open_nursery() as nursery:
        report = await nursery.start(engine.run)
        async with open_peers(identity, config) as peers:
            service = StageService(peers, engine, report, digest, model.name, limits)
            engine.on_down = service.on_worker_down
            await nursery.start(service.run)
            peers.handle(STAGE_PROTOCOL, service.handle_stream)
            port = await peers.listen(*listen)
            yield StageNode(f"{listen[0]}:{port}", service, engine, peers)
            nursery.cancel_scope.cancel()

