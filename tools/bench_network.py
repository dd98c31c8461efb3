#!/usr/bin/env python3
"""meshd against llama.cpp RPC over emulated links: decode, prefill, first token and the floor, per one-way delay.

One machine per stage joined by real links is what users run; this box has
one kernel and no netem, so every hop gets its own emulated link
(tools/link_emulator.py: a TCP proxy adding a one-way delay in each
direction) in front of the listening side:

* meshd, 3 `meshd serve` stages (even layer ranges). Each stage's proxy is the
  address the route names, and a stage dials the next (and the tail the head)
  at the address the route gives it, so every hop of the ring crosses one
  link: head -> stage 2 -> tail -> head is 3 one-way delays per token. The
  asker's own streams go through the same proxies. Sessions take the fast path
  (rows from engine worker to engine worker on a connection of the session's
  own, which the stage dials at that same address); the same decode through
  the daemons is the last column, side by side. After each delay the proxy
  logs are checked: every stage's proxy carried the asker's connection, the
  previous stage's, and the previous stage's fast-path connections.
* llama.cpp RPC, `llama-bench --rpc` driving 3 `ggml-rpc-server` processes of
  the same pinned tree, split by -ts exactly as meshd's stages are (see
  tools/bench_pipeline.py), each server behind its own proxy with the same
  delay.
* the floor: meshd's engine with the three ranges called in one process, one
  after the other (the split's compute, no IPC, no wire), plus 3 x the one-way
  delay per token.

Delays 0, 1, 5 and 20 ms (--delays), and a row without any proxy ("direct"),
which shows what the emulator itself costs. All processes use --threads
compute threads (default 1). Within a delay the three setups run one after the
other, in rotating order.

Figures:

* decode tok/s: meshd, (tokens - 1) / time from the first streamed token to the
  last, at the asker; RPC, llama-bench `tg` (a decode-only run, -p 0); floor,
  1 / (in-process split compute per token + 3 x delay). RPC runs at llama.cpp's
  defaults, which turn flash attention on for the CPU; meshd's engine keeps it
  off (its kernels sum in a batch-dependent order), so the RPC decode is also
  given with -fa 0, the same attention as meshd's.
* idle-gap floor tok/s: the in-process split again, sleeping the one-way delay
  after each range's call (bench_engine.decode_rate's gap): compute as it runs when a
  stage waits for its input, caches and cores gone cold, plus delays that cost
  no software (the sleep's own lateness, about 0.1 ms, is in it). Not the
  issue's floor: it shows how much of the hop overhead at a delay is this box
  running each stage after an idle wait.
* per-hop software overhead at decode: (wall per token - in-process split
  compute per token - 3 x delay) / 3 hops.
* prefill tok/s of a --prefill-token prompt (512): meshd, 512 / time to first
  token of a session whose prompt is those token ids and which generates one
  token; RPC, llama-bench `pp512`.
* TTFT ms for a short chat prompt: meshd measured at the asker (stream opens
  over the links included); RPC estimated as the prompt's length / llama-bench's
  prefill rate for that length (llama-bench does not stream; the round trips of
  its prompt evaluation are in it, process start and model upload are not).
* CPU µs per token of every process, from /proc/PID/task/*/schedstat: meshd's
  stage daemons and engine workers, the asker (this process) and the three
  proxies, over a decode session (open, short prompt, tokens) per generated
  token. RPC: the rpc-servers, the three proxies and the llama-bench driver
  (its rusage), as the difference between a decode run of --llama-reps + 1
  repetitions and one of 1 repetition, so model upload and setup cancel out.
* throughput: aggregate tok/s of 1, 4, 8, 16 concurrent greedy sessions of
  --agg-tokens tokens over the 3 stages at --agg-delay ms (5), all tokens /
  wall time from the first open to the last token. Next to single-process
  llama.cpp: llama-batched-bench is not in the pinned tools build, so
  llama-bench's `ppN` (one batch of N tokens of one sequence) approximates a
  decode step of N sessions (1 session: `tg`); it leaves out the attention over
  N separate histories.

The box is shared: every figure is one run (--repeats rounds, medians), and the
load average before and after is in the output.

Usage: .venv/bin/python tools/bench_network.py [--delays 0,1,5,20] [--json bench-out/network.json]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio
from benchlib.asks import (
    AGG_PROMPT,
    DECODE_TEXT,
    decode_rate,
    meshd_aggregate,
    meshd_decode,
    meshd_decode_cpu,
    meshd_prefill,
    meshd_ttft,
    prompt_tokens,
)
from benchlib.llama import llama_batched, rpc_layer_devices, run_llama_bench, tensor_split
from benchlib.procs import (
    ROOT,
    TOOLS,
    BenchError,
    Proc,
    carried,
    cpu_ns,
    exited_children_cpu_ns,
    median,
    start_proxy,
    start_rpc_server,
    start_stage,
)
from benchlib.result import parser, publish
from localmesh import stop_all

from meshd.client.route import Stage, route_at
from meshd.engine.chain import LocalChain, even_ranges
from meshd.mesh.models import default_model_path
from meshd.net.peers import Peers, open_peers
from wire.identity import NodeIdentity

HOPS = 3
NAN = float("nan")
# the RPC figures of a run without llama.cpp (--smoke): the tables print nan where they go
NO_RPC = {"decode": NAN, "decode_samples": [], "decode_fa_off": NAN, "prefill": NAN, "ttft": NAN,
          "cpu_us": {"servers": [NAN] * HOPS, "links": [], "driver": NAN}}



# ----- one delay


def rpc_decode(args: argparse.Namespace, model: Path, rpc: list[str], ts: str, watched: list[Proc]) -> dict[str, Any]:
    """llama-bench decode over RPC, and the CPU per token of the servers, proxies and driver.

    Two decode-only runs, of 1 and of llama_reps + 1 repetitions: the CPU
    difference is llama_reps x decode tokens, with upload and setup cancelled.
    """
    spent = []
    runs = []
    for reps in (1, args.llama_reps + 1):
        pids = [pid for p in watched for pid in p.pids]
        before = [cpu_ns(pid) for pid in pids]
        driver = exited_children_cpu_ns()
        r = run_llama_bench(model, args.threads, [0], args.decode, reps, args.poll, rpc, ts)
        spent.append([cpu_ns(pid) - b for pid, b in zip(pids, before, strict=True)] + [exited_children_cpu_ns() - driver])
        runs.append(r)
    tokens = args.llama_reps * args.decode
    per_token = [(b - a) / tokens / 1000 for a, b in zip(spent[0], spent[1], strict=True)]
    # The same decode with llama.cpp's flash attention off, as meshd's engine runs (native/meshengine.cpp: its
    # CPU kernels sum in an order that depends on the batch, and meshd's answers must not): measured here,
    # llama-bench tg64 of the default model, 1 thread, 50.6-51.2 tok/s with it off and 54.4-54.8 on.
    fa_off = run_llama_bench(model, args.threads, [0], args.decode, args.llama_reps, args.poll, rpc, ts,
                             flash_attn=False)
    return {"rate": median(runs[1]["tests"][f"tg{args.decode}"]["samples_ts"]),
            "samples": runs[1]["tests"][f"tg{args.decode}"]["samples_ts"], "cpu_us": per_token,
            "rate_fa_off": median(fa_off["tests"][f"tg{args.decode}"]["samples_ts"])}


async def one_delay(args: argparse.Namespace, model: Path, delay_ms: float | None, stages: list[Proc],
                    servers: list[Proc], chain: LocalChain, decode_ids: list[int], prefill_ids: list[int],
                    n_chat: int, ts: str, logdir: Path, rep: int) -> dict[str, Any]:
    """Every setup at one one-way delay (None: no emulator at all)."""
    d = 0.0 if delay_ms is None else delay_ms / 1000
    stage_links: list[Proc] = []
    rpc_links: list[Proc] = []
    rec: dict[str, Any] = {"delay_ms": delay_ms}
    try:
        if delay_ms is not None:
            stage_links = [start_proxy(s.address, delay_ms, logdir, f"stage{i}-r{rep}") for i, s in enumerate(stages)]
            rpc_links = [start_proxy(s.address, delay_ms, logdir, f"rpc{i}-r{rep}") for i, s in enumerate(servers)]
        stage_addrs = [p.address for p in stage_links] or [s.address for s in stages]
        rpc_addrs = [p.address for p in rpc_links] or [s.address for s in servers]
        async with open_peers(NodeIdentity.generate()) as peers:
            route = route_at(stage_addrs)
            await meshd_decode(peers, route, 8)  # links, KV and caches warm
            order = ["meshd", "rpc", "engine"] if args.llama else ["meshd", "engine"]
            if not args.llama:
                rec["rpc"] = NO_RPC
            order = order[rep % 3:] + order[:rep % 3]
            for name in order:
                if name == "meshd":
                    m = await meshd_decode_cpu(peers, route, stages + stage_links, args.decode)
                    # the whole prompt is one wait for the first token: on a busy box at 20 ms it can pass 30 s
                    p = await meshd_prefill(peers, route, prefill_ids, stall_timeout=args.stall_timeout)
                    t = await meshd_ttft(peers, route)
                    per_token = [ns / 1000 / max(1.0, m["tokens"]) for ns in m["cpu_ns"]]
                    # meshd_decode_cpu lists the watched processes' pids, then the asker
                    cpu = {"stages": per_token[:2 * HOPS], "links": per_token[2 * HOPS:-1], "asker": per_token[-1]}
                    # the same session through the daemons (every row via both daemons): the hop before the fast path
                    slow = await meshd_decode(peers, route, args.decode, fast=False)
                    rec["meshd"] = {"decode": m["rate"], "tokens": m["tokens"], "prefill": p["rate"],
                                    "ttft": t["ttft"], "cpu_us": cpu, "daemons_decode": slow["rate"]}
                elif name == "rpc":
                    r = await trio.to_thread.run_sync(rpc_decode, args, model, rpc_addrs, ts, servers + rpc_links)
                    pre = await trio.to_thread.run_sync(functools.partial(
                        run_llama_bench, model, args.threads, [args.prefill, n_chat], 0, args.llama_reps, args.poll,
                        rpc_addrs, ts))
                    cpu = {"servers": r["cpu_us"][:HOPS], "links": r["cpu_us"][HOPS:-1], "driver": r["cpu_us"][-1]}
                    rec["rpc"] = {"decode": r["rate"], "decode_samples": r["samples"], "decode_fa_off": r["rate_fa_off"],
                                  "prefill": median(pre["tests"][f"pp{args.prefill}"]["samples_ts"]),
                                  "ttft": n_chat / median(pre["tests"][f"pp{n_chat}"]["samples_ts"]), "cpu_us": cpu}
                else:
                    rate = await trio.to_thread.run_sync(decode_rate, chain, decode_ids, args.decode)
                    gapped = await trio.to_thread.run_sync(decode_rate, chain, decode_ids, args.decode, d)
                    rec["engine"] = {"decode": rate, "idle_gap_decode": gapped}
            if delay_ms == args.agg_delay:
                rec["aggregate"] = await aggregate(args, peers, route)
    finally:
        stop_all(stage_links + rpc_links)
    # every hop really crossed its link: each stage's proxy carried the asker's link, the previous stage's and
    # the previous stage's fast-path connections (one per session: the warm-up and the decode, prefill and TTFT
    # sessions), so the rows of the fast path crossed it too
    for i, link in enumerate(stage_links):
        conns = [c for c in carried(link) if c[0] and c[1]]
        if len(conns) < 6:
            raise BenchError(f"the link in front of stage {i} carried {len(conns)} connection(s), not the asker's, "
                             f"the previous stage's and its fast-path ones: a stage dialled around its link "
                             f"({link.log})")
    rec["link_connections"] = {"stages": [len(carried(p)) for p in stage_links],
                               "rpc": [len(carried(p)) for p in rpc_links]}
    compute = 1 / rec["engine"]["decode"]
    wall = 1 / rec["meshd"]["decode"]
    rec["floor"] = {"decode": 1 / (compute + HOPS * d), "compute_ms": compute * 1000,
                    "idle_gap_decode": rec["engine"]["idle_gap_decode"]}
    rec["meshd"]["hop_overhead_ms"] = (wall - compute - HOPS * d) / HOPS * 1000
    rec["meshd"]["daemons_hop_overhead_ms"] = (1 / rec["meshd"]["daemons_decode"] - compute - HOPS * d) / HOPS * 1000
    return rec


async def aggregate(args: argparse.Namespace, peers: Peers, route: list[Stage]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in args.sessions:
        a = await meshd_aggregate(peers, route, n, args.agg_tokens)
        out[str(n)] = a
        print(f"aggregate {n} sessions at {args.agg_delay:g} ms: {a['rate']:.1f} tok/s", file=sys.stderr)
    return out




async def bench(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or default_model_path()
    for tool in ("llama-bench", "ggml-rpc-server") if args.llama else ():
        if not (TOOLS / tool).exists():
            raise BenchError(f"{TOOLS / tool} is missing: run tools/build_native.py --tools first")
    prefill_ids, n_chat, n_layer = prompt_tokens(model, args.prefill)
    split = even_ranges(n_layer, HOPS)
    ts = tensor_split(split, n_layer)
    logdir = Path(tempfile.mkdtemp(prefix="bench-network-"))
    max_sessions = max(args.sessions)
    out: dict[str, Any] = {
        "model": str(model), "threads": args.threads, "poll": args.poll, "decode_tokens": args.decode,
        "prefill_tokens": args.prefill, "chat_prompt_tokens": n_chat, "repeats": args.repeats,
        "split": [list(r) for r in split], "ts": ts, "agg_delay_ms": args.agg_delay, "agg_tokens": args.agg_tokens,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                 "loadavg_before": os.getloadavg()},
        "llama_cpp_commit": (TOOLS.parent / "llama_cpp_commit").read_text().strip()
        if (TOOLS.parent / "llama_cpp_commit").exists() else None,
        "rounds": [],
    }
    procs: list[Proc] = []
    chain: LocalChain | None = None
    try:
        stages = [start_stage(model, r, args.threads, args.poll, logdir, max_sessions, args.session_tokens)
                  for r in split]
        procs += stages
        servers = [start_rpc_server(args.threads, logdir, i) for i in range(HOPS)] if args.llama else []
        procs += servers
        print(f"started {HOPS} meshd stages and {len(servers)} rpc-servers (logs in {logdir})", file=sys.stderr)
        got = want = []
        if args.llama:
            r = await trio.to_thread.run_sync(functools.partial(
                run_llama_bench, model, args.threads, [8], 0, 1, args.poll, [s.address for s in servers], ts, verbose=True))
            got = sorted((min(v), max(v) + 1) for dev, v in rpc_layer_devices(r["log"]).items() if dev.startswith("RPC"))
            want = [tuple(x) for x in split[:-1]] + [(split[-1][0], n_layer + 1)]  # the output layer goes last
        if got != want:
            raise BenchError(f"-ts {ts} put layers {got} on the RPC servers, not {want}")
        chain = LocalChain(model, split, n_ctx=2048, n_threads=args.threads)
        decode_ids = chain.head.tokenize(DECODE_TEXT)
        decode_rate(chain, decode_ids, 8)
        # The direct round goes last, once: a stage reuses a live link to the node it is sent to, so links
        # dialled without an emulator would carry the later rounds around their proxies. A proxy's links
        # end with it, so every emulated round dials afresh.
        rounds: list[tuple[int, float | None]] = [(rep, d) for rep in range(args.repeats) for d in args.delays]
        for i, (rep, delay) in enumerate([*rounds, (0, None)]):
            rec = await one_delay(args, model, delay, stages, servers, chain, decode_ids, prefill_ids, n_chat,
                                  ts, logdir, i)
            rec["round"] = rep
            out["rounds"].append(rec)
            publish("network", args, out)  # what is measured so far survives a later failure
            label = "direct" if delay is None else f"{delay:g} ms"
            print(f"round {rep + 1}/{args.repeats} {label}: meshd {rec['meshd']['decode']:.1f} tok/s "
                  f"(floor {rec['floor']['decode']:.1f}, hop {rec['meshd']['hop_overhead_ms']:.2f} ms), "
                  f"rpc {rec['rpc']['decode']:.1f} tok/s; prefill meshd {rec['meshd']['prefill']:.0f} "
                  f"rpc {rec['rpc']['prefill']:.0f} tok/s", file=sys.stderr)
        out["llama_single"] = {}
        if args.llama:
            batched = await trio.to_thread.run_sync(llama_batched, model, args.threads, args.sessions, AGG_PROMPT,
                                                    args.agg_tokens)
            out["llama_single"] = {n: r["decode"] for n, r in batched["runs"].items()}
    finally:
        stop_all(procs)
        if chain is not None:
            chain.close()
    out["host"]["loadavg_after"] = os.getloadavg()
    out["median"] = medians(out["rounds"])
    return out


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per delay, the median of every figure over the rounds (lists element-wise)."""
    def merge(values: list[Any]) -> Any:
        if isinstance(values[0], dict):
            return {k: merge([v[k] for v in values]) for k in values[0]}
        if isinstance(values[0], list):
            return [merge([v[i] for v in values]) for i in range(len(values[0]))]
        if isinstance(values[0], int | float) and not isinstance(values[0], bool):
            return median([float(v) for v in values])
        return values[0]

    by_delay: dict[str, list[dict[str, Any]]] = {}
    for r in rounds:
        by_delay.setdefault("direct" if r["delay_ms"] is None else f"{r['delay_ms']:g}", []).append(
            {k: v for k, v in r.items() if k not in ("round", "link_connections")})
    return {k: merge(v) for k, v in by_delay.items()}


