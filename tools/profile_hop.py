#!/usr/bin/env python3
"""Where a decode token's software hop goes: fine timing and a profile of the stage daemons' Python.

Three stages (even layer ranges, real engine worker processes, real Noise
links over loopback TCP) and the asker run in this one process, so one
profile covers every daemon's side of a hop: link receive, decrypt, demux,
envelope decode, the worker round trip, encode, encrypt and send. Measured
over --decode greedy tokens of one session:

* wall per token, and the engine calls' share of it: each stage's
  ``EngineSupervisor.call`` wall time per token (the worker round trip:
  request write, worker wake-up, header decode, compute, reply, our wake-up);
* the same round trip without compute: a ``ping`` to each worker, timed from
  the event loop (--pings of them);
* each stage's compute alone: its range in one process, no IPC (LocalChain);
* CPU µs per token of this process (three daemons and the asker) and of each
  worker (all threads, from /proc/PID/task/*/schedstat);
* trio's scheduling per token in this process: event-loop passes (each an
  epoll wait) and task wake-ups, by task, the hand-offs a hop costs;
* with --profile: cProfile of the decode run, the functions with the most own
  time per token, and that time by part of the hot path.

The box is shared: run it next to the same command on the other tree.

Usage: .venv/bin/python tools/profile_hop.py [--decode 64] [--profile] [--receipts]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import numpy as np
import trio
from benchlib.asks import DECODE_TEXT
from benchlib.procs import cpu_ns
from benchlib.result import parser, publish

from meshd.client.ask import AskRequest, AskResult
from meshd.client.route import route_at
from meshd.client.session import run_session
from meshd.client.verifier import Verifier
from meshd.client.verify import CheckPlan
from meshd.engine.chain import LocalChain, even_ranges
from meshd.engine.engine import Model
from meshd.engine.supervisor import EngineSupervisor
from meshd.mesh.models import default_model_path
from meshd.net.peers import open_peers
from meshd.stage.books import StageLimits
from meshd.stage.node import StageNode, stage_node
from wire.identity import NodeIdentity

HOPS = 3
# Which part of a hop a profiled function belongs to, by its file.
PARTS = [
    ("noise/crypto", ("wire/noise.py", "chacha", "cryptography", "noise/")),
    ("mux/link", ("wire/mux", "wire/link.py", "meshd/net/link.py", "meshd/net/transport.py",
                  "trio_websocket", "wsproto", "meshd/net/wsmask.py")),
    ("messages", ("wire/codec.py", "wire/message.py", "wire/decode.py", "wire/walk.py", "wire/stage.py", "wire/tensors.py",
                  "msgpack", "pydantic")),
    ("worker IPC", ("meshd/engine/supervisor.py", "meshd/engine/workerproto.py")),
    ("stage service", ("meshd/stage/",)),
    ("asker", ("meshd/client/",)),
    ("trio", ("trio/",)),
    ("numpy", ("numpy",)),
]


def part_of(filename: str) -> str:
    for name, needles in PARTS:
        if any(n in filename for n in needles):
            return name
    return "other"


class Wakeups(trio.abc.Instrument):
    """Counts the event loop's passes and each task's wake-ups while ``counting``."""

    def __init__(self) -> None:
        self.counting = False
        self.passes = 0
        self.tasks: collections.Counter[str] = collections.Counter()

    def before_io_wait(self, timeout: float) -> None:
        if self.counting:
            self.passes += 1

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        if self.counting:
            self.tasks[task.name.rsplit(".", 1)[-1]] += 1


class CallTimer:
    """Wraps each stage's ``EngineSupervisor.call``: wall time of its forward calls."""

    def __init__(self) -> None:
        self.forward_s: dict[int, float] = {}
        self.forward_n: dict[int, int] = {}

    def install(self, index: int, engine: EngineSupervisor) -> None:
        inner = engine.call
        self.forward_s[index] = 0.0
        self.forward_n[index] = 0

        async def call(header: dict[str, Any], payload: bytes | memoryview = b"",
                       timeout: float | None = None, fds: tuple[int, ...] = ()) -> tuple[dict[str, Any], bytearray]:
            if header.get("op") != "forward":
                return await inner(header, payload, timeout, fds)
            t0 = time.perf_counter()
            try:
                return await inner(header, payload, timeout, fds)
            finally:
                self.forward_s[index] += time.perf_counter() - t0
                self.forward_n[index] += 1

        engine.call = call  # type: ignore[method-assign]

    def reset(self) -> None:
        for k in self.forward_s:
            self.forward_s[k] = 0.0
            self.forward_n[k] = 0


