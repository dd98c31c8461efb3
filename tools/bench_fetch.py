#!/usr/bin/env python3
"""Fetch figures on loopback, in one run: fetch throughput against the raw link, and a stage's decode while it serves chunks.

1. Throughput: a server process holds the default model and serves it as a
   chunk source, and a raw stream that sends bulk bytes as fast as the link
   takes them. This process fetches the whole model (every chunk verified
   and written to a sparse file) and reads the same number of raw bytes, over
   the same link, alternating; the ratio is fetch / raw.
2. Decode under load: a server process runs a whole-model stage (one
   compute thread) with a chunk source on the same peers, wired as a daemon
   wires it (busy while its engine computes: uploads then trickle at
   ``busy_upload_rate``). ``meshd ask --route`` measures decode tok/s, idle
   and while this process fetches the model from that stage over and over,
   alternating idle and loaded asks so drift in the shared machine's load hits
   both alike. Goal: loaded at most 10% slower. The same again with a source
   that is never throttled shows what the throttle buys.
3. Fetch then serve: ``meshd pull`` of the tail range (15:30) from the stage,
   then ``meshd serve`` of the pulled sparse file until it is ready: the time a
   volunteer without the file takes to start serving its range by hand.

Usage: .venv/bin/python tools/bench_fetch.py [--rounds 3] [--asks 4] [--json bench-out/fetch.json]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from benchlib.procs import ROOT
from benchlib.result import parser, publish
from benchlib.smoke import use_tiny_model
from localmesh import run_meshd, spawn, start_serve, stop_process

from meshd.fetch.fetcher import SourceRef, fetch_chunks, fetch_manifest
from meshd.fetch.source import ChunkSource, SourceConfig, activity, register
from meshd.mesh.models import default_model_path
from meshd.net.peers import PeersConfig, open_peers
from meshd.net.stream import Stream
from meshd.stage.books import StageLimits
from meshd.stage.node import stage_node
from meshd.store.holding import WholeFile
from meshd.store.manifest import Manifest, compute
from meshd.store.sparse import SparseFile
from wire.identity import NodeIdentity

RAW = "bench/raw"
RATE = re.compile(r"([\d.]+) tokens/s")
BLOCK = 4 << 20


async def serve_raw(stream: Stream) -> None:
    """Send as many bulk bytes as the peer asks for (an 8-byte count), then end the stream."""
    want = int.from_bytes(await stream.receive_some(8), "big")
    block = bytes(BLOCK)
    while want > 0:
        await stream.send_all(block[: min(want, BLOCK)])
        want -= BLOCK
    await stream.send_eof()


async def server(kind: str) -> None:
    model = default_model_path()
    holding = WholeFile(model, await trio.to_thread.run_sync(compute, model))
    if kind == "raw":
        async with open_peers(NodeIdentity.generate(), PeersConfig()) as peers:
            # No upload budget: this measures what the protocol makes of the link, not the budget.
            source = ChunkSource(SourceConfig(upload_rate=None, total_upload_rate=None))
            source.offer(holding)
            register(peers, source)
            peers.handle(RAW, serve_raw, raw=True)
            port = await peers.listen("127.0.0.1", 0)
            print(f"ready 127.0.0.1:{port}", flush=True)
            await trio.sleep_forever()
    limits = StageLimits(max_sessions=2, max_session_tokens=512, max_total_tokens=1024)
    async with stage_node(model, None, limits, NodeIdentity.generate(), PeersConfig(), ("127.0.0.1", 0), 1) as node:
        # As a daemon wires it: the stage's engine calls say when it is busy ("stage-unthrottled": never).
        metrics = node.service.metrics
        source = ChunkSource(busy=None if kind == "stage-unthrottled" else activity(lambda: metrics.engine_calls))
        source.offer(holding)
        register(node.peers, source)
        print(f"ready {node.address}", flush=True)
        await trio.sleep_forever()


def start_server(kind: str) -> tuple[subprocess.Popen[str], str]:
    proc = spawn([sys.executable, __file__, "--server", kind], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if len(line) != 2 or line[0] != "ready":
        stop_process(proc)
        raise RuntimeError(f"the {kind} server did not start: {line}")
    return proc, line[1]


async def fetch_all(peers: Any, at: str, manifest: Manifest, scratch: Path) -> float:
    """Seconds to fetch every chunk of the model into a fresh sparse file."""
    out = scratch / "fetched.gguf"
    for leftover in scratch.glob("fetched.gguf*"):
        leftover.unlink()
    target = await trio.to_thread.run_sync(SparseFile.open, out, manifest)
    t0 = time.perf_counter()
    await fetch_chunks(peers, [SourceRef(at)], target, manifest.chunks)
    seconds = time.perf_counter() - t0
    target.close()
    return seconds


async def raw_read(peers: Any, at: str, size: int) -> float:
    t0 = time.perf_counter()
    stream = await peers.open_stream(at, RAW)
    async with stream:
        await stream.send_all(size.to_bytes(8, "big"))
        got = 0
        while chunk := await stream.receive_some(1 << 20):
            got += len(chunk)
    assert got >= size, f"raw stream gave {got} of {size} bytes"
    return time.perf_counter() - t0


async def throughput(rounds: int, scratch: Path, warm: bool) -> dict[str, Any]:
    proc, at = start_server("raw")
    try:
        async with open_peers(NodeIdentity.generate(), PeersConfig()) as peers:
            manifest = await fetch_manifest(peers, [SourceRef(at)], compute_id())
            size = sum(c.size for c in manifest.chunks)
            raw, fetched = [], []
            if warm:
                await raw_read(peers, at, size)  # the link
            for _ in range(rounds):
                raw.append(size / await raw_read(peers, at, size))
                fetched.append(size / await fetch_all(peers, at, manifest, scratch))
    finally:
        stop_process(proc)
    return {"bytes": size, "raw_MiBps": [r / 2**20 for r in raw], "fetch_MiBps": [f / 2**20 for f in fetched],
            "ratio": statistics.median(fetched) / statistics.median(raw)}


_ID: list[str] = []


def compute_id() -> str:
    if not _ID:
        _ID.append(compute(default_model_path()).model_id)
    return _ID[0]


def ask_rate(at: str, tokens: int) -> float:
    done = run_meshd("ask", "--route", at, "--max-tokens", str(tokens), "--raw", "Once upon a time,")
    m = RATE.search(done.stderr)
    if done.returncode != 0 or m is None:
        raise RuntimeError(f"ask failed (rc {done.returncode}): {done.stderr.strip()}")
    return float(m.group(1))


async def decode_under_load(kind: str, asks: int, tokens: int, scratch: Path, warm: bool) -> dict[str, Any]:
    """Decode tok/s of a stage idle and while this process fetches the model from it, alternating."""
    proc, at = start_server(kind)
    try:
        if warm:
            await trio.to_thread.run_sync(ask_rate, at, 8)  # the worker
        idle, loaded = [], []
        fetched, fetch_seconds = 0, 0.0
        async with open_peers(NodeIdentity.generate(), PeersConfig()) as peers:
            manifest = await fetch_manifest(peers, [SourceRef(at)], compute_id())
            for _ in range(asks):
                idle.append(await trio.to_thread.run_sync(ask_rate, at, tokens))
                async with trio.open_nursery() as nursery:
                    async def keep_fetching() -> None:
                        nonlocal fetched, fetch_seconds
                        while True:
                            t0 = time.perf_counter()
                            try:
                                await fetch_all(peers, at, manifest, scratch)
                                fetched += manifest.file_size
                            finally:
                                fetch_seconds += time.perf_counter() - t0

                    nursery.start_soon(keep_fetching)
                    loaded.append(await trio.to_thread.run_sync(ask_rate, at, tokens))
                    nursery.cancel_scope.cancel()
    finally:
        stop_process(proc)
    slower = 1 - statistics.median(loaded) / statistics.median(idle)
    return {"idle_tok_s": idle, "loaded_tok_s": loaded, "slower": slower, "goal_met": slower <= 0.10,
            "whole_model_fetches_completed": fetched // manifest.file_size,
            "seconds_fetching": fetch_seconds}


def fetch_then_serve(scratch: Path) -> dict[str, Any]:
    proc, at = start_server("stage")
    try:
        out = scratch / "tail.gguf"
        t0 = time.perf_counter()
        pulled = run_meshd("pull", compute_id(), "--layers", "15:30", "--seed", at, "--out", str(out))
        if pulled.returncode != 0:
            raise RuntimeError(f"pull failed: {pulled.stderr.strip()}")
        t1 = time.perf_counter()
        stage = start_serve("--model", str(out), "--layers", "15:30", "--threads", "1", "--max-sessions", "1",
                            "--session-tokens", "256")
        t2 = time.perf_counter()
        stage.stop()
    finally:
        stop_process(proc)
    return {"pull_s": t1 - t0, "serve_ready_s": t2 - t1, "total_s": t2 - t0, "pull_output": pulled.stdout.strip()}


def table(out: dict[str, Any]) -> str:
    t, d, u, j = out["throughput"], out["decode"], out["decode_unthrottled"], out["fetch_then_serve"]
    med = statistics.median
    rows = [
        ("raw link, bulk bytes", f"{med(t['raw_MiBps']):.0f} MiB/s", ""),
        ("fetch (verify + write)", f"{med(t['fetch_MiBps']):.0f} MiB/s", f"{t['ratio']:.2f} of raw"),
        ("stage decode, idle", f"{med(d['idle_tok_s']):.1f} tok/s", ""),
        ("stage decode, serving chunks", f"{med(d['loaded_tok_s']):.1f} tok/s",
         f"{d['slower'] * 100:+.1f}% slower ({'meets' if d['goal_met'] else 'misses'} the 10% goal); "
         f"chunks trickle while it decodes"),
        ("  same, never throttled", f"{med(u['loaded_tok_s']):.1f} tok/s",
         f"{u['slower'] * 100:+.1f}% slower than its idle {med(u['idle_tok_s']):.1f} tok/s"),
        ("pull 15:30, then serve ready", f"{j['total_s']:.1f} s", f"pull {j['pull_s']:.1f} s, serve {j['serve_ready_s']:.1f} s"),
    ]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{width}}  {b:>14}  {c}" for a, b, c in rows)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="bench-fetch-"))
    # warm-ups before what is timed; a smoke run's figures are no measurement, and it goes the same ways without
    warm = not args.smoke
    try:
        out = {"model": default_model_path().name, "throughput": await throughput(args.rounds, scratch, warm),
               "decode": await decode_under_load("stage", args.asks, args.tokens, scratch, warm),
               "decode_unthrottled": await decode_under_load("stage-unthrottled", args.asks, args.tokens, scratch,
                                                             warm)}
        out["fetch_then_serve"] = await trio.to_thread.run_sync(fetch_then_serve, scratch)
        return out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3, help="raw and fetch transfers of the whole model (default 3)")
    ap.add_argument("--asks", type=int, default=4, help="idle and loaded asks each (default 4)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens an ask decodes (default 64)")
    ap.add_argument("--server", choices=["raw", "stage", "stage-unthrottled"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.server:
        trio.run(server, args.server)
        return 0
    if args.smoke:  # the smallest run through every part: one transfer, one ask of a few tokens each way, a tiny model
        args.rounds, args.asks, args.tokens = 1, 1, 4
        use_tiny_model()
    out = trio.run(bench, args)
    publish("fetch", args, out, table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
