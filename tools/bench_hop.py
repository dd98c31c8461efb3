#!/usr/bin/env python3
"""Per-hop software overhead of the fast path against the daemons' path, with every process on its own core.

Three `meshd serve` stages of --model (even layer ranges, --threads compute
threads each, default 1) on loopback, no link emulator, no RPC. The asker is
this process. Each round (--rounds, default 3) runs a warm-up session on each
path, then, in rotating order:

* fast path: one greedy session of --tokens tokens whose rows go from engine
  worker to engine worker (wire/fastlink.py, meshd/engine/fastpath.py);
* daemons' path: the same session with fast=False (every row via both daemons);
* in-process split: meshd's engine with the same three ranges called one after
  the other in this process (LocalChain, --threads threads): the split's compute
  without IPC or wire.

Figures, as tools/bench_network.py's "direct" row computes them:

* decode tok/s of a session: (tokens - 1) / time from the first streamed token
  to the last, at the asker; in-process: steps / time of the decode steps;
* per-hop overhead ms = (1 / session tok/s - 1 / in-process tok/s) / 3 hops
  x 1000 (goal for the fast path: <= 0.15 ms per hop);
* CPU µs per generated token of every process over a session (open, prompt,
  tokens): each stage's daemon and engine worker from
  /proc/PID/task/*/schedstat, the asker from its process time;
* exactness: the token ids of the fast and the daemons' answers must be equal.

Medians and every sample are printed (a markdown table) and, with --json,
written. A raw-text prompt is used; a random-weight model may end its answer
early by end-of-generation, so the tokens actually generated are reported.

--pin gives each process its own core with sched_setaffinity (every thread of
it): the asker (and so the in-process chain) on core 0, stage i's daemon on
core 2i+1 and its engine worker on core 2i+2 (cores counted among those this
process may use). With fewer than 7 usable cores the ids wrap around, and the
output says that not every process has a core of its own.

Usage, here: .venv/bin/python tools/bench_hop.py --model M.gguf [--tokens 128] [--rounds 3] [--pin] [--json OUT]

On the device machine (python3 3.12 without our dependencies, no network), with
the wheels, the engine library and the model carried in the ignored folder .hop
(wheels in .hop/whl, libmeshengine.so + meshengine.h + sources.json in
.hop/engine) and meshd.egg-info (meshd's version, which `meshd serve` reads)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .hop/whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD MESHD_ENGINE_DIR=$PWD/.hop/engine
    PYTHONUNBUFFERED=1 python3 tools/bench_hop.py --model .hop/llama-gqa-untied.gguf --pin \\
        --json $OUT/bench_hop.json 2>&1 | tee $OUT/bench_hop.log

The stage processes are started with this interpreter and inherit PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from benchlib.asks import DECODE_TEXT, decode_rate, meshd_decode, stage_metrics
from benchlib.procs import BenchError, Proc, affinity, cpu_ns, median, pin, start_stage, usable_cores
from benchlib.result import parser, publish

from meshd.client.ask import AskRequest, AskResult
from meshd.client.route import Stage, route_at
from meshd.client.session import run_session
from meshd.engine.chain import LocalChain, even_ranges
from meshd.engine.engine import Model
from meshd.mesh.models import default_model_path
from meshd.net.peers import Peers, open_peers
from wire.identity import NodeIdentity

HOPS = 3
PATHS = ("fast", "daemons", "inproc")


# ----- cores








def pin_all(stages: list[Proc], cores: list[int]) -> dict[str, Any]:
    """The asker on the first usable core, stage i's daemon on the (2i+1)th, its worker on the (2i+2)th."""
    want = 1 + 2 * len(stages)
    own = len(cores) >= want
    plan: dict[str, int] = {"asker": cores[0]}
    for i, s in enumerate(stages):
        plan[f"stage{i} daemon"] = cores[(2 * i + 1) % len(cores)]
        plan[f"stage{i} worker"] = cores[(2 * i + 2) % len(cores)]
        pin(s.pids[0], {plan[f"stage{i} daemon"]})
        pin(s.pids[1], {plan[f"stage{i} worker"]})
    pin(os.getpid(), {plan["asker"]})
    return {"plan": plan, "own_core_each": own, "processes": want, "usable_cores": len(cores)}