def stage_compute(model: Path, split: list[tuple[int, int]], n: int) -> list[float]:
    """Seconds per decode token of each range alone, in this process (no IPC, no wire)."""
    chain = LocalChain(model, split, n_ctx=2048, n_threads=1)
    try:
        ids = chain.head.tokenize(DECODE_TEXT, add_special=True, parse_special=False)
        chain.forward(ids, 0)
        per = [0.0] * len(split)
        token = ids[-1]
        pos = len(ids)
        for _ in range(n):
            x: Any = np.asarray([token], dtype=np.int32)
            for i, ctx in enumerate(chain.contexts):
                t0 = time.perf_counter()
                seq = np.zeros(1, dtype=np.int32)
                p = np.asarray([pos], dtype=np.int32)
                x = ctx.forward(seq, p, tokens=x) if i == 0 else ctx.forward(seq, p, hidden=x)
                per[i] += time.perf_counter() - t0
            token = int(np.argmax(x[-1]))
            pos += 1
        return [s / n for s in per]
    finally:
        chain.close()


async def ping_rtt(engines: list[EngineSupervisor], n: int) -> list[float]:
    out = []
    for e in engines:
        t0 = time.perf_counter()
        for _ in range(n):
            await e.call({"op": "ping"})
        out.append((time.perf_counter() - t0) / n)
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or default_model_path()
    probe = Model(model, (0, 1))
    n_layer = probe.report.n_layer
    probe.close()
    split = even_ranges(n_layer, HOPS)
    timer = CallTimer()
    out: dict[str, Any] = {"split": split}
    async with AsyncExitStack() as stack:
        nodes: list[StageNode] = []
        for i, r in enumerate(split):
            node = await stack.enter_async_context(stage_node(model, r, StageLimits(), NodeIdentity.generate(),
                                                              threads=1))
            timer.install(i, node.engine)
            nodes.append(node)
        peers = await stack.enter_async_context(open_peers(NodeIdentity.generate()))
        route = route_at([n.address for n in nodes])
        warm = AskResult()
        await run_session(peers, route, AskRequest(text=DECODE_TEXT, max_tokens=8), warm)
        engines = [n.engine for n in nodes]
        out["ping_ms"] = [s * 1000 for s in await ping_rtt(engines, args.pings)]
        workers = [e.pid or 0 for e in engines]
        # CPU time, not wall: on a shared box a wall profile mostly shows who held the core
        profile = cProfile.Profile(time.thread_time) if args.profile else None
        wakeups = Wakeups()
        trio.lowlevel.add_instrument(wakeups)
        wakeups.counting = True
        timer.reset()
        before = [cpu_ns(p) for p in workers]
        cpu0 = time.process_time_ns()
        result = AskResult()
        if profile:
            profile.enable()
        # receipts without replicas: what every hop pays for verification, spot checks apart
        verifier = Verifier(peers, CheckPlan(every=0)) if args.receipts else None
        await run_session(peers, route, AskRequest(text=DECODE_TEXT, max_tokens=args.decode), result,
                          verifier=verifier)
        if profile:
            profile.disable()
        cpu1 = time.process_time_ns()
        wakeups.counting = False
        trio.lowlevel.remove_instrument(wakeups)
        spent = [cpu_ns(p) - b for p, b in zip(workers, before, strict=True)]
        tokens = max(1, len(result.tokens) - 1)
        out["tokens"] = len(result.tokens)
        out["wall_ms"] = 1000 / result.decode_rate
        out["forward_ms"] = [timer.forward_s[i] / max(1, timer.forward_n[i]) * 1000 for i in range(HOPS)]
        out["daemons_cpu_us"] = (cpu1 - cpu0) / 1000 / tokens
        out["loop_passes"] = wakeups.passes / tokens
        out["wakeups"] = {name: n / tokens for name, n in wakeups.tasks.most_common()}
        out["workers_cpu_us"] = [s / 1000 / tokens for s in spent]
        if profile:
            out["profile"] = profile
            out["profile_tokens"] = tokens
    out["compute_ms"] = [s * 1000 for s in await trio.to_thread.run_sync(stage_compute, model, split, args.decode)]
    return out