def table(out: dict[str, Any]) -> str:
    med = out["median"]
    lines = [
        f"model {Path(out['model']).name}, split {'+'.join(f'[{a},{b})' for a, b in out['split'])}, "
        f"{out['threads']} thread(s) per process, {out['host']['cpus']} CPUs (shared), median of {out['repeats']} "
        f"round(s); decode {out['decode_tokens']} tokens, prefill {out['prefill_tokens']} tokens, TTFT for a "
        f"{out['chat_prompt_tokens']}-token chat prompt; one emulated link per stage / rpc-server",
        "",
        "| one-way delay | meshd decode tok/s | floor tok/s | meshd / floor | idle-gap floor tok/s (meshd / it) | "
        "RPC decode tok/s | meshd / RPC | "
        "RPC, flash attention off, tok/s (meshd / it) | hop overhead ms | meshd prefill tok/s | RPC prefill tok/s | "
        "meshd TTFT ms | RPC TTFT ms (est.) | meshd via daemons tok/s (hop ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, m in med.items():
        label = "direct (no emulator)" if key == "direct" else f"{key} ms"
        lines.append(
            f"| {label} | {m['meshd']['decode']:.1f} | {m['floor']['decode']:.1f} | "
            f"{m['meshd']['decode'] / m['floor']['decode']:.2f} | {m['floor']['idle_gap_decode']:.1f} "
            f"({m['meshd']['decode'] / m['floor']['idle_gap_decode']:.2f}) | {m['rpc']['decode']:.1f} | "
            f"{m['meshd']['decode'] / m['rpc']['decode']:.2f} | {m['rpc']['decode_fa_off']:.1f} "
            f"({m['meshd']['decode'] / m['rpc']['decode_fa_off']:.2f}) | {m['meshd']['hop_overhead_ms']:.2f} | "
            f"{m['meshd']['prefill']:.0f} | {m['rpc']['prefill']:.0f} | {m['meshd']['ttft'] * 1000:.1f} | "
            f"{m['rpc']['ttft'] * 1000:.1f} | {m['meshd']['daemons_decode']:.1f} "
            f"({m['meshd']['daemons_hop_overhead_ms']:.2f}) |")
    lines += ["", "In-process split compute per token (the floor's compute): " + ", ".join(
        f"{'direct' if k == 'direct' else k + ' ms'} {m['floor']['compute_ms']:.2f} ms" for k, m in med.items()),
        "", "CPU µs per generated token of every process (all threads). meshd: stage daemon / engine worker, head "
            "first; links are the proxies in front of each stage; asker is this process. RPC: rpc-servers, their "
            "proxies, the llama-bench driver.",
        "", "| one-way delay | meshd stages | meshd links | asker | meshd all | RPC servers | RPC links | driver | RPC all |",
        "|---|---|---|---|---|---|---|---|---|"]
    for key, m in med.items():
        mc, rc = m["meshd"]["cpu_us"], m["rpc"]["cpu_us"]
        stages = " · ".join(f"{mc['stages'][2 * i]:.0f} / {mc['stages'][2 * i + 1]:.0f}" for i in range(HOPS))
        links = " · ".join(f"{x:.0f}" for x in mc["links"]) or "–"
        rlinks = " · ".join(f"{x:.0f}" for x in rc["links"]) or "–"
        m_all = sum(mc["stages"]) + sum(mc["links"]) + mc["asker"]
        r_all = sum(rc["servers"]) + sum(rc["links"]) + rc["driver"]
        lines.append(f"| {'direct' if key == 'direct' else key + ' ms'} | {stages} | {links} | {mc['asker']:.0f} | "
                     f"{m_all:.0f} | {' · '.join(f'{x:.0f}' for x in rc['servers'])} | {rlinks} | {rc['driver']:.0f} | "
                     f"{r_all:.0f} |")
    agg = med.get(f"{out['agg_delay_ms']:g}", {}).get("aggregate")
    if agg:
        single = out["llama_single"]
        lines += ["", f"| concurrent sessions (3 stages, {out['agg_delay_ms']:g} ms) | meshd aggregate tok/s | "
                      f"median per-session tok/s | llama.cpp 1 process tok/s (N sequences in a batch) | meshd / llama.cpp |",
                  "|---|---|---|---|---|"]
        for n, a in agg.items():
            base = single.get(n)
            versus = "– | –" if base is None else f"{base:.1f} | {a['rate'] / base:.2f}"
            lines.append(f"| {n} | {a['rate']:.1f} | {a['per_session']:.1f} | {versus} |")
    lines += ["", f"Load average {out['host']['loadavg_before'][0]:.1f} before, {out['host']['loadavg_after'][0]:.1f} "
                  "after (a shared 2-core box: contention is in every figure, alike for all setups)."]
    return "\n".join(lines)


def numbers(low: float, high: float) -> Any:
    def convert(text: str) -> list[float]:
        try:
            values = [float(x) for x in text.split(",") if x.strip()]
        except ValueError:
            values = []
        if not values or not all(low <= v <= high for v in values):
            raise argparse.ArgumentTypeError(f"give numbers from {low:g} to {high:g}, comma-separated, not '{text}'")
        return values
    return convert


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", type=Path, help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads of every process (default 1)")
    ap.add_argument("--poll", type=int, default=None, help="ggml threadpool busy-poll level for every process")
    ap.add_argument("--delays", type=numbers(0, 1000), default=[0.0, 1.0, 5.0, 20.0], help="one-way delays, ms")
    ap.add_argument("--decode", type=int, default=64, help="tokens generated for the decode figure")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens for the prefill figure")
    ap.add_argument("--sessions", type=lambda t: [int(x) for x in numbers(1, 256)(t)], default=[1, 4, 8, 16],
                    help="concurrent sessions for the throughput figure")
    ap.add_argument("--agg-delay", type=float, default=5.0, help="one-way delay of the throughput figure, ms")
    ap.add_argument("--agg-tokens", type=int, default=64, help="tokens per session in the throughput figure")
    ap.add_argument("--session-tokens", type=int, default=1024, help="KV tokens per session on each stage")
    ap.add_argument("--repeats", type=int, default=1, help="rounds over all delays; medians are reported")
    ap.add_argument("--llama-reps", type=int, default=2, help="llama-bench -r")
    ap.add_argument("--stall-timeout", type=float, default=300.0, help="seconds the asker waits for a token")
    ap.set_defaults(json=ROOT / "bench-out" / "network.json")
    args = ap.parse_args()
    # the smallest run through every part: one short delay, two sessions, a few tokens, no llama.cpp
    args.llama = not args.smoke
    if args.smoke:
        args.delays, args.agg_delay, args.sessions, args.decode, args.prefill = [1.0], 1.0, [1, 2], 8, 16
        args.agg_tokens, args.session_tokens, args.llama_reps = 8, 128, 1
    if args.agg_delay not in args.delays:
        ap.error(f"--agg-delay {args.agg_delay:g} must be one of --delays")
    try:
        out = trio.run(bench, args)
    except BenchError as exc:
        print(f"bench_network: {exc}", file=sys.stderr)
        return 1
    publish("network", args, out, table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