def affinities(stages: list[Proc]) -> dict[str, list[int]]:
    """The cores each process's threads may run on, as the kernel says."""
    seen = {"asker": affinity(os.getpid())}
    for i, s in enumerate(stages):
        seen[f"stage{i} daemon"] = affinity(s.pids[0])
        seen[f"stage{i} worker"] = affinity(s.pids[1])
    return seen


# ----- one session


async def session(peers: Peers, route: list[Stage], pids: list[int], n: int, fast: bool,
                  stall_timeout: float) -> dict[str, Any]:
    """One greedy session of n tokens (raw text), the CPU every watched process and the asker spent on it, and
    on the fast path each stage's worker's own software time per decode hop (its hop_in_us and hop_out_us)."""
    addresses = [s.address for s in route]
    counts = [await stage_metrics(peers, a) for a in addresses] if fast else []
    before = [cpu_ns(pid) for pid in pids]
    asker = time.process_time_ns()
    result = AskResult()
    await run_session(peers, route, AskRequest(text=DECODE_TEXT, max_tokens=n, fast=fast), result,
                      stall_timeout=stall_timeout)
    asker = time.process_time_ns() - asker
    spent = [cpu_ns(pid) - b for pid, b in zip(pids, before, strict=True)] + [asker]
    tokens = len(result.tokens)
    worker_us = []
    for address, b in zip(addresses, counts, strict=False):
        a = await stage_metrics(peers, address)
        calls = max(1.0, a["fast_decode_calls"] - b["fast_decode_calls"])
        worker_us.append([(a[k] - b[k]) / calls for k in ("fast_hop_in_us", "fast_hop_out_us")])
    return {"rate": result.decode_rate, "tokens": tokens, "ids": list(result.tokens), "reason": result.reason,
            "cpu_us": [ns / 1000 / max(1, tokens) for ns in spent], "worker_us": worker_us}


# ----- the run


