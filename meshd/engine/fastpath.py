"""The engine worker's fast path: a session's rows go worker to worker, not through the daemons.

Measured on this machine kind (tools/bench_hop_floor.py, issue 16): a decode
row through daemon, link, daemon and worker IPC cost 2.4-5.2 ms per hop, a
sealed worker-to-worker hop 0.067 ms. So for a session that takes it, the
workers carry the data plane themselves (``wire.fastlink``): the head runs
the prompt and the ring's tokens, every stage runs what its upstream sends and
writes the result to its downstream, the tail samples and sends the token
around the ring to the head and, as an event, to its daemon (which streams it
to the asker). The daemons stay the control plane: they admit the session,
set its connections up, hand the sockets over (SCM_RIGHTS), end it and clear
its KV.

Everything a peer sends is checked here before the engine sees it, as the
daemon's stage service checks it on the slow path, with the same typed
errors: frame bounds and seal (wire.fastlink), the step's kind, position
(the KV's end), the session's reserved positions, the row count, token ids
in the vocabulary and finite rows. One session's bad input fails that session
alone (an error event to the daemon); a connection's reads are bounded to one
frame at a time and one held step per session, so a fast sender is held back
by TCP, not by memory here. Writes never block the worker: what the kernel
does not take waits, per connection, and that session runs no more steps
until it has gone, so a downstream that stops reading stalls only its
sessions.

Continuous batching stays: each pass takes one ready step of every session
that has one into one engine call (batch-invariant, so exact).

Speculation (prompt lookup) rides the same ring: the tail drafts after the
token it sends, the head runs token and drafts in one step, every stage passes
the count of drafted rows on, the tail samples the drafted rows in order and
stops at the first pick that is not the draft (so its sampler draws what it
would without drafts), and the next step starts where the drafts went wrong:
every stage drops the KV from there on first. Greedy and seeded answers are
the ones without speculation.
"""

from __future__ import annotations

import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshd import steps
from meshd.engine import ops
from meshd.engine.draft import DraftLength, NgramDrafter
from meshd.engine.engine import Context, EngineError, Model, Sampler
from meshd.engine.spans import Span, SpanBook, SpanError
from wire.errors import ErrorCode, ProtocolError
from wire.fastlink import ROWS, ROWS_IDS, TOKENS, Opener, Sealer, Step

# What a connection reads at once: a decode row in one recv.
_RECV_BYTES = 256 << 10
# How often, at most, the worker tells its daemon what its fast batches did (the console's live figures)
STATS_INTERVAL = 1.0
# How long, at most, a sampled token waits for the ones after it before the tail tells its daemon (a
# session's first and last go at once). Each telling wakes the daemon, which wakes the asker, on a core the
# ring's next stage may want: side by side on this 2-core box (tools/bench_hop.py, default model, 255
# tokens, 2 x 3 rounds alternated), telling every token cost the tail's daemon 283 and 246 µs of CPU per
# token and the asker 352 and 288; told every 50 ms (2-3 tokens), 163 and 153, and 183 and 178. (The
# ring's decode rate moved less than this box's noise.) A text stream in 50 ms pieces still reads as it comes.
STREAM_INTERVAL = 0.05

# The worker's word to its daemon: events (a session's tokens, its failure, the batches' figures), in order
Emit = Callable[[list[dict[str, Any]]], None]


class LinkIn:
    """The upstream's connection: one whole step at a time, held until the engine takes it."""

    def __init__(self, sock: socket.socket, opener: Opener) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.opener = opener
        self.step: Step | None = None
        # when the held step came whole (time.perf_counter)
        self.whole_at = 0.0
        self.closed = False
        # whether the selector watches it (it does but while a step waits that the engine did not take)
        self.watched = False

    def read(self) -> None:
        """Reads until a step is whole (then holds it), the socket has no more, or it closed."""
        while self.step is None and not self.closed:
            try:
                data = self.sock.recv(min(self.opener.wanted(), _RECV_BYTES))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.closed = True
                return
            if not data:
                self.closed = True
                return
            self.step = self.opener.feed(data)
            if self.step is not None:
                self.whole_at = time.perf_counter()