def report(out: dict[str, Any]) -> str:
    compute = sum(out["compute_ms"])
    lines = [
        f"split {out['split']}, {out['tokens']} tokens, 1 thread per worker; this process = 3 daemons + asker",
        f"wall per token                  {out['wall_ms']:.3f} ms",
        f"in-process split compute        {compute:.3f} ms  (per stage {', '.join(f'{c:.3f}' for c in out['compute_ms'])})",
        f"software per hop (wall-compute)/3 {(out['wall_ms'] - compute) / HOPS:.3f} ms",
        f"engine forward call per stage   {', '.join(f'{c:.3f}' for c in out['forward_ms'])} ms "
        f"(minus compute: {', '.join(f'{f - c:.3f}' for f, c in zip(out['forward_ms'], out['compute_ms'], strict=True))})",
        f"worker ping round trip          {', '.join(f'{p:.3f}' for p in out['ping_ms'])} ms",
        f"CPU µs/token: 3 daemons + asker {out['daemons_cpu_us']:.0f}; workers "
        f"{', '.join(f'{w:.0f}' for w in out['workers_cpu_us'])} "
        f"(compute {', '.join(f'{c * 1000:.0f}' for c in out['compute_ms'])})",
        f"trio per token (this process)   {out['loop_passes']:.1f} loop passes, "
        f"{sum(out['wakeups'].values()):.1f} task wake-ups: "
        + ", ".join(f"{name} {n:.1f}" for name, n in list(out["wakeups"].items())[:6]),
    ]
    profile = out.get("profile")
    if profile is not None:
        tokens = out["profile_tokens"]
        stats = pstats.Stats(profile)
        by_part: dict[str, float] = {}
        rows = []
        for (filename, line, func), (_cc, nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
            part = part_of(filename)
            by_part[part] = by_part.get(part, 0.0) + tt
            rows.append((tt, nc, f"{Path(filename).parent.name}/{Path(filename).name}:{line}({func})"))
        lines += ["", "profiled own time per token, by part of the hot path (µs; profiling inflates every figure):"]
        lines += [f"  {name:14s} {t / tokens * 1e6:8.0f}" for name, t in sorted(by_part.items(), key=lambda kv: -kv[1])]
        lines += ["", "top functions by own time per token (µs, calls per token):"]
        for tt, nc, name in sorted(rows, reverse=True)[:30]:
            lines.append(f"  {tt / tokens * 1e6:8.1f} {nc / tokens:6.1f}  {name}")
        # a task's step is entered anew at each resumption, so a coroutine's cumulative time is per step
        ours = [(ct, nc, f"{Path(filename).parent.name}/{Path(filename).name}:{line}({func})")
                for (filename, line, func), (_cc, nc, _tt, ct, _callers) in stats.stats.items()  # type: ignore[attr-defined]
                if any(k in filename for k in ("meshd/", "wire/", "trio_websocket"))]
        lines += ["", "meshd, wire and trio-websocket functions by time including callees, per token (µs, calls):"]
        for ct, nc, name in sorted(ours, reverse=True)[:30]:
            lines.append(f"  {ct / tokens * 1e6:8.1f} {nc / tokens:6.1f}  {name}")
    return "\n".join(lines)


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", type=Path, help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--decode", type=int, default=64, help="tokens generated")
    ap.add_argument("--pings", type=int, default=200, help="ping round trips per worker")
    ap.add_argument("--profile", action="store_true", help="cProfile the decode run")
    ap.add_argument("--receipts", action="store_true", help="stages sign receipts (verification's default)")
    args = ap.parse_args()
    if args.smoke:  # the smallest run through every part: the profile and the receipts included
        args.decode, args.pings, args.profile, args.receipts = 8, 10, True, True
    out = trio.run(run, args)
    text = report(out)
    publish("profile_hop", args, {k: v for k, v in out.items() if k != "profile"}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