def model_layers(model: Path) -> int:
    m = Model(model, (0, 1))
    try:
        return m.report.n_layer
    finally:
        m.close()


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    n_layer = model_layers(args.model)
    split = even_ranges(n_layer, HOPS)
    cores = usable_cores()
    out: dict[str, Any] = {
        "model": str(args.model), "model_bytes": args.model.stat().st_size, "n_layer": n_layer,
        "split": [list(r) for r in split], "threads": args.threads, "tokens": args.tokens, "rounds": args.rounds,
        "host": {"cpus": os.cpu_count(), "usable_cores": len(cores), "machine": platform.machine(),
                 "python": platform.python_version(), "loadavg_before": os.getloadavg()},
        "pinned": args.pin, "samples": [],
    }
    logdir = Path(tempfile.mkdtemp(prefix="bench-hop-"))
    stages: list[Proc] = []
    chain: LocalChain | None = None
    try:
        for r in split:
            stages.append(start_stage(args.model, r, args.threads, None, logdir, 2, args.session_tokens))
        print(f"started {HOPS} stages {split} (logs in {logdir})", file=sys.stderr)
        if args.pin:
            try:
                out["pinning"] = pin_all(stages, cores)
            except OSError as exc:  # a sandbox that refuses affinity: measure anyway, and say so
                out["pin_error"] = f"{type(exc).__name__}: {exc}"
                print(f"bench_hop: pinning failed ({out['pin_error']}); running unpinned", file=sys.stderr)
        out["affinity"] = affinities(stages)
        print(f"cores each process may run on: {out['affinity']}", file=sys.stderr)
        pids = [pid for s in stages for pid in s.pids]
        chain = LocalChain(args.model, split, n_ctx=args.session_tokens, n_threads=args.threads)
        ids = chain.head.tokenize(DECODE_TEXT)
        await trio.to_thread.run_sync(decode_rate, chain, ids, 8)
        async with open_peers(NodeIdentity.generate()) as peers:
            route = route_at([s.address for s in stages])
            for rnd in range(args.rounds):
                await meshd_decode(peers, route, 8, fast=True)  # links, KV and caches warm
                await meshd_decode(peers, route, 8, fast=False)
                rec: dict[str, Any] = {"round": rnd, "loadavg": os.getloadavg()}
                order = PATHS[rnd % 3:] + PATHS[:rnd % 3]
                for name in order:
                    if name == "inproc":
                        rec["inproc"] = {"rate": await trio.to_thread.run_sync(decode_rate, chain, ids, args.tokens)}
                    else:
                        rec[name] = await session(peers, route, pids, args.tokens, name == "fast", args.stall_timeout)
                compute = 1 / rec["inproc"]["rate"]
                for name in ("fast", "daemons"):
                    r = rec[name]["rate"]
                    rec[name]["hop_ms"] = (1 / r - compute) / HOPS * 1000 if r else float("nan")
                rec["exact"] = rec["fast"]["ids"] == rec["daemons"]["ids"]
                out["samples"].append(rec)
                publish("hop", args, out)  # what is measured so far survives a later failure
                print(f"round {rnd + 1}/{args.rounds}: fast {rec['fast']['rate']:.1f} tok/s "
                      f"(hop {rec['fast']['hop_ms']:.3f} ms, {rec['fast']['tokens']} tokens), daemons "
                      f"{rec['daemons']['rate']:.1f} tok/s (hop {rec['daemons']['hop_ms']:.3f} ms, "
                      f"{rec['daemons']['tokens']} tokens), in-process {rec['inproc']['rate']:.1f} tok/s, "
                      f"exact {rec['exact']}", file=sys.stderr)
    finally:
        for s in stages:
            s.stop()
        if chain is not None:
            chain.close()
    out["host"]["loadavg_after"] = os.getloadavg()
    return out


# ----- the table