class LinkOut:
    """The downstream's connection: frames written as far as the kernel takes them, the rest kept."""

    def __init__(self, sock: socket.socket, sealer: Sealer) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.sealer = sealer
        self.pending = bytearray()
        self.closed = False
        # when the last frame was sealed, ready for the kernel (time.perf_counter): the send call itself wakes
        # the downstream, whose process may then take this one's core for a while, off the critical path
        self.sent_at = 0.0
        # whether the selector watches it for room (it does while frames wait)
        self.watched = False

    def send(self, kind: int, pos: int, n: int, payload: bytes | memoryview, drafts: int = 0) -> None:
        if self.closed:
            return
        self.pending += self.sealer.seal(kind, pos, n, payload, drafts)
        self.sent_at = time.perf_counter()
        self.flush()

    def flush(self) -> None:
        while self.pending and not self.closed:
            try:
                sent = self.sock.send(self.pending)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # the downstream went away: its stage (or the asker's failover) ends the session
                self.closed = True
                self.pending.clear()
                return
            del self.pending[:sent]


@dataclass
class HeldEvents:
    """A tail's token events for its daemon, held up to ``interval`` seconds so that one telling takes
    several (STREAM_INTERVAL). Fed the time, it says what is due now and when the next is (sans-IO)."""

    interval: float = STREAM_INTERVAL
    held: list[dict[str, Any]] = field(default_factory=list)
    # when the events held are due (the first of them was held then, plus the interval); None: none held
    due_at: float | None = None

    def hold(self, events: list[dict[str, Any]], now: float, at_once: bool = False) -> list[dict[str, Any]]:
        """Holds ``events`` after those held; returns what is due now: every event held if ``at_once``
        or once the first held has waited the interval, else none."""
        self.held += events
        if self.held and self.due_at is None:
            self.due_at = now + self.interval
        return self.take() if at_once else self.due(now)

    def due(self, now: float) -> list[dict[str, Any]]:
        return self.take() if self.due_at is not None and now >= self.due_at else []

    def take(self) -> list[dict[str, Any]]:
        """Every event held, in order; none are held after."""
        held, self.held, self.due_at = self.held, [], None
        return held

    def timeout(self, now: float) -> float | None:
        """Seconds until the events held are due (None: none are held)."""
        return None if self.due_at is None else max(0.0, self.due_at - now)


@dataclass(eq=False)
class FastSession:
    seq: int
    tag: int
    # positions [0, max_pos) are the session's on this stage (the daemon reserved them)
    max_pos: int
    prompt_len: int
    max_tokens: int
    # how many stages after this one get the token ids with the rows; whether this one's rows bring them
    carry: int = 0
    gets_ids: bool = False
    next_pos: int = 0
    generated: int = 0
    # the head: the prompt's ids still to run, in chunks
    prompt: np.ndarray | None = None
    chunk: int = 128
    link_in: LinkIn | None = None
    link_out: LinkOut | None = None
    # the tail has sampled its last token, or the session failed: it runs nothing more
    stopped: bool = False
    failed: bool = False
    # speculation: positions [draft_from, next_pos) hold drafted rows not yet verified (None: none do);
    # at the tail, the drafter, k and the drafts in flight
    draft_from: int | None = None
    drafter: NgramDrafter | None = None
    length: DraftLength | None = None
    drafts: list[int] = field(default_factory=list)
    # the tail: where the token it last sent around the ring sits (its step comes back from there)
    sent_pos: int | None = None
    # the tail: the daemon has been told of one of its tokens (the first is told at once)
    told: bool = False
    # with receipts on: the rows' hashes span by span, for the daemon to sign (meshd.engine.spans)
    spans: SpanBook | None = None


@dataclass
class Work:
    session: FastSession
    pos: int
    n: int
    tokens: np.ndarray | None
    hidden: np.ndarray | None
    drafts: int = 0
    # when its step came whole from upstream (0: the head's own prompt)
    arrived: float = 0.0


