"""The engine worker: a child process that owns one model range and its KV.

Native code runs here, not in the daemon, so an abort inside llama.cpp ends
only this process; the daemon notices and restarts it. The loop is plain
blocking IO on one socket: the daemon sends one request at a time.

Run as: python -m meshd.engine.worker --fd N --model PATH --layers A:B --gpu-layers N ...
"""

from __future__ import annotations

import argparse
import array
import contextlib
import ctypes
import hashlib
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from meshd.engine import ops
from meshd.engine.engine import Context, EngineError, InvalidInput, Model, Sampler, SamplingParams
from meshd.engine.fastpath import FastPlane
from meshd.engine.native import EngineUnavailable
from meshd.engine.workerproto import (
    MAX_HEADER,
    MAX_PAYLOAD,
    PREFIX,
    FrameError,
    FrameTooLarge,
    decode_header,
    drop_sent,
    encode_prefix,
    frame_parts,
    parse_prefix,
)

Reply = tuple[dict[str, Any], bytes | memoryview]
Handler = Callable[[Any, memoryview], Reply]


# The most descriptors one request brings (a fast-path connection: one)
_MAX_FDS = 4


class Worker:
    def __init__(self, model: Model, ctx: Context, events: socket.socket | None = None) -> None:
        self.model = model
        self.ctx = ctx
        self.samplers: dict[int, Sampler] = {}
        # per sampler: how many of the likeliest tokens' log-probabilities its picks carry (None: no logprobs)
        self.logprobs: dict[int, int | None] = {}
        self.events = events
        self.selector = selectors.DefaultSelector()
        self.plane = FastPlane(model, ctx, self.samplers, self.selector, self._emit)
        # descriptors that came with requests (SCM_RIGHTS), in order, for the ops that take them
        self.fds: list[int] = []

    def _emit(self, events: list[dict[str, Any]]) -> None:
        """Events for the daemon, unasked (a fast session's sampled tokens, its failure), in one write."""
        if self.events is not None:
            send_parts(self.events, [part for event in events for part in frame_parts(encode_prefix(event, 0), b"")])

    def handle(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], bytes | memoryview]:
        try:
            # every field checked against the op's schema before a handler reads it (meshd.engine.ops)
            op = ops.decode(h)
        except ops.BadOp as exc:
            return {"ok": False, "kind": "InvalidInput", "message": str(exc)}, b""
        handler: Handler = getattr(self, f"op_{op.op}")
        try:
            return handler(op, payload)
        except EngineError as exc:
            return {"ok": False, "kind": type(exc).__name__, "message": str(exc)}, b""
        except Exception as exc:
            # A request's fields are the daemon's, shaped by what peers sent: what its schema cannot
            # say (rows of another size than the positions, an id the model lacks: ValueError,
            # IndexError, OverflowError, ...) is that request's error, never the worker's end.
            return {"ok": False, "kind": "InvalidInput", "message": f"bad {op.op} request: {exc!r}"}, b""

    def op_ping(self, op: ops.Ping, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        return {"ok": True}, b""

    def op_forward(self, op: ops.Forward, payload: memoryview) -> tuple[dict[str, Any], bytes | memoryview]:
        """One batched engine call; at the tail, rows may be sampled right here.

        `sample` lists (output row, sampler id[, draft]): the tail samples those
        rows and returns token ids, so full logits never cross the process
        boundary unless `return_logits` asks for them. A row with a draft (the
        token drafted after it) is a speculative one: once a sampler picks
        something else, that sampler's later rows of this call stay unsampled
        (their pick is None), so it draws and records exactly what it would have
        without speculation: the same random draws, in the same order.
        """
        report = self.model.report
        for entry in op.history:
            sampler = self.samplers.get(entry.sid)
            if sampler is None:
                raise EngineError(f"no sampler {entry.sid}")
            for t in entry.tokens:
                sampler.accept(t)
        seq = np.frombuffer(op.seq, dtype=np.int32)
        pos = np.frombuffer(op.pos, dtype=np.int32)
        want = np.frombuffer(op.want, dtype=np.int8) if op.want is not None else None
        if report.has_input:
            if op.tokens is None:
                raise InvalidInput("the head's rows are token ids: the request has none")
            out = self.ctx.forward(seq, pos, tokens=np.frombuffer(op.tokens, dtype=np.int32), want_output=want)
        else:
            hidden = np.frombuffer(payload, dtype=np.float32).reshape(len(pos), report.stage_width)
            # a stage with hash-routed layers (deepseek4) takes the token ids with the residual
            if report.needs_tokens and op.tokens is None:
                raise InvalidInput("this stage routes experts by token id: the request has none")
            ids = np.frombuffer(op.tokens, dtype=np.int32) if report.needs_tokens and op.tokens is not None else None
            out = self.ctx.forward(seq, pos, tokens=ids, hidden=hidden, want_output=want)
        reply: dict[str, Any] = {"ok": True, "rows": int(out.shape[0])}
        if not report.has_output:
            return reply, out.data.cast("B")
        picks: list[list[Any] | None] = []
        rejected: set[int] = set()
        for row, sid, *draft in op.sample:
            sampler = self.samplers.get(sid)
            if sampler is None:
                raise EngineError(f"no sampler {sid}")
            if sid in rejected:
                picks.append(None)
                continue
            token = sampler.sample(out[row])
            pick = [token, self.model.is_eog(token), self.model.token_piece(token)]
            top = self.logprobs.get(sid)
            if top is not None:
                pick.append(self._logprobs(out[row], token, top))
            picks.append(pick)
            if draft and token != draft[0]:
                rejected.add(sid)
        reply["picks"] = picks
        if op.return_logits:
            return reply, out.data.cast("B")
        return reply, b""

    def op_remove(self, op: ops.Remove, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        seq, p0, p1 = op.seq, op.p0, op.p1
        if (p0, p1) == (0, -1):
            # the whole sequence is cleared: a fast session on it ends with its KV
            self.plane.drop(seq)
        self.ctx.remove(seq, p0, p1)
        return {"ok": True}, b""

    def op_prefix_keep(self, op: ops.PrefixKeep, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        """A finished session's sequence becomes a prefix cache entry: it runs nothing more (a fast
        session on it is dropped) and keeps the positions it holds up to ``upto``; the reply says how
        many it holds (positions are written in order, so every one below the last is there)."""
        seq = op.seq
        self.plane.drop(seq)
        held = min(self.ctx.pos_max(seq) + 1, op.upto)
        self.ctx.remove(seq, held, -1)
        return {"ok": True, "tokens": held}, b""

    def op_prefix_copy(self, op: ops.PrefixCopy, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        """A cache hit: the session's sequence ``dst`` takes positions [0, n) of entry ``src``."""
        self.ctx.copy_prefix(op.src, op.dst, op.n)
        return {"ok": True}, b""

    def op_fast_open(self, op: ops.FastOpen, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        """A session whose rows go worker to worker (meshd.engine.fastpath)."""
        self.plane.open(op)
        return {"ok": True}, b""

    def op_fast_link(self, op: ops.FastLink, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        """One of a fast session's connections, the descriptor sent with this request."""
        if not self.fds:
            raise EngineError("fast_link came without its connection")
        self.plane.link(op, socket.socket(fileno=self.fds.pop(0)))
        return {"ok": True}, b""

    def op_fast_state(self, op: ops.FastState, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        return {"ok": True, **self.plane.state(op.seq)}, b""

    def op_fast_stats(self, op: ops.FastStats, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        return {"ok": True, "stats": self.plane.stats}, b""

    def op_fast_seal(self, op: ops.FastSeal, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        """A fast session's last spans, closed where the asker says the session ends (told as events)."""
        self.plane.seal(op)
        return {"ok": True}, b""

    def op_fast_inputs(self, op: ops.FastInputs, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        """A fast session's kept inputs (a spot check's): each span's position, row count, bytes of rows
        and token ids in the header, the rows one after the other in the payload."""
        spans = self.plane.inputs(op)
        return ({"ok": True, "spans": [[sp.pos, sp.n, len(sp.rows_in), sp.ids] for sp in spans]},
                b"".join(sp.rows_in for sp in spans))

    def op_fast_end(self, op: ops.FastEnd, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        self.plane.end(op)
        return {"ok": True}, b""

    def op_seq_pos_max(self, op: ops.SeqPosMax, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        """The last position a sequence holds in llama.cpp's KV, -1 when it holds none."""
        return {"ok": True, "pos_max": self.ctx.pos_max(op.seq)}, b""

    def _logprobs(self, row: np.ndarray, token: int, top: int) -> list[Any]:
        """A pick's log-probability under the row's raw logits, the ``top`` likeliest tokens' (id,
        log-probability, piece), likeliest first, and the logits' standard deviation (the scale a check
        across numerics measures a pick's gap by, wire.sketch)."""
        logits = row.astype(np.float64)
        peak = logits.max()
        lse = peak + np.log(np.exp(logits - peak).sum())
        best: list[Any] = []
        if top:
            ids = np.argpartition(-logits, top - 1)[:top]
            ids = ids[np.argsort(-logits[ids], kind="stable")]
            best = [[int(t), min(0.0, float(logits[t] - lse)), self.model.token_piece(int(t))] for t in ids]
        return [min(0.0, float(logits[token] - lse)), best, float(logits.std())]

    def op_sampler_new(self, op: ops.SamplerNew, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        sid = op.sid
        old = self.samplers.pop(sid, None)
        if old:
            old.close()
        self.logprobs[sid] = None if op.logprobs is None else min(op.logprobs, 20)
        sampler = Sampler(self.model, SamplingParams(**op.params.model_dump()))
        for t in op.history:
            sampler.accept(t)
        self.samplers[sid] = sampler
        return {"ok": True}, b""

    def op_sampler_free(self, op: ops.SamplerFree, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        sampler = self.samplers.pop(op.sid, None)
        self.logprobs.pop(op.sid, None)
        if sampler:
            sampler.close()
        return {"ok": True}, b""

    def op_tokenize(self, op: ops.Tokenize, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        if op.messages is not None:
            text = self.model.apply_chat(op.messages, add_assistant=True)
            tokens = self.model.tokenize(text, add_special=False, parse_special=True)
        else:
            # a chat the asker rendered with the model's template (special) carries its special tokens as
            # text, as llama-server tokenizes its prompt; plain text's are the user's words, not markers
            if op.text is None:
                raise InvalidInput("a tokenize request has text or messages")
            tokens = self.model.tokenize(op.text, add_special=True, parse_special=op.special)
        return {"ok": True, "tokens": tokens}, b""

    def op_chat_info(self, op: ops.ChatInfo, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        return {"ok": True, "chat": self.model.chat_info()}, b""

    def op_sampler_grammar(self, op: ops.SamplerGrammar, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        """Constrains a session's sampler by a grammar; the tokens it generated before (a re-prefill's)
        are read by the grammar first."""
        sampler = self.samplers.get(op.sid)
        if sampler is None:
            raise EngineError(f"no sampler {op.sid}")
        sampler.set_grammar(op.spec)
        for t in op.generated:
            sampler.grammar_accept(t)
        return {"ok": True}, b""

    def op_detokenize(self, op: ops.Detokenize, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        return {"ok": True, "text": self.model.detokenize(op.tokens, remove_special=True)}, b""

    def op_vocab_digest(self, op: ops.VocabDigest, payload: memoryview) -> tuple[dict[str, Any], bytes]:
        """A hash of every token's bytes and end-of-generation flag, in id order: two models draft
        for each other only where it is the same."""
        digest = hashlib.sha256()
        for token in range(self.model.report.n_vocab):
            piece = self.model.token_piece(token, special=True)
            digest.update(len(piece).to_bytes(4, "little") + piece + bytes([self.model.is_eog(token)]))
        return {"ok": True, "digest": digest.hexdigest()}, b""


class FrameReader:
    """Request frames off the daemon's socket, each in one recv when it fits the buffer.

    A request's header and payload are views into the buffer, valid until the
    next frame is read: the loop handles each request before reading the next.
    Bytes that arrive beyond a frame are kept as the start of the next one.
    """

    def __init__(self, sock: socket.socket, size: int = 64 << 10, fds: list[int] | None = None) -> None:
        self.sock = sock
        self.buf = bytearray(size)
        self.start = 0  # where the unread bytes begin
        self.got = 0  # where they end
        # descriptors that came with the bytes read (SCM_RIGHTS), oldest first
        self.fds: list[int] = [] if fds is None else fds

    def _recv(self, view: memoryview) -> int:
        k, ancdata, _, _ = self.sock.recvmsg_into([view], socket.CMSG_SPACE(_MAX_FDS * 4))
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
                self.fds.extend(fds)
        return k

    def _fill(self, need: int) -> bool:
        """At least `need` unread bytes in the buffer; False once the daemon hangs up."""
        if self.start == self.got:
            # nothing unread (the usual case): the next frame lands at the front, in one recv
            self.start = self.got = 0
        if self.start + need > len(self.buf):
            # move the unread rest to the front, in a larger buffer if the frame needs one
            # (the old buffer may still be viewed by the previous request: never resized)
            grown = bytearray(max(need, len(self.buf)))
            grown[:self.got - self.start] = self.buf[self.start:self.got]
            self.buf, self.got, self.start = grown, self.got - self.start, 0
        view = memoryview(self.buf)
        while self.got - self.start < need:
            k = self._recv(view[self.got:])
            if k == 0:
                return False
            self.got += k
        return True

    def buffered(self) -> bool:
        """Whether bytes of a next frame are already read (the socket will not say so again)."""
        return self.got > self.start

    def _discard(self, n: int) -> bool:
        """Drops the next `n` bytes without keeping them; False once the daemon hangs up."""
        while n:
            if self.got == self.start:
                self.start = self.got = 0
                k = self._recv(memoryview(self.buf)[:min(n, len(self.buf))])
                if k == 0:
                    return False
                self.got = k
            take = min(n, self.got - self.start)
            self.start += take
            n -= take
        return True

    def read(self) -> tuple[memoryview, memoryview] | None:
        """The next frame's header and payload; None once the daemon hangs up.

        A frame over the limits is read to its end and dropped (so the next
        frame is found where it starts), then raised as FrameTooLarge.
        """
        if not self._fill(PREFIX.size):
            return None
        prefix = self.buf[self.start:self.start + PREFIX.size]
        self.start += PREFIX.size
        try:
            header_len, payload_len = parse_prefix(prefix)
        except FrameTooLarge as exc:
            if not self._discard(exc.header_len + exc.payload_len):
                return None
            raise
        if not self._fill(header_len + payload_len):
            return None
        view = memoryview(self.buf)
        head_end = self.start + header_len
        end = head_end + payload_len
        self.start = end
        return view[head_end - header_len:head_end], view[head_end:end]


def serve(sock: socket.socket, worker: Worker) -> None:
    """Answers requests until the daemon hangs up, and runs the fast sessions' steps between them;
    no request, however malformed, ends the loop."""
    reader = FrameReader(sock, fds=worker.fds)
    plane = worker.plane
    worker.selector.register(sock, selectors.EVENT_READ, None)
    while True:
        for key, mask in worker.selector.select(0.0 if plane.ready() else plane.timeout(time.monotonic())):
            if key.data is None:
                # the daemon waits for each reply, but a frame may have come with the one before it
                while True:
                    if not answer(sock, reader, worker):
                        return
                    if not reader.buffered():
                        break
            else:
                plane.on_ready(key.data, mask)
        plane.run()
        plane.on_timer(time.monotonic())


def answer(sock: socket.socket, reader: FrameReader, worker: Worker) -> bool:
    """Reads one request and answers it; False once the daemon hangs up."""
    try:
        frame = reader.read()
        if frame is None:
            return False
        header, payload = frame
        reply, out = worker.handle(decode_header(header), payload)
    except FrameError as exc:
        reply, out = {"ok": False, "kind": exc.kind, "message": str(exc)}, b""
    while worker.fds:
        # a descriptor no op of this request took (the request failed first) must not pair with the next
        os.close(worker.fds.pop())
    head = encode_prefix(reply, len(out))
    if len(head) - PREFIX.size > MAX_HEADER or len(out) > MAX_PAYLOAD:
        # what the input asked for does not fit one frame (detokenizing millions of tokens)
        reply, out = {"ok": False, "kind": "ReplyTooLarge", "message": (
            f"the reply to this request would be {len(head)} + {len(out)} bytes, over the frame limits "
            f"({MAX_HEADER} + {MAX_PAYLOAD})")}, b""
        head = encode_prefix(reply, 0)
    send_frame(sock, head, out)
    return True


def send_frame(sock: socket.socket, head: bytes, payload: bytes | memoryview) -> None:
    send_parts(sock, frame_parts(head, payload))


def send_parts(sock: socket.socket, parts: list[memoryview]) -> None:
    while parts:
        drop_sent(parts, sock.sendmsg(parts))


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the daemon that started it dies (Linux), however it dies.

    A daemon killed with SIGKILL runs no cleanup, and a worker busy in a long
    engine call would not see its socket close until the call ends.
    """
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        # the daemon died before the signal was armed: nobody would ever send it
        os._exit(1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--events-fd", type=int, default=-1, help="where events the daemon did not ask for go")
    ap.add_argument("--parent", type=int, default=0, help="the daemon's PID: this worker dies with it")
    ap.add_argument("--model", required=True)
    ap.add_argument("--layers", default="")
    ap.add_argument("--gpu-layers", type=int, default=0)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--n-seq-max", type=int, default=16)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--poll", type=int, default=0)
    args = ap.parse_args()
    # Ctrl-C at a terminal reaches the whole process group; the daemon decides when its worker ends
    # (it closes the socket, or the parent-death signal does), so the worker leaves no traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.parent:
        die_with_parent(args.parent)
    sock = socket.socket(fileno=args.fd)
    events = socket.socket(fileno=args.events_fd) if args.events_fd >= 0 else None
    try:
        layers = None
        if args.layers:
            a, b = args.layers.split(":")
            layers = (int(a), int(b))
        model = Model(args.model, layers, n_gpu_layers=args.gpu_layers)
        ctx = Context(model, n_ctx=args.n_ctx, n_seq_max=args.n_seq_max, n_batch=args.n_batch,
                      n_threads=args.threads or None, poll=args.poll)
    except (EngineError, EngineUnavailable) as exc:
        with contextlib.suppress(OSError):  # a daemon gone while we loaded hears nothing, and minds nothing
            sock.sendall(encode_prefix({"ok": False, "kind": type(exc).__name__, "message": str(exc)}, 0))
        return 1
    ready = {"ok": True, "pid": os.getpid(), "report": model.report.to_dict()}
    try:
        sock.sendall(encode_prefix(ready, 0))
        serve(sock, Worker(model, ctx, events))
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
