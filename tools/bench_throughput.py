#!/usr/bin/env python3
"""Throughput: aggregate decode tok/s and time to first token of N concurrent sessions, meshd against llama.cpp.

* meshd: 3 `meshd serve` stages (even layer ranges, --threads compute threads
  each), every stage behind its own tools/link_emulator.py proxy adding
  --delay-ms one way in each direction; the route names the proxies, so every
  hop of the ring (head -> stage 2 -> tail -> head) and the asker's streams
  cross one emulated link (checked from the proxies' logs afterwards). N
  sessions (1, 4, 8, 16) start at once from this process, each with its own
  --prompt-token prompt (token ids, so every prompt is exactly that long) and
  --tokens greedy tokens.
* llama.cpp, one process: `llama-batched-bench` of the same pinned, patched
  tree (`tools/build_native.py --tools`), same model, same threads, the same N
  sequences of the same prompt length and generated length (-npp, -ntg, -npl;
  no shared prompt), each sequence its own KV stream, all N in one decode
  batch per step: the best one machine does with those sessions.

Figures per N:

* aggregate decode tok/s: meshd, the tokens streamed while every session was
  past its first token and none had finished, divided by that window's length
  (steady state, every session in it); llama.cpp, S_TG (N x tokens / the time
  of the generation steps).
* end-to-end tok/s: all tokens / wall time from the first open to the last
  token (meshd); N x (prompt + tokens) / total time (llama.cpp's S, which
  counts the prompt tokens too: the same work, counted its own way).
* TTFT ms: meshd, each session's time to first token at the asker (median and
  max over the N); llama.cpp, T_PP: the N prompts prefilled in one batch, after
  which every sequence has its first token's logits.
* sessions per engine call: from each stage's metrics, the mean number of
  sessions in one engine call during that N's run (how well the stage batches
  concurrent sessions), head first.

The box is shared: every figure is one run, and the load average before and
after is in the output.

Usage: .venv/bin/python tools/bench_throughput.py [--sessions 1,4,8,16] [--delay-ms 5] [--json bench-out/throughput.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from benchlib.asks import prompt_tokens, stage_metrics
from benchlib.llama import llama_batched
from benchlib.procs import ROOT, TOOLS, BenchError, Proc, carried, start_proxy, start_stage
from benchlib.result import parser, publish

from meshd.client.ask import AskRequest, AskResult
from meshd.client.route import Stage, route_at
from meshd.client.session import run_session
from meshd.engine.chain import even_ranges
from meshd.mesh.models import default_model_path
from meshd.net.peers import Peers, open_peers
from wire.identity import NodeIdentity

HOPS = 3


# ----- meshd


def session_prompts(all_ids: list[int], n: int, length: int) -> list[list[int]]:
    """n different prompts of exactly ``length`` ids: windows of one long text at different offsets,
    each starting with the text's first id (BOS where the model has one)."""
    body = all_ids[1:]
    step = max(1, (len(body) - length) // max(1, n))
    return [[all_ids[0], *body[i * step:i * step + length - 1]] for i in range(n)]


def steady_rate(stamps: list[list[float]]) -> tuple[float, float]:
    """Tokens per second while every session was past its first token and none had finished,
    and that window's length (0 when there was none: one session ended before another began)."""
    begin = max(s[0] for s in stamps)
    end = min(s[-1] for s in stamps)
    if end <= begin:
        return 0.0, 0.0
    inside = sum(1 for s in stamps for t in s if begin < t <= end)
    return inside / (end - begin), end - begin


async def meshd_sessions(peers: Peers, route: list[Stage], prompts: list[list[int]], tokens: int,
                         stall_timeout: float) -> dict[str, Any]:
    results = [AskResult(prompt_tokens=list(p)) for p in prompts]
    stamps: list[list[float]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        def on_token(_token: int, _piece: bytes) -> None:
            stamps[i].append(time.perf_counter())

        results[i].started = time.perf_counter()
        # text "": the prompt is the token ids already in the result (every prompt exactly as long)
        await run_session(peers, route, AskRequest(text="", max_tokens=tokens), results[i], on_token=on_token,
                          stall_timeout=stall_timeout)

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    last = max(r.finished_at or t0 for r in results)
    total = sum(len(r.tokens) for r in results)
    steady, window = steady_rate(stamps) if len(prompts) > 1 else (results[0].decode_rate, last - t0)
    ttfts = [r.ttft or 0.0 for r in results]
    return {"sessions": len(prompts), "tokens": total, "decode": steady, "steady_window_s": window,
            "end_to_end": total / (last - t0), "ttft_ms_median": statistics.median(ttfts) * 1000,
            "ttft_ms_max": max(ttfts) * 1000, "per_session_decode": statistics.median(r.decode_rate for r in results),
            "short_sessions": sum(1 for r in results if len(r.tokens) < tokens)}


async def meshd_run(args: argparse.Namespace, model: Path, n_layer: int, all_ids: list[int],
                    logdir: Path) -> dict[str, Any]:
    split = even_ranges(n_layer, HOPS)
    procs: list[Proc] = []
    links: list[Proc] = []
    out: dict[str, Any] = {"split": [list(r) for r in split], "runs": {}}
    try:
        procs = [start_stage(model, r, args.threads, args.poll, logdir, max(args.sessions),
                             args.prompt_tokens + args.tokens + 16) for r in split]
        links = [start_proxy(s.address, args.delay_ms, logdir, f"stage{i}") for i, s in enumerate(procs)]
        print(f"started {HOPS} meshd stages behind {args.delay_ms:g} ms links (logs in {logdir})", file=sys.stderr)
        async with open_peers(NodeIdentity.generate()) as peers:
            route = route_at([p.address for p in links])
            # links, KV and caches warm
            await meshd_sessions(peers, route, session_prompts(all_ids, 2, args.prompt_tokens), 8, args.stall_timeout)
            for n in args.sessions:
                before = [await stage_metrics(peers, s.address) for s in procs]
                rec = await meshd_sessions(peers, route, session_prompts(all_ids, n, args.prompt_tokens),
                                           args.tokens, args.stall_timeout)
                after = [await stage_metrics(peers, s.address) for s in procs]
                rec["sessions_per_call"] = [
                    (a["sessions_per_call"] * a["engine_calls"] - b["sessions_per_call"] * b["engine_calls"])
                    / max(1.0, a["engine_calls"] - b["engine_calls"]) for a, b in zip(after, before, strict=True)]
                rec["engine_calls"] = [a["engine_calls"] - b["engine_calls"] for a, b in zip(after, before, strict=True)]
                out["runs"][str(n)] = rec
                print(f"meshd {n} session(s): {rec['decode']:.1f} tok/s aggregate decode, TTFT median "
                      f"{rec['ttft_ms_median']:.0f} ms, sessions per engine call "
                      f"{' / '.join(f'{x:.1f}' for x in rec['sessions_per_call'])}", file=sys.stderr)
    finally:
        for p in links + procs:
            p.stop()
    for i, link in enumerate(links):
        if len([c for c in carried(link) if c[0] and c[1]]) < 2:
            raise BenchError(f"the link in front of stage {i} did not carry both the asker's and the previous "
                             f"stage's connection: a stage dialled around its link ({link.log})")
    return out


# ----- llama.cpp




# ----- the run


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or default_model_path()
    all_ids, _, n_layer = prompt_tokens(model, 512)
    logdir = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    out: dict[str, Any] = {
        "model": str(model), "threads": args.threads, "delay_ms": args.delay_ms, "prompt_tokens": args.prompt_tokens,
        "tokens": args.tokens, "sessions": args.sessions,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                 "loadavg_before": os.getloadavg()},
        "llama_cpp_commit": (TOOLS.parent / "llama_cpp_commit").read_text().strip()
        if (TOOLS.parent / "llama_cpp_commit").exists() else None,
    }
    # a run without llama.cpp (--smoke) has no baseline: its ratios print nan
    nan = float("nan")
    out["llama"] = {"runs": {str(n): dict.fromkeys(("decode", "end_to_end", "ttft_ms", "prefill"), nan)
                             for n in args.sessions}}
    if args.llama:
        out["llama"] = await trio.to_thread.run_sync(llama_batched, model, args.threads, args.sessions,
                                                     args.prompt_tokens, args.tokens)
    out["meshd"] = await meshd_run(args, model, n_layer, all_ids, logdir)
    out["host"]["loadavg_after"] = os.getloadavg()
    return out


def table(out: dict[str, Any]) -> str:
    lines = [
        f"model {Path(out['model']).name}, meshd 3 stages split "
        f"{'+'.join(f'[{a},{b})' for a, b in out['meshd']['split'])} behind {out['delay_ms']:g} ms one-way links; "
        f"llama.cpp llama-batched-bench in one process; {out['threads']} thread(s) per process, "
        f"{out['host']['cpus']} CPUs (shared); {out['prompt_tokens']}-token prompts, {out['tokens']} tokens per session",
        "",
        "| sessions | meshd decode tok/s | llama.cpp decode tok/s | meshd / llama.cpp | meshd end-to-end tok/s | "
        "llama.cpp end-to-end tok/s (S) | meshd TTFT ms median / max | llama.cpp TTFT ms (T_PP) | "
        "meshd sessions per engine call (head · mid · tail) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in out["sessions"]:
        m, ll = out["meshd"]["runs"][str(n)], out["llama"]["runs"][str(n)]
        lines.append(f"| {n} | {m['decode']:.1f} | {ll['decode']:.1f} | {m['decode'] / ll['decode']:.2f} | "
                     f"{m['end_to_end']:.1f} | {ll['end_to_end']:.1f} | {m['ttft_ms_median']:.0f} / "
                     f"{m['ttft_ms_max']:.0f} | {ll['ttft_ms']:.0f} | "
                     f"{' · '.join(f'{x:.1f}' for x in m['sessions_per_call'])} |")
    short = {n: out["meshd"]["runs"][str(n)]["short_sessions"] for n in out["sessions"]}
    if any(short.values()):
        lines += ["", "Sessions that stopped early (end of generation): "
                  + ", ".join(f"{k} of {n}" for n, k in short.items() if k)]
    lines += ["", f"Load average {out['host']['loadavg_before'][0]:.1f} before, {out['host']['loadavg_after'][0]:.1f} "
                  "after (a shared 2-core box: contention is in every figure)."]
    return "\n".join(lines)


def counts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(1 <= v <= 64 for v in values):
        raise argparse.ArgumentTypeError(f"give session counts from 1 to 64, comma-separated, not '{text}'")
    return values


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", type=Path, help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads of every process (default 1)")
    ap.add_argument("--poll", type=int, default=None, help="ggml threadpool busy-poll level of every stage")
    ap.add_argument("--sessions", type=counts, default=[1, 4, 8, 16], help="concurrent sessions, comma-separated")
    ap.add_argument("--delay-ms", type=float, default=5.0, help="one-way delay on every hop, ms (default 5)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length of every session (default 32)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per session (default 64)")
    ap.add_argument("--stall-timeout", type=float, default=120.0, help="seconds the asker waits for a token")
    ap.set_defaults(json=ROOT / "bench-out" / "throughput.json")
    args = ap.parse_args()
    # the smallest run through every part: two sessions of a few tokens, no llama.cpp
    args.llama = not args.smoke
    if args.smoke:
        args.sessions, args.delay_ms, args.prompt_tokens, args.tokens = [1, 2], 1.0, 8, 8
    if not 0 <= args.delay_ms <= 1000:
        ap.error("--delay-ms is from 0 to 1000")
    if not 2 <= args.prompt_tokens <= 256 or not 2 <= args.tokens <= 1024:
        ap.error("--prompt-tokens is from 2 to 256 and --tokens from 2 to 1024")
    try:
        out = trio.run(bench, args)
    except BenchError as exc:
        print(f"bench_throughput: {exc}", file=sys.stderr)
        return 1
    publish("throughput", args, out, table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
