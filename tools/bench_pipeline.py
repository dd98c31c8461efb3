#!/usr/bin/env python3
"""meshd's pipeline against llama.cpp, in one run: decode, prefill, first token, memory, concurrency.

Needs llama.cpp's own programs from the same pinned, patched source and the
same ggml options as meshd's engine: `tools/build_native.py --tools` puts
`llama-bench` and `ggml-rpc-server` in build/native-tools/bin/.

Setups, all on this machine over loopback, all with --threads compute threads
per process (default 1, because the box has 2 cores and a pipeline of 3 stages
already runs 3 engine processes; pass --threads 2 to compare at 2):

* llama.cpp, one process: `llama-bench` on the whole model.
* llama.cpp RPC backend: `llama-bench --rpc` driving 2 or 3 `ggml-rpc-server`
  processes, every layer offloaded (-ngl 99) and split by -ts so that server i
  holds exactly the layers meshd stage i holds ([0,15)+[15,30) and
  [0,10)+[10,20)+[20,30) for the 30-layer default model; the output head goes
  with the last range, the token embedding stays in the driving process as
  llama.cpp always does). The split is checked from llama.cpp's own log.
* meshd with 1, 2 and 3 `meshd serve` stages on loopback (even layer ranges),
  driven by this process through meshd.client.session.run_session, as `meshd ask` does.

Figures (medians over --repeats rounds; in each round every setup runs once,
in rotating order, so drift on a shared machine hits all alike):

* decode tok/s: greedy generation of --decode tokens. llama.cpp: llama-bench
  `tg` (tokens / time of the single-token decode calls). meshd: (tokens - 1) /
  (time from the first streamed token to the last), as seen by the asker, i.e.
  the steady token interval of the ring, every hop and process boundary
  included. A raw-text prompt is used so that generation runs its full length.
* prefill tok/s: a --prefill-token prompt (512). llama.cpp: llama-bench `pp512`.
  meshd: 512 / time to first token of a session whose prompt is those 512
  token ids and which generates 1 token (open, chunked pipelined prefill across
  the stages, sampling, streaming back: everything the asker waits for).
* TTFT ms: time to first token of a short chat prompt (the chat template
  applied). meshd: measured at the asker, stream opens included. llama.cpp:
  estimated as the prompt's length / llama-bench's prefill rate for a prompt of
  that length (llama-bench does not stream), so it leaves out process start and
  model load, which meshd's figure also leaves out.
* RSS MiB: resident memory. meshd: per stage, daemon + engine worker VmRSS at
  the end of the run (peak VmHWM alongside in the JSON). llama.cpp single:
  peak RSS of the llama-bench process (its VmHWM, sampled every 50 ms). RPC:
  peak VmHWM of each rpc-server (they free their buffers when the client
  leaves), driving process aside.
* meshd's engine in one process: the same greedy decode through meshd's own
  engine binding, every range's context in this process, called one after the
  other: the compute of a split without IPC, wire or a second process, i.e.
  the floor under what the stages can reach.
* where a decoded token's time goes: CPU time of every stage daemon, engine
  worker and of the asker (this process) over each meshd decode session, per
  generated token, from /proc/PID/task/*/schedstat.
* aggregate tok/s: N concurrent greedy sessions of --agg-tokens tokens through
  the 3-stage pipeline; all tokens generated / wall time from the first open to
  the last token. The ratio column divides by single-process llama.cpp decode.

Ratios are against single-process llama.cpp from the same run. Goal from the
design: 3 stages decode at >= 0.85x single-process llama.cpp and faster than
the RPC backend on the same split.

Usage: .venv/bin/python tools/bench_pipeline.py [--threads 1] [--repeats 3] [--json bench-out/pipeline.json]
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
    DECODE_TEXT,
    decode_rate,
    meshd_aggregate,
    meshd_decode,
    meshd_decode_cpu,
    meshd_prefill,
    meshd_ttft,
    prompt_tokens,
    route_of,
    stage_metrics,
)
from benchlib.llama import rpc_layer_devices, run_llama_bench, tensor_split
from benchlib.procs import TOOLS, BenchError, Proc, median, proc_status, start_rpc_server, start_stage
from benchlib.result import parser, publish

from meshd.engine.chain import LocalChain, even_ranges
from meshd.mesh.models import default_model_path
from meshd.net.peers import open_peers
from wire.identity import NodeIdentity

# ----- processes














# ----- llama.cpp








# ----- meshd
















# ----- the run


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or default_model_path()
    for tool in ("llama-bench", "ggml-rpc-server") if args.llama else ():
        if not (TOOLS / tool).exists():
            raise BenchError(f"{TOOLS / tool} is missing: run tools/build_native.py --tools first")
    prefill_ids, n_chat, n_layer = prompt_tokens(model, args.prefill)
    logdir = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    stage_counts = [int(x) for x in args.stages.split(",")]
    rpc_counts = [k for k in stage_counts if k > 1] if args.llama else []
    sessions = [int(x) for x in args.sessions.split(",")]
    splits = {k: even_ranges(n_layer, k) for k in stage_counts}
    procs: list[Proc] = []
    chains: dict[int, LocalChain] = {}
    out: dict[str, Any] = {
        "model": str(model), "threads": args.threads, "poll": args.poll, "decode_tokens": args.decode,
        "prefill_tokens": args.prefill, "chat_prompt_tokens": n_chat, "repeats": args.repeats,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                 "loadavg_before": os.getloadavg()},
        "kv": {"max_sessions": max(sessions), "session_tokens": args.session_tokens},
        "llama_cpp_commit": (TOOLS.parent / "llama_cpp_commit").read_text().strip()
        if (TOOLS.parent / "llama_cpp_commit").exists() else None,
        "splits": {str(k): [list(r) for r in v] for k, v in splits.items()},
        "runs": {}, "rss": {}, "aggregate": {}, "decode_cpu": {},
    }
    runs: dict[str, dict[str, list[float]]] = out["runs"]
    try:
        stages: dict[int, list[Proc]] = {}
        for k in stage_counts:
            stages[k] = [start_stage(model, r, args.threads, args.poll, logdir, max(sessions), args.session_tokens)
                         for r in splits[k]]
            procs += stages[k]
        servers = [start_rpc_server(args.threads, logdir, i) for i in range(max(rpc_counts, default=0))]
        procs += servers
        print(f"started {sum(len(v) for v in stages.values())} meshd stages and {len(servers)} rpc-servers "
              f"(logs in {logdir})", file=sys.stderr)

        # the RPC split really is meshd's split: ask llama.cpp where it put each layer
        out["rpc_layout"] = {}
        for k in rpc_counts:
            ts = tensor_split(splits[k], n_layer)
            r = await trio.to_thread.run_sync(functools.partial(
                run_llama_bench, model, args.threads, [8], 0, 1, args.poll, [s.address for s in servers[:k]], ts,
                verbose=True))
            layout = rpc_layer_devices(r["log"])
            got = sorted((min(v), max(v) + 1) for d, v in layout.items() if d.startswith("RPC"))
            want = [(a, b) for a, b in splits[k]]
            want[-1] = (want[-1][0], n_layer + 1)  # the output layer goes with the last range
            out["rpc_layout"][str(k)] = {"ts": ts, "devices": layout}
            if got != want:
                raise BenchError(f"-ts {ts} put layers {got} on the RPC servers, not {want}")
            print(f"rpc split over {k} servers (-ts {ts}): {got} (index {n_layer} = output)", file=sys.stderr)

        chains = {k: LocalChain(model, splits[k], n_ctx=2048, n_threads=args.threads) for k in stage_counts}
        decode_ids = chains[stage_counts[0]].head.tokenize(DECODE_TEXT)
        for chain in chains.values():
            decode_rate(chain, decode_ids, 8)
        async with open_peers(NodeIdentity.generate()) as peers:
            routes = {k: await route_of(peers, stages[k]) for k in stage_counts}
            for k in stage_counts:  # warm links, KV and caches
                await meshd_decode(peers, routes[k], 8)

            items: list[tuple[str, int | None]] = [("llama.cpp", None)] if args.llama else []
            items += [(f"rpc{k}", k) for k in rpc_counts]
            items += [(f"meshd{k}", k) for k in stage_counts]
            items += [(f"engine{k}", k) for k in stage_counts]
            for rep in range(args.repeats):
                order = items[rep % len(items):] + items[:rep % len(items)]
                for name, k in order:
                    runs.setdefault(name, {})
                    rec = runs[name]
                    if name == "llama.cpp" or name.startswith("rpc"):
                        rpc = [s.address for s in servers[:k]] if k else None
                        ts = tensor_split(splits[k], n_layer) if k else None
                        r = await trio.to_thread.run_sync(
                            run_llama_bench, model, args.threads, [args.prefill, n_chat], args.decode,
                            args.llama_reps, args.poll, rpc, ts)
                        rec.setdefault("decode", []).extend(r["tests"][f"tg{args.decode}"]["samples_ts"])
                        rec.setdefault("prefill", []).extend(r["tests"][f"pp{args.prefill}"]["samples_ts"])
                        rec.setdefault("ttft", []).extend(n_chat / x for x in r["tests"][f"pp{n_chat}"]["samples_ts"])
                        rec.setdefault("maxrss_kib", []).append(r["maxrss_kib"])
                    elif name.startswith("engine"):
                        chain = chains[k]
                        rate = await trio.to_thread.run_sync(decode_rate, chain, decode_ids, args.decode)
                        rec.setdefault("decode", []).append(rate)
                        print(f"round {rep + 1}/{args.repeats} {name}: decode {rate:.1f} tok/s", file=sys.stderr)
                        continue
                    else:
                        route = routes[k]
                        d = await meshd_decode_cpu(peers, route, stages[k], args.decode)
                        rec.setdefault("decode", []).append(d["rate"])
                        rec.setdefault("decode_tokens", []).append(d["tokens"])
                        out["decode_cpu"].setdefault(str(k), []).append(d["cpu_ns"])
                        p = await meshd_prefill(peers, route, prefill_ids)
                        rec.setdefault("prefill", []).append(p["rate"])
                        t = await meshd_ttft(peers, route)
                        rec.setdefault("ttft", []).append(t["ttft"])
                    print(f"round {rep + 1}/{args.repeats} {name}: decode {rec['decode'][-1]:.1f} tok/s, "
                          f"prefill {rec['prefill'][-1]:.1f} tok/s, ttft {rec['ttft'][-1] * 1000:.1f} ms",
                          file=sys.stderr)

            k_agg = max(stage_counts)
            for rep in range(args.repeats):
                for n in sessions:
                    a = await meshd_aggregate(peers, routes[k_agg], n, args.agg_tokens)
                    agg = out["aggregate"].setdefault(str(n), {"rate": [], "per_session": [], "tokens": []})
                    for key in agg:
                        agg[key].append(a[key])
                    print(f"round {rep + 1}/{args.repeats} aggregate {n} sessions on {k_agg} stages: "
                          f"{a['rate']:.1f} tok/s ({a['tokens']:.0f} tokens)", file=sys.stderr)
            out["stage_metrics"] = {str(k): [await stage_metrics(peers, s.address) for s in stages[k]]
                                    for k in stage_counts}

        for k in stage_counts:
            per = []
            for s in stages[k]:
                st = [proc_status(pid) for pid in s.pids]
                per.append({"layers": None, "rss_kib": sum(x["VmRSS"] for x in st),
                            "hwm_kib": sum(x["VmHWM"] for x in st),
                            "daemon_rss_kib": st[0]["VmRSS"], "worker_rss_kib": st[1]["VmRSS"]})
            for p, r in zip(per, splits[k], strict=False):
                p["layers"] = list(r)
            out["rss"][f"meshd{k}"] = per
        out["rss"]["rpc_servers"] = [{"hwm_kib": proc_status(s.pids[0])["VmHWM"],
                                      "rss_kib": proc_status(s.pids[0])["VmRSS"]} for s in servers]
    finally:
        for p in procs:
            p.stop()
        for chain in chains.values():
            chain.close()
    out["host"]["loadavg_after"] = os.getloadavg()
    out["median"] = {name: {key: median(v) for key, v in rec.items()} for name, rec in runs.items()}
    out["aggregate_median"] = {n: {key: median(v) for key, v in a.items()} for n, a in out["aggregate"].items()}
    return out


def mib(kib: float) -> str:
    return f"{kib / 1024:.0f}"


def table(out: dict[str, Any]) -> str:
    med = out["median"]
    # a run without llama.cpp (--smoke) has no baseline: its ratios print nan
    base = med.get("llama.cpp") or dict.fromkeys(("decode", "prefill", "maxrss_kib"), float("nan"))
    lines = [
        f"model {Path(out['model']).name}, {out['threads']} thread(s) per process, "
        f"poll {out['poll'] if out['poll'] is not None else 'default (llama-bench 50, meshd 0)'}, "
        f"{out['host']['cpus']} CPUs, "
        f"median of {out['repeats']} rounds; decode {out['decode_tokens']} tokens, prefill {out['prefill_tokens']} "
        f"tokens, TTFT for a {out['chat_prompt_tokens']}-token chat prompt",
        "",
        "| setup | decode tok/s (range) | × llama.cpp | prefill tok/s | × llama.cpp | TTFT ms | RSS MiB per stage |",
        "|---|---|---|---|---|---|---|",
    ]

    def row(label: str, name: str, rss: str, ttft_note: str = "") -> None:
        m = med.get(name)
        if not m:
            return
        d = out["runs"][name]["decode"]
        lines.append(f"| {label} | {m['decode']:.1f} ({min(d):.0f}–{max(d):.0f}) | {m['decode'] / base['decode']:.2f} | "
                     f"{m['prefill']:.1f} | "
                     f"{m['prefill'] / base['prefill']:.2f} | {m['ttft'] * 1000:.1f}{ttft_note} | {rss} |")

    row("llama.cpp, 1 process", "llama.cpp", f"{mib(base['maxrss_kib'])} (peak)", " (est.)")
    servers = out["rss"].get("rpc_servers", [])
    for k in sorted(int(n[3:]) for n in med if n.startswith("rpc")):
        rss = " / ".join(mib(s["hwm_kib"]) for s in servers[:k]) + " (peak) + driver " + \
            mib(med[f"rpc{k}"]["maxrss_kib"])
        splits = "+".join(f"[{a},{b})" for a, b in out["splits"][str(k)])
        row(f"llama.cpp RPC, {k} servers {splits}", f"rpc{k}", rss, " (est.)")
    for k in sorted(int(n[5:]) for n in med if n.startswith("meshd")):
        rss = " / ".join(mib(s["rss_kib"]) for s in out["rss"][f"meshd{k}"])
        splits = "+".join(f"[{a},{b})" for a, b in out["splits"][str(k)])
        row(f"meshd, {k} stage{'s' if k > 1 else ''} {splits}", f"meshd{k}", rss)
    for k in sorted(int(n[6:]) for n in med if n.startswith("engine")):
        m = med[f"engine{k}"]
        d = out["runs"][f"engine{k}"]["decode"]
        lines.append(f"| meshd's engine, {k} range{'s' if k > 1 else ''} in one process (no IPC, no wire) | "
                     f"{m['decode']:.1f} ({min(d):.0f}–{max(d):.0f}) | {m['decode'] / base['decode']:.2f} | – | – | – | – |")
    lines += ["", "Where a decoded token's time goes: CPU ms of each meshd process (all threads) over a whole decode "
                  "session (open, prompt, tokens) per generated token, median over rounds; wall: ms between "
                  "streamed tokens",
              "", "| stages | " + "stage daemon / engine worker, head first | asker | all | wall |", "|---|---|---|---|---|"]
    for k, samples in sorted(out["decode_cpu"].items(), key=lambda kv: int(kv[0])):
        tokens = out["runs"][f"meshd{k}"]["decode_tokens"]
        per = [median([s[i] / 1e6 / max(1.0, t) for s, t in zip(samples, tokens, strict=False)]) for i in range(len(samples[0]))]
        pairs = " · ".join(f"{per[2 * i]:.2f} / {per[2 * i + 1]:.2f}" for i in range(int(k)))
        lines.append(f"| {k} | {pairs} | {per[-1]:.2f} | {sum(per):.2f} | {1000 / med[f'meshd{k}']['decode']:.2f} |")
    lines += ["", f"| concurrent sessions ({max(int(k) for k in out['splits'])} stages) | aggregate tok/s | "
                  f"× llama.cpp decode | median per-session tok/s |", "|---|---|---|---|"]
    for n, a in sorted(out["aggregate_median"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {n} | {a['rate']:.1f} | {a['rate'] / base['decode']:.2f} | {a['per_session']:.1f} |")
    lines += ["", f"meshd stages hold KV for {out['kv']['max_sessions']} sessions x {out['kv']['session_tokens']} tokens "
                  f"(daemon + engine worker); llama-bench sizes its KV for one prompt. Load average "
                  f"{out['host']['loadavg_before'][0]:.1f} before, {out['host']['loadavg_after'][0]:.1f} after."]
    k = max(int(k) for k in out["splits"])
    m3 = med.get(f"meshd{k}")
    r3 = med.get(f"rpc{k}")
    if m3:
        goal = f"\n{k}-stage decode: {m3['decode'] / base['decode']:.2f}× single-process llama.cpp (goal ≥ 0.85)"
        if r3:
            goal += f", {m3['decode'] / r3['decode']:.2f}× llama.cpp RPC over {k} servers (goal > 1)"
        lines.append(goal)
    return "\n".join(lines)


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", type=Path, help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads of every process (default 1)")
    ap.add_argument("--poll", type=int, default=None,
                    help="ggml threadpool busy-poll level 0..100 for every process (default: ggml's, 50)")
    ap.add_argument("--stages", default="1,2,3", help="meshd pipeline lengths (RPC runs for those > 1)")
    ap.add_argument("--decode", type=int, default=128, help="tokens generated for the decode figure")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens for the prefill figure")
    ap.add_argument("--sessions", default="1,4,8", help="concurrent sessions for the aggregate figure")
    ap.add_argument("--agg-tokens", type=int, default=64, help="tokens per session in the aggregate figure")
    ap.add_argument("--session-tokens", type=int, default=1024, help="KV tokens per session on each stage")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported")
    ap.add_argument("--llama-reps", type=int, default=2, help="llama-bench -r within each round")
    args = ap.parse_args()
    # the smallest run through every part: two stages, two sessions, a few tokens, no llama.cpp
    args.llama = not args.smoke
    if args.smoke:
        args.stages, args.decode, args.prefill, args.sessions, args.agg_tokens = "2", 8, 16, "1,2", 8
        args.session_tokens, args.repeats = 128, 1
    try:
        out = trio.run(bench, args)
    except BenchError as exc:
        print(f"bench_pipeline: {exc}", file=sys.stderr)
        return 1
    publish("pipeline", args, out, table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