def table(out: dict[str, Any]) -> str:
    rounds = out["samples"]

    def col(path: str, key: str) -> list[float]:
        return [r[path][key] for r in rounds]

    def row(label: str, xs: list[float], fmt: str) -> str:
        return f"| {label} | {median(xs):{fmt}} | {', '.join(f'{x:{fmt}}' for x in xs)} |"

    host = out["host"]
    pinning = out.get("pinning")
    if pinning:
        cores = "pinned: " + ", ".join(f"{k} → core {v}" for k, v in pinning["plan"].items())
        cores += ("; every process on its own core" if pinning["own_core_each"] else
                  f"; NOT every process on its own core ({pinning['processes']} processes, "
                  f"{pinning['usable_cores']} usable cores: core ids wrap around)")
    else:
        cores = "not pinned (the kernel places every process)"
        if out.get("pin_error"):
            cores = f"PINNING FAILED ({out['pin_error']}), " + cores
    split = "+".join(f"[{a},{b})" for a, b in out["split"])
    inproc = col("inproc", "rate")
    lines = [
        f"model {Path(out['model']).name} ({out['model_bytes'] / 2**20:.1f} MiB, {out['n_layer']} layers), "
        f"split {split}, {out['threads']} thread(s) per process, {len(rounds)} round(s) of {out['tokens']} "
        f"tokens asked; {host['cpus']} CPUs ({host['usable_cores']} usable), {cores}; load average "
        f"{host['loadavg_before'][0]:.2f} before, {host['loadavg_after'][0]:.2f} after; Python {host['python']}",
        "",
        "| figure | median | samples (round order) |",
        "|---|---|---|",
        row("decode tok/s, fast path", col("fast", "rate"), ".1f"),
        row("decode tok/s, daemons' path", col("daemons", "rate"), ".1f"),
        row("decode tok/s, in-process split (1 process, 3 ranges)", inproc, ".1f"),
        row("in-process split compute ms/token", [1000 / x for x in inproc], ".3f"),
        row("per-hop overhead ms, fast path (goal ≤ 0.15)", col("fast", "hop_ms"), ".3f"),
        row("per-hop overhead ms, daemons' path", col("daemons", "hop_ms"), ".3f"),
        *[row(f"stage{i} worker's own µs per decode hop, fast path, mean per hop (step whole to engine call "
              f"{median([r['fast']['worker_us'][i][0] for r in rounds]):.0f} + engine return to send call "
              f"{median([r['fast']['worker_us'][i][1] for r in rounds]):.0f})",
              [sum(r["fast"]["worker_us"][i]) for r in rounds], ".0f") for i in range(HOPS)],
        row("tokens generated, fast path", col("fast", "tokens"), ".0f"),
        row("tokens generated, daemons' path", col("daemons", "tokens"), ".0f"),
        "",
        "CPU µs per generated token of each process (all threads) over a whole session (open, prompt, tokens), "
        "median over rounds",
        "",
        "| process | fast path | daemons' path | cores it may run on |",
        "|---|---|---|---|",
    ]
    names = [f"stage{i} {kind}" for i in range(HOPS) for kind in ("daemon", "worker")] + ["asker"]
    seen = out.get("affinity", {})
    fast_cpu = [median([r["fast"]["cpu_us"][i] for r in rounds]) for i in range(len(names))]
    slow_cpu = [median([r["daemons"]["cpu_us"][i] for r in rounds]) for i in range(len(names))]
    for i, name in enumerate(names):
        label = name if name == "asker" else f"{name} {split.split('+')[int(name[5])]}"
        cpus = seen.get(name, [])
        where = "all" if len(cpus) == host["usable_cores"] and not pinning else ",".join(map(str, cpus)) or "?"
        lines.append(f"| {label} | {fast_cpu[i]:.0f} | {slow_cpu[i]:.0f} | {where} |")
    lines.append(f"| all | {sum(fast_cpu):.0f} | {sum(slow_cpu):.0f} | |")
    exact = all(r["exact"] for r in rounds)
    same = all(r["fast"]["ids"] == rounds[0]["fast"]["ids"] for r in rounds)
    lines += ["", f"exact: fast path and daemons' path token ids equal in every round: {exact} "
                  f"({rounds[0]['fast']['tokens']} tokens, ended by {rounds[0]['fast']['reason'] or '?'}); "
                  f"the same ids in every round: {same}"]
    hop = median(col("fast", "hop_ms"))
    lines.append(f"fast-path per-hop overhead {hop:.3f} ms (median): goal ≤ 0.15 ms {'met' if hop <= 0.15 else 'NOT met'}; "
                 f"daemons' path {median(col('daemons', 'hop_ms')):.3f} ms")
    return "\n".join(lines)


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", type=Path, help="a GGUF (a tiny one isolates the hop's own cost; default: meshd's)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens asked of each decode session (default 128)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; medians and all samples are reported (default 3)")
    ap.add_argument("--pin", action="store_true",
                    help="asker on core 0, stage i's daemon on core 2i+1 and worker on 2i+2 (sched_setaffinity)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads of every engine (default 1)")
    ap.add_argument("--session-tokens", type=int, default=512, help="KV tokens per session on each stage")
    ap.add_argument("--stall-timeout", type=float, default=60.0, help="seconds a session waits for a token")
    ap.add_argument("--time-limit", type=float, default=600.0, help="seconds the whole run may take")
    args = ap.parse_args()
    args.model = args.model or default_model_path()
    if args.smoke:  # the smallest run through every path: one round of a few tokens
        args.tokens, args.rounds, args.session_tokens = 8, 1, 64

    async def limited() -> dict[str, Any]:
        with trio.fail_after(args.time_limit):
            return await bench(args)

    try:
        out = trio.run(limited)
    except (BenchError, trio.TooSlowError) as exc:
        print(f"bench_hop: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    publish("hop", args, out, table(out))
    return 0 if all(r["exact"] for r in out["samples"]) else 3


if __name__ == "__main__":
    sys.exit(main())
