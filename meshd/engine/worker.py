"""The engine worker: a child process that owns one model range and its KV.

Native code runs here, not in the daemon, so an abort inside llama.cpp ends
only this process; the daemon notices and restarts it. The loop is plain
blocking IO on one socket: the daemon sends one request at a time.

Run as: python -m meshd.engine.worker --fd N --model PATH --layers A:B ...
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any

import numpy as np

from meshd.engine.engine import Context, EngineError, Model, Sampler, SamplingParams
from meshd.engine.workerproto import (
    PREFIX,
    FrameError,
    decode_header,
    drop_sent,
    encode_prefix,
    frame_parts,
    parse_prefix,
)


class Worker:
    def __init__(self, model: Model, ctx: Context) -> None:
        self.model = model
        self.ctx = ctx
        self.samplers: dict[int, Sampler] = {}

    def handle(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], bytes | memoryview]:
        op = h.get("op")
        handler = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
        if handler is None:
            return {"ok": False, "kind": "InvalidInput", "message": f"unknown worker op {op!r}"}, b""
        try:
            return handler(h, payload)
        except EngineError as exc:
            return {"ok": False, "kind": type(exc).__name__, "message": str(exc)}, b""
        except (KeyError, TypeError, ValueError) as exc:
            return {"ok": False, "kind": "InvalidInput", "message": f"bad {op} request: {exc!r}"}, b""

    def op_ping(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], bytes]:
        return {"ok": True}, b""

    def op_forward(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], bytes | memoryview]:
        """One batched engine call; at the tail, rows may be sampled right here.

        `sample` lists (output row, sampler id): the tail samples those rows and
        returns token ids, so full logits never cross the process boundary
        unless `return_logits` asks for them.
        """
        report = self.model.report
        for sid, tokens in h.get("history", []):
            sampler = self.samplers.get(sid)
            if sampler is None:
                raise EngineError(f"no sampler {sid}")
            for t in tokens:
                sampler.accept(int(t))
        seq = np.frombuffer(h["seq"], dtype=np.int32)
        pos = np.frombuffer(h["pos"], dtype=np.int32)
        want = np.frombuffer(h["want"], dtype=np.int8) if h.get("want") is not None else None
        if report.has_input:
            out = self.ctx.forward(seq, pos, tokens=np.frombuffer(h["tokens"], dtype=np.int32), want_output=want)
        else:
            hidden = np.frombuffer(payload, dtype=np.float32).reshape(len(pos), report.n_embd)
            out = self.ctx.forward(seq, pos, hidden=hidden, want_output=want)
        reply: dict[str, Any] = {"ok": True, "rows": int(out.shape[0])}
        if not report.has_output:
            return reply, memoryview(out).cast("B")
        picks = []
        for row, sid in h.get("sample", []):
            sampler = self.samplers.get(sid)
            if sampler is None:
                raise EngineError(f"no sampler {sid}")
            token = sampler.sample(out[row])
            picks.append([token, self.model.is_eog(token), self.model.token_piece(token)])
        reply["picks"] = picks
        if h.get("return_logits"):
            return reply, memoryview(out).cast("B")
        return reply, b""

    def op_remove(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], bytes]:
        self.ctx.remove(int(h["seq"]), int(h.get("p0", 0)), int(h.get("p1", -1)))
        return {"ok": True}, b""

    def op_seq_pos_max(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], bytes]:
        """The last position a sequence holds in llama.cpp's KV, -1 when it holds none."""
        return {"ok": True, "pos_max": self.ctx.pos_max(int(h["seq"]))}, b""

    def op_sampler_new(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], bytes]:
        sid = int(h["sid"])
        old = self.samplers.pop(sid, None)
        if old:
            old.close()
        sampler = Sampler(self.model, SamplingParams(**h["params"]))
        for t in h.get("history", []):
            sampler.accept(int(t))
        self.samplers[sid] = sampler
        return {"ok": True}, b""

    def op_sampler_free(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], bytes]:
        sampler = self.samplers.pop(int(h["sid"]), None)
        if sampler:
            sampler.close()
        return {"ok": True}, b""

    def op_tokenize(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], bytes]:
        if h.get("messages") is not None:
            text = self.model.apply_chat(h["messages"], add_assistant=True)
            tokens = self.model.tokenize(text, add_special=False, parse_special=True)
        else:
            tokens = self.model.tokenize(h["text"], add_special=True, parse_special=False)
        return {"ok": True, "tokens": tokens}, b""

    def op_detokenize(self, h: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], bytes]:
        return {"ok": True, "text": self.model.detokenize(h["tokens"], remove_special=True)}, b""


class FrameReader:
    """Request frames off the daemon's socket, each in one recv when it fits the buffer.

    A request's header and payload are views into the buffer, valid until the
    next frame is read: the loop handles each request before reading the next.
    """

    def __init__(self, sock: socket.socket, size: int = 64 << 10) -> None:
        self.sock = sock
        self.buf = bytearray(size)

    def read(self) -> tuple[memoryview, memoryview] | None:
        """The next frame's header and payload; None once the daemon hangs up."""
        view = memoryview(self.buf)
        got = 0
        while got < PREFIX.size:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                return None
            got += k
        header_len, payload_len = parse_prefix(view[:PREFIX.size])
        end = PREFIX.size + header_len + payload_len
        if got > end:
            raise FrameError("the daemon sent a second request before this one's reply")
        if end > len(self.buf):
            grown = bytearray(end)
            grown[:got] = view[:got]
            self.buf = grown
            view = memoryview(grown)
        while got < end:
            k = self.sock.recv_into(view[got:end])
            if k == 0:
                return None
            got += k
        return view[PREFIX.size:PREFIX.size + header_len], view[PREFIX.size + header_len:end]


def serve(sock: socket.socket, worker: Worker) -> None:
    reader = FrameReader(sock)
    while True:
        frame = reader.read()
        if frame is None:
            return
        header, payload = frame
        reply, out = worker.handle(decode_header(header), payload)
        send_frame(sock, encode_prefix(reply, len(out)), out)


def send_frame(sock: socket.socket, head: bytes, payload: bytes | memoryview) -> None:
    parts = frame_parts(head, payload)
    while parts:
        drop_sent(parts, sock.sendmsg(parts))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--layers", default="")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--n-seq-max", type=int, default=16)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--poll", type=int, default=0)
    args = ap.parse_args()
    sock = socket.socket(fileno=args.fd)
    try:
        layers = None
        if args.layers:
            a, b = args.layers.split(":")
            layers = (int(a), int(b))
        model = Model(args.model, layers)
        ctx = Context(model, n_ctx=args.n_ctx, n_seq_max=args.n_seq_max, n_batch=args.n_batch,
                      n_threads=args.threads or None, poll=args.poll)
    except EngineError as exc:
        sock.sendall(encode_prefix({"ok": False, "kind": type(exc).__name__, "message": str(exc)}, 0))
        return 1
    r = model.report
    ready = {"ok": True, "pid": os.getpid(), "report": {
        "layer_begin": r.layer_begin, "layer_end": r.layer_end, "n_layer": r.n_layer,
        "has_input": r.has_input, "has_output": r.has_output, "n_tensors": r.n_tensors,
        "n_bytes": r.n_bytes, "n_embd": r.n_embd, "n_vocab": r.n_vocab, "n_ctx_train": r.n_ctx_train,
        "arch": r.arch}}
    sock.sendall(encode_prefix(ready, 0))
    try:
        serve(sock, Worker(model, ctx))
    except (ConnectionError, OSError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
