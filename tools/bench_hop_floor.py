#!/usr/bin/env python3
"""What a worker-to-worker hop would cost: the floor of DESIGN's proposed stage fast path.

Three engine worker processes of the default model (even layer ranges, 1 thread
each) form the ring head -> middle -> tail -> head over loopback TCP, with no
daemon between them: each blocks on its upstream socket, opens the frame
(ChaCha20-Poly1305, a key per link), runs its range on the row, seals the
output and writes it to the next one. The tail takes the greedy token and sends
it to the head. This is the data path the proposal gives each decode token
(the daemons would only admit sessions and watch); what it does not have yet is
everything a daemon checks and books per step.

Figures, one run: decode tok/s of that ring against the same three ranges
called one after the other in one process (the split's compute), the per-hop
overhead ((wall per token - in-process compute per token) / 3 hops), each
process's CPU µs per token, and whether the ring's tokens are the in-process
ones (they must be: the rows travel as f32, sealed and opened).

With --no-engine the workers forward a decode row's bytes without computing:
the hop's software floor alone.

Usage: .venv/bin/python tools/bench_hop_floor.py [--tokens 128] [--no-engine]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct
import sys
import time
from typing import Any

import numpy as np
from benchlib.result import parser, publish
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from meshd.engine.engine import Context, Model
from meshd.mesh.models import default_model_path

RANGES = [(0, 10), (10, 20), (20, 30)]
WIDTH = 576  # the default model's residual width
HEADER = struct.Struct(">QI")  # nonce counter, sealed length


def recv_exact(sock: socket.socket, buf: memoryview, n: int) -> None:
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:n])
        if k == 0:
            raise ConnectionError("upstream closed")
        got += k


class Link:
    """One direction of one hop: frames sealed with the link's key, nonces counted."""

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self.sock, self.aead, self.sent, self.got = sock, ChaCha20Poly1305(key), 0, 0
        self.buf = memoryview(bytearray(1 << 20))

    def send(self, data: bytes) -> None:
        sealed = self.aead.encrypt(self.sent.to_bytes(12, "little"), data, None)
        self.sock.sendmsg([HEADER.pack(self.sent, len(sealed)), sealed])
        self.sent += 1

    def recv(self) -> bytes:
        recv_exact(self.sock, self.buf, HEADER.size)
        nonce, n = HEADER.unpack(self.buf[:HEADER.size])
        if nonce != self.got or n > len(self.buf):
            raise ValueError(f"frame {nonce} of {n} bytes, expected frame {self.got}")
        recv_exact(self.sock, self.buf, n)
        self.got += 1
        return self.aead.decrypt(nonce.to_bytes(12, "little"), bytes(self.buf[:n]), None)


def worker(index: int, model: str, engine: bool, tokens: int, listener: socket.socket, port_out: int,
           key_in: bytes, key_out: bytes, prompt: list[int], out: Any) -> None:
    down = None
    for _ in range(300):  # the next worker may not listen yet: 30 s at most
        try:
            down = socket.create_connection(("127.0.0.1", port_out))
            break
        except ConnectionRefusedError:
            time.sleep(0.1)
    if down is None:
        raise ConnectionError(f"worker {index}: the next worker never listened")
    up, _ = listener.accept()
    for s in (up, down):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rx, tx = Link(up, key_in), Link(down, key_out)
    ctx = None
    if engine:
        m = Model(model, RANGES[index])
        ctx = Context(m, n_ctx=512, n_seq_max=1, n_batch=512, n_threads=1)
    pos = 0
    cpu0 = wall0 = 0.0
    seen: list[int] = []
    # the head takes the prompt, then every token the tail sends back; the others one frame a token
    for step in range(tokens + 1 if index == 0 else tokens):
        data = np.asarray(prompt, dtype=np.int32).tobytes() if index == 0 and step == 0 else rx.recv()
        if step == 1:
            cpu0, wall0 = time.process_time(), time.perf_counter()
        if index == 0 and step:
            seen.append(int(np.frombuffer(data, dtype=np.int32)[0]))
            if step == tokens:
                break
        if ctx is None:
            result = data if index else np.zeros(WIDTH, dtype=np.float32).tobytes()
        elif index == 0:
            ids = np.frombuffer(data, dtype=np.int32)
            result = ctx.forward([0] * len(ids), range(pos, pos + len(ids)), tokens=ids).tobytes()
            pos += len(ids)
        else:
            hidden = np.frombuffer(data, dtype=np.float32).reshape(-1, WIDTH)
            n = len(hidden)
            if index == 1:
                result = ctx.forward([0] * n, range(pos, pos + n), hidden=hidden).tobytes()
            else:
                logits = ctx.forward([0] * n, range(pos, pos + n), hidden=hidden,
                                     want_output=[i == n - 1 for i in range(n)])
                result = np.asarray([int(np.argmax(logits[-1]))], dtype=np.int32).tobytes()
            pos += n
        if ctx is None and index == 2:
            result = np.zeros(1, dtype=np.int32).tobytes()
        tx.send(result)
    out.send(("done", index, time.process_time() - cpu0, time.perf_counter() - wall0, seen))