@dataclass
class FastPlane:
    model: Model
    ctx: Context
    samplers: dict[int, Sampler]
    selector: selectors.BaseSelector
    emit: Emit
    sessions: dict[int, FastSession] = field(default_factory=dict)
    # what the fast batches did, as the stage service counts its own engine calls (StageMetrics), and the
    # worker's own time on the decode hop: for each engine call of decode steps that all came from upstream,
    # µs from the first of them coming whole to the engine call (hop_in_us) and from the call's return to the
    # last frame's send call (hop_out_us), the software a hop costs inside this process (tools/bench_hop.py)
    stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("engine_calls", "rows", "decode_rows", "session_slots", "multi_session_calls", "max_sessions_per_call",
         "draft_rewinds", "decode_calls", "hop_in_us", "hop_out_us"), 0))
    _stats_at: float = 0.0
    # the tail: token events not yet told to the daemon
    held: HeldEvents = field(default_factory=HeldEvents)
    # the pass's engine call's start and return (time.perf_counter); None: it did not run as one call
    _called: tuple[float, float] | None = None

    # ----- the daemon's ops

    def open(self, op: ops.FastOpen) -> None:
        report = self.model.report
        if report.has_input and report.has_output:
            raise EngineError("the whole model is its own ring: no fast path")
        seq = op.seq
        if not 0 <= seq < self.ctx.n_seq_max:
            raise EngineError(f"sequence {seq} outside [0, {self.ctx.n_seq_max})")
        self.drop(seq)
        s = FastSession(seq=seq, tag=op.tag, max_pos=op.max_pos, prompt_len=op.prompt_len, max_tokens=op.max_tokens,
                        carry=op.carry, gets_ids=op.gets_ids, chunk=op.chunk)
        if not 0 < s.max_pos <= self.ctx.n_ctx_seq:
            raise EngineError(f"{s.max_pos} positions for a session, this context holds {self.ctx.n_ctx_seq}")
        # a prefix cache hit: the sequence holds the prompt's first ``start`` positions (the daemon copied
        # them), so its rows begin there; the prompt's last row always runs, where the tail samples
        s.next_pos = op.start
        if not 0 <= s.next_pos < max(1, s.prompt_len):
            raise EngineError(f"a session cannot start at {s.next_pos} (a prompt of {s.prompt_len})")
        if op.span:
            # past a cached prefix the spans begin where the rows do (the asker's chain of replicas computes
            # the prefix from its token ids: meshd.client.chain_check)
            s.spans = SpanBook(op.span, s.prompt_len, keep=not report.has_input, start=s.next_pos)
        if report.has_input:
            if op.prompt is None:
                raise EngineError("the head's fast session comes with its prompt")
            prompt = np.asarray(op.prompt, dtype=np.int32)
            if len(prompt) != s.prompt_len or len(prompt) > s.max_pos:
                raise EngineError(f"a prompt of {len(prompt)} ids for {s.prompt_len} ({s.max_pos} positions)")
            s.prompt = prompt
        if report.has_output:
            sampler = self.samplers.get(seq)
            if sampler is None:
                raise EngineError(f"no sampler {seq}")
            history = op.history or []
            for t in history:
                sampler.accept(t)
            if op.max_draft:
                s.drafter, s.length = NgramDrafter(), DraftLength(op.max_draft)
                s.drafter.extend(history)
        self.sessions[seq] = s

    def link(self, op: ops.FastLink, sock: socket.socket) -> None:
        """A connection of the session, handed over by the daemon: from upstream, or to downstream."""
        try:
            s = self._session(op.seq, op.tag)
        except EngineError:
            sock.close()
            raise
        key = op.key
        if op.out:
            if s.link_out is not None:
                sock.close()
                raise EngineError("the session has its downstream connection")
            s.link_out = LinkOut(sock, Sealer(key))
        else:
            if s.link_in is not None:
                sock.close()
                raise EngineError("the session has its upstream connection")
            report = self.model.report
            s.link_in = LinkIn(sock, Opener(key, report.stage_width, self.ctx.n_batch))
            self._watch_in(s.link_in, s)
            self._read(s)

    def state(self, seq: int) -> dict[str, Any]:
        """Where a fast session stands: the positions its KV holds, and where unverified drafts begin."""
        s = self.sessions.get(seq)
        if s is None:
            raise EngineError(f"no fast session {seq}")
        return {"next_pos": s.next_pos, "draft_from": s.draft_from, "stopped": s.stopped}

    def seal(self, op: ops.FastSeal) -> None:
        """The asker's word that the session ends at ``until``: the last spans' hashes up to there are
        told as events, after every one held (one channel, so the daemon signs them in order)."""
        s = self._session(op.seq, op.tag)
        try:
            closed = s.spans.seal(op.until) if s.spans is not None else []
        except SpanError as exc:
            raise EngineError(str(exc)) from None
        self._tell(self.held.take() + [span_event(s, c) for c in closed])

    def inputs(self, op: ops.FastInputs) -> list[Span]:
        """The kept inputs of the closed spans before ``until`` (a spot check's), forgotten once taken."""
        s = self._session(op.seq, op.tag)
        return [] if s.spans is None else s.spans.take(op.until)

    def _session(self, seq: int, tag: int) -> FastSession:
        """The fast session the daemon's op names (its slot and tag)."""
        s = self.sessions.get(seq)
        if s is None or s.tag != tag:
            raise EngineError(f"no fast session {seq} ({tag})")
        return s

    def end(self, op: ops.FastEnd) -> None:
        """The daemon's word that the session takes no more steps (a stop string ended it)."""
        s = self.sessions.get(op.seq)
        if s is not None and s.tag == op.tag:
            s.stopped = True

    def drop(self, seq: int) -> None:
        """Forgets the session and closes its connections (its KV is the daemon's to clear)."""
        s = self.sessions.pop(seq, None)
        if s is not None:
            self._tell(self.held.take())
            self._close(s)

    # ----- the connections

    def on_ready(self, s: FastSession, mask: int) -> None:
        if mask & selectors.EVENT_READ:
            self._read(s)
        if mask & selectors.EVENT_WRITE and s.link_out is not None:
            s.link_out.flush()
            self._watch_out(s)

    def _read(self, s: FastSession) -> None:
        link = s.link_in
        if link is None:
            return
        try:
            link.read()
        except Exception as exc:
            self._fail(s, getattr(exc, "code", ErrorCode.PAYLOAD_CORRUPT), getattr(exc, "message", str(exc)))
            return
        if link.closed and link.step is None:
            # the upstream ended (its stage finished or failed, and says so itself): quietly done here
            self._unwatch(link.sock)
            link.sock.close()
            s.link_in = None

    def _watch_in(self, link: LinkIn, s: FastSession) -> None:
        if not link.watched:
            self.selector.register(link.sock, selectors.EVENT_READ, s)
            link.watched = True

    def _watch_out(self, s: FastSession) -> None:
        out = s.link_out
        # (a flag, not the selector's map: a lookup of a socket it lacks formats the socket's repr, two
        # system calls, 15 µs of a decode step's 200 here)
        if out is None or out.watched == (want := bool(out.pending) and not out.closed):
            return
        if want:
            self.selector.register(out.sock, selectors.EVENT_WRITE, s)
        else:
            self.selector.unregister(out.sock)
        out.watched = want

    def _unwatch(self, sock: socket.socket) -> None:
        try:
            self.selector.unregister(sock)
        except (KeyError, ValueError):
            pass

    def _close(self, s: FastSession) -> None:
        for link in (s.link_in, s.link_out):
            if link is not None:
                self._unwatch(link.sock)
                link.sock.close()
        s.link_in = s.link_out = None

    def _fail(self, s: FastSession, code: ErrorCode, message: str) -> None:
        if not s.failed:
            s.failed = s.stopped = True
            self._tell(self.held.take())
            self.emit([{"ev": "error", "seq": s.seq, "tag": s.tag, "code": code.value, "message": message}])
        self._close(s)

    # ----- work

    def ready(self) -> bool:
        return any(self._ready_rows(s) is not None for s in self.sessions.values())

    def _ready_rows(self, s: FastSession) -> int | None:
        """The rows of the session's next step, if one is ready and its output has somewhere to go now."""
        # (the tail's output is the ring's token: its connection must be there before it samples one)
        if s.stopped or s.link_out is None or s.link_out.pending:
            return None
        if s.prompt is not None and self.model.report.has_input:
            return min(s.chunk, len(s.prompt) - s.next_pos)
        link = s.link_in
        return None if link is None or link.step is None else link.step.n

    def _next(self, s: FastSession, n: int) -> Work | None:
        """Takes the session's next step, of the ``n`` rows ``_ready_rows`` said it has, checked."""
        if s.prompt is not None and self.model.report.has_input:
            tokens = s.prompt[s.next_pos:s.next_pos + n]
            if s.next_pos + n >= len(s.prompt):
                s.prompt = None
            return Work(s, s.next_pos, n, tokens, None)
        link = s.link_in
        if link is None or link.step is None:
            return None
        step, link.step = link.step, None
        try:
            work = self._checked(s, step, link.whole_at)
        except ProtocolError as exc:
            self._fail(s, exc.code, exc.message)
            return None
        # room for the next step: the selector says when its bytes come (a read tried now, before the
        # upstream has computed it, would only fail)
        self._watch_in(link, s)
        return work

    def _checked(self, s: FastSession, step: Step, arrived: float) -> Work:
        """The step rules the stage service applies to an activation (meshd.steps), with its typed errors."""
        report = self.model.report
        rewind = steps.rewinds(step.pos, s.next_pos, s.draft_from)
        steps.check_rows(step.pos, step.n, step.drafts, s.next_pos, rewind, s.prompt_len, s.max_pos)
        if report.has_output and s.sent_pos is not None:
            steps.check_ring(step.pos, step.n, step.drafts, s.sent_pos, len(s.drafts))
        steps.check_kind(report.has_input, step.kind != ROWS, step.kind != TOKENS, step.n, step.drafts,
                         s.gets_ids)
        tokens = np.frombuffer(step.ids, dtype=np.int32) if step.ids else None
        if tokens is not None:
            steps.check_ids(tokens, report.n_vocab)
        hidden = None
        if step.kind != TOKENS:
            hidden = np.frombuffer(step.rows, dtype=np.float32).reshape(step.n, report.stage_width)
            steps.check_finite(hidden)
        if rewind:
            # the drafts from here on were rejected: their KV goes before these rows take its place
            self.ctx.remove(s.seq, step.pos, -1)
            self.stats["draft_rewinds"] += 1
        s.draft_from = step.pos + step.n - step.drafts if step.drafts else None
        return Work(s, step.pos, step.n, tokens, hidden, step.drafts, arrived)

    def run(self) -> None:
        """One engine call for one ready step of every session that has one (up to n_batch rows)."""
        batch: list[Work] = []
        rows = 0
        for s in list(self.sessions.values()):
            n = self._ready_rows(s)
            if n is None or rows + n > self.ctx.n_batch and batch:
                continue
            work = self._next(s, n)
            if work is not None:
                s.next_pos = work.pos + work.n
                batch.append(work)
                rows += work.n
        for s in self.sessions.values():
            link = s.link_in
            if link is not None and link.step is not None and link.watched:
                # a step the engine did not take: nothing more is read until it does (the selector, level-
                # triggered, would otherwise wake the loop for those bytes again and again). A step taken in
                # the pass that read it, as every decode step is, costs no change of watch: two epoll_ctl
                # calls and the selector's bookkeeping fewer per hop.
                self._unwatch(link.sock)
                link.watched = False
        if batch:
            self._called = None
            self._run(batch)
            self._count(batch)

    def _count(self, batch: list[Work]) -> None:
        st = self.stats
        st["engine_calls"] += 1
        st["rows"] += sum(w.n for w in batch)
        st["decode_rows"] += sum(w.n for w in batch if w.pos >= w.session.prompt_len)
        st["session_slots"] += len(batch)
        st["multi_session_calls"] += len(batch) > 1
        st["max_sessions_per_call"] = max(st["max_sessions_per_call"], len(batch))
        if self._called is not None and all(w.arrived and w.pos >= w.session.prompt_len for w in batch):
            called, returned = self._called
            sent = max((w.session.link_out.sent_at for w in batch if w.session.link_out is not None), default=0.0)
            if sent > returned:
                st["decode_calls"] += 1
                st["hop_in_us"] += int((called - min(w.arrived for w in batch)) * 1e6)
                st["hop_out_us"] += int((sent - returned) * 1e6)
        now = time.monotonic()
        if now - self._stats_at >= STATS_INTERVAL:
            self._stats_at = now
            self.emit([{"ev": "stats", "stats": st}])

    def _run(self, batch: list[Work]) -> None:
        report = self.model.report
        takes_ids = report.has_input or report.needs_tokens
        if len(batch) == 1:
            # a decode step alone, the common case: its arrays as they are (timestamps in the workers over
            # tools/bench_hop.py here: building the batch's arrays took 40 µs of the 110 from a step's arrival
            # to its engine call, in a worker woken with cold caches)
            w = batch[0]
            seq = np.full(w.n, w.session.seq, dtype=np.int32)
            pos = np.arange(w.pos, w.pos + w.n, dtype=np.int32)
            tokens = w.tokens if takes_ids else None
            hidden = w.hidden
        else:
            seq = np.concatenate([np.full(w.n, w.session.seq, dtype=np.int32) for w in batch])
            pos = np.concatenate([np.arange(w.pos, w.pos + w.n, dtype=np.int32) for w in batch])
            ids = [w.tokens for w in batch if w.tokens is not None]
            tokens = np.concatenate(ids) if ids and takes_ids else None
            hidden = None if report.has_input else np.concatenate([w.hidden for w in batch if w.hidden is not None])
        # (None: the last row alone, Context.forward's default and a decode step's one sampled row)
        want = None
        if report.has_output and not (len(pos) == 1 and self._sampled_rows(batch[0]) == 1):
            want = np.zeros(len(pos), dtype=bool)
            row = 0
            for w in batch:
                row += w.n
                # the last row, and one per draft before it; prompt chunks before the last leave only KV
                want[row - self._sampled_rows(w):row] = True
        try:
            called = time.perf_counter()
            out = self.ctx.forward(seq, pos, tokens=tokens, hidden=hidden, want_output=want)
            self._called = (called, time.perf_counter())
        except EngineError as exc:
            if len(batch) > 1:
                # one session's input the engine refused: run each alone, so only it fails
                for w in batch:
                    if not w.session.failed:
                        self._run([w])
                self._called = None
                return
            self._fail(batch[0].session, ErrorCode.BAD_REQUEST, f"the engine refused: {exc}")
            return
        if report.has_output:
            self._sample(batch, out)
        else:
            self._send_rows(batch, out)

    def _send_rows(self, batch: list[Work], out: np.ndarray) -> None:
        row = 0
        for w in batch:
            s = w.session
            rows = out[row:row + w.n]
            row += w.n
            if s.failed or s.link_out is None:
                continue
            if s.carry and w.tokens is not None:
                s.link_out.send(ROWS_IDS, w.pos, w.n, rows.tobytes() + np.asarray(w.tokens, np.int32).tobytes(),
                                w.drafts)
            else:
                s.link_out.send(ROWS, w.pos, w.n, rows.data.cast("B"), w.drafts)
            self._watch_out(s)
            if s.spans is not None:
                # after the send (which sealed a copy of the rows): the next stage's step is the critical path
                self._spanned_step(w, [r.tobytes() for r in rows])

    def _spanned_step(self, w: Work, outs: list[bytes]) -> None:
        """Books the step's rows in its session's spans; tells the daemon of the spans that closed."""
        s = w.session
        assert s.spans is not None
        if w.hidden is not None:
            ins = [r.tobytes() for r in w.hidden]
            ids = [] if w.tokens is None else [t.tobytes() for t in w.tokens]
        else:
            assert w.tokens is not None
            ins, ids = [t.tobytes() for t in w.tokens], []
        # the stage's own time on the step: from its rows coming whole to its output's send, just before
        # (none for the head's own prompt, which no upstream sent)
        held = time.perf_counter() - w.arrived if w.arrived else 0.0
        try:
            closed = s.spans.step(w.pos, ins, outs, ids, w.drafts, held)
        except SpanError as exc:
            self._fail(s, ErrorCode.BAD_REQUEST, str(exc))
            return
        if closed:
            # the prompt's last span signs the answer's first token, which the asker's client waits on
            first = closed[-1].pos + closed[-1].n >= s.prompt_len and closed[0].pos < s.prompt_len
            self._tell(self.held.hold([span_event(s, c) for c in closed], time.monotonic(), at_once=first))

    @staticmethod
    def _sampled_rows(w: Work) -> int:
        """How many of the step's last rows the tail samples (StageBooks.sampled_rows)."""
        return w.drafts + 1 if w.pos + w.n >= w.session.prompt_len else 0

    def _sample(self, batch: list[Work], logits: np.ndarray) -> None:
        k = 0
        for w in batch:
            rows = logits[k:k + self._sampled_rows(w)]
            k += len(rows)
            s = w.session
            if len(rows) and not s.failed:
                self._verify(s, w, rows)
            elif s.spans is not None and not s.failed:
                # a chunk of the prompt before its last samples nothing, and its rows are in its spans all
                # the same (without them the next chunk's step found no rows before it, and failed)
                self._spanned_step(w, [b""] * w.n)

    def _verify(self, s: FastSession, w: Work, rows: np.ndarray) -> None:
        """Samples the step's rows in order, stopping at the first pick that is not the draft after it
        (the sampler then drew exactly what it would have without drafts); emits the picks the drafts
        agree with and the one after them, then sends the last around the ring, with new drafts."""
        sampler = self.samplers.get(s.seq)
        if sampler is None:
            self._fail(s, ErrorCode.INTERNAL, "the session's sampler is gone")
            return
        drafts, s.drafts = s.drafts[:w.drafts], []
        picks: list[int] = []
        for i, row in enumerate(rows):
            picks.append(sampler.sample(row))
            if not steps.draft_holds(drafts, i, picks[-1]):
                break
        accepted = len(picks) - 1
        if w.drafts and s.length is not None:
            s.length.record(w.drafts, accepted)
        emitted: list[tuple[int, bool]] = []
        for token in picks:
            eog = self.model.is_eog(token)
            if not eog:
                s.generated += 1
                if s.drafter is not None:
                    s.drafter.extend([token])
            if steps.ends(eog, s.generated, s.max_tokens):
                s.stopped = True
            emitted.append((token, eog))
            if s.stopped:
                break
        if not s.stopped and s.link_out is not None:
            # The ring's token goes before the daemon hears of it: the head's next step is the critical path,
            # and the daemon's wake-up, on a busy box, took the tail's core for a while before it went
            # (timestamps in the workers over tools/bench_hop.py here: 0.37 ms from the tail's logits to the
            # ring's send, 0.27 ms in this order). The last pick goes at the first position the drafts did not
            # get right.
            pos = w.pos + w.n - w.drafts + accepted
            if s.drafter is not None and s.length is not None:
                # drafts never run past the session's positions or its last token
                room = min(s.max_pos - pos, s.max_tokens - s.generated) - 1
                s.drafts = s.drafter.draft(max(0, min(s.length.next_k(), room)))
            ids = np.asarray([picks[-1], *s.drafts], dtype=np.int32)
            s.sent_pos = pos
            s.link_out.send(TOKENS, pos, len(ids), ids.tobytes(), len(s.drafts))
            self._watch_out(s)
        events = []
        if s.spans is not None:
            # a row's output at the tail is the token sampled from it (none before the prompt's last row);
            # rows past the first pick that was not the draft were not sampled, and the next step drops them
            outs = [b""] * w.n
            first = w.n - len(rows)
            for i, token in enumerate(picks):
                outs[first + i] = np.int32(token).tobytes()
            self._spanned_step(w, outs)
        for token, eog in emitted:
            event: dict[str, Any] = {"ev": "token", "seq": s.seq, "tag": s.tag, "token": token, "eog": eog,
                                     "piece": self.model.token_piece(token)}
            if s.length is not None:
                event |= {"drafted": s.length.drafted, "accepted": s.length.accepted}
            events.append(event)
        # a session's first token and its last are told at once (time to first token, the answer's end)
        self._tell(self.held.hold(events, time.monotonic(), at_once=not s.told or s.stopped))
        s.told = True

    def _tell(self, events: list[dict[str, Any]]) -> None:
        if events:
            self.emit(events)

    def timeout(self, now: float) -> float | None:
        """Seconds until held tokens are due (None: none are held)."""
        return self.held.timeout(now)

    def on_timer(self, now: float) -> None:
        self._tell(self.held.due(now))


def span_event(s: FastSession, span: Span) -> dict[str, Any]:
    return {"ev": "span", "seq": s.seq, "tag": s.tag, "pos": span.pos, "n": span.n, "h_in": span.h_in,
            "h_out": span.h_out, "us": span.us}