def in_process(model: str, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """Seconds per decode token of the three ranges called one after the other, and the tokens."""
    ctxs = [Context(Model(model, r), n_ctx=512, n_seq_max=1, n_batch=512, n_threads=1) for r in RANGES]
    ids, pos, got = list(prompt), 0, []
    t0 = 0.0
    for step in range(tokens):
        if step == 1:
            t0 = time.perf_counter()
        n = len(ids)
        rows = ctxs[0].forward([0] * n, range(pos, pos + n), tokens=np.asarray(ids, dtype=np.int32))
        rows = ctxs[1].forward([0] * n, range(pos, pos + n), hidden=rows)
        logits = ctxs[2].forward([0] * n, range(pos, pos + n), hidden=rows, want_output=[i == n - 1 for i in range(n)])
        pos += n
        ids = [int(np.argmax(logits[-1]))]
        got.append(ids[0])
    return (time.perf_counter() - t0) / (tokens - 1), got


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--no-engine", action="store_true", help="forward the bytes without computing")
    args = ap.parse_args()
    if args.smoke:  # the smallest ring through every part
        args.tokens = 4
    model = str(default_model_path())
    engine = not args.no_engine
    # token ids of a short chat prompt of the default model (any ids do: both sides take the same)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 7018, 30, 2, 198, 1, 4093, 198,
              2683, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    # each worker's listener bound here, on a port the kernel picks, and handed over: no port to collide on
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]
    ports = [listener.getsockname()[1] for listener in listeners]
    keys = [os.urandom(32) for _ in range(3)]  # key i seals the link into worker i
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = [ctx.Process(target=worker, args=(i, model, engine, args.tokens, listeners[i], ports[(i + 1) % 3],
                                               keys[i], keys[(i + 1) % 3], prompt, child)) for i in range(3)]
    for p in procs:
        p.start()
    for listener in listeners:
        listener.close()
    try:
        results: dict[int, tuple[float, float, list[int]]] = {}
        deadline = time.monotonic() + 600
        while len(results) < 3 and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # a worker failed (its traceback is on stderr): the ring cannot finish
            if parent.poll(1.0):
                msg = parent.recv()
                if msg[0] == "done":
                    results[msg[1]] = (msg[2], msg[3], msg[4])
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    if len(results) < 3:
        print("the ring did not finish", file=sys.stderr)
        return 1
    # timed from the first decode step on: tokens - 1 trips around the ring
    wall = results[0][1] / (args.tokens - 1)
    cpu = [results[i][0] / (args.tokens - 1) * 1e6 for i in range(3)]
    report: dict[str, Any] = {"tokens": args.tokens, "engine": engine, "ring_ms_per_token": wall * 1e3,
                              "cpu_us_per_token": cpu}
    if engine:
        compute, ref = in_process(model, prompt, args.tokens)
        report |= {"in_process_ms_per_token": compute * 1e3, "per_hop_overhead_ms": (wall - compute) / 3 * 1e3,
                   "ring_tok_s": 1 / wall, "in_process_tok_s": 1 / compute,
                   "tokens_identical": results[0][2] == ref}
        lines = [f"ring {1 / wall:.1f} tok/s, in-process split {1 / compute:.1f} tok/s, "
              f"per-hop overhead {(wall - compute) / 3 * 1e3:.3f} ms, tokens identical: {report['tokens_identical']}"]
    else:
        lines = [f"ring without compute: {wall * 1e3:.3f} ms per token round, {wall / 3 * 1e3:.3f} ms per hop"]
    lines += ["CPU µs per token (head, middle, tail): " + " · ".join(f"{c:.0f}" for c in cpu),
              f"load average {os.getloadavg()[0]:.1f}"]
    publish("hop_floor", args, report, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
