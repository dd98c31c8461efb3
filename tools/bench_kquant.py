#!/usr/bin/env python3
"""K-quant prefill and decode: meshd's engine against stock llama.cpp, and its kernels before and now.

The models: tools/make_big_gguf.py's random-weight llama at Llama 3.2 3B's width (3072 wide, a
feed-forward of 8192, the default model's 49,152-token vocabulary and head), --layers blocks, as
Q4_K_M and Q5_K_M (Q4_K or Q5_K matrices; Q6_K attn_v, ffn_down and head) and as Q6_K, Q3_K and Q2_K
(every matrix that type).

Each model at each --threads count, in interleaved rounds (the median kept, so drift on a shared
machine hits every column alike):
- llama-bench (tools/build_native.py --tools, the same patched tree) with stock llama.cpp's kernel
  choices (the tiled K-quant matmul from 8 rows, Q4_K weights repacked), with the engine's earlier
  ones (tiled off: vec_dot at every row count; no repacking) and with its batch-invariant ones
  (GGML_CPU_TILED_MM_BATCH_INVARIANT, native/patches/0016; no repacking); flash attention off,
  as the engine runs;
- meshd's engine (LocalChain, one process per run): this checkout's library, and with --before DIR
  the library in DIR too (an earlier build, e.g. ~/.cache/meshd/native/KEY), as MESHD_ENGINE_DIR.
Prefill: tokens/s of a --prefill-tokens prompt in one pass; decode: greedy tokens/s over --decode
steps. Wall figures, with each run's CPU seconds (user+sys) and the load average in the JSON.
A smoke run leaves llama-bench out (CI does not build llama.cpp's tools).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib.procs import TOOLS, BenchError
from benchlib.result import fail, parser, publish
from make_big_gguf import MIXES, SMALL, Dims, write

# llama-bench's configurations: (name, environment, --repack)
LLAMA_CONFIGS = [("stock", {}, 1), ("tiled off", {"GGML_CPU_TILED_MM": "0"}, 0),
                 ("invariant", {"GGML_CPU_TILED_MM_BATCH_INVARIANT": "1"}, 0)]


def llama_bench(model: Path, threads: int, env: dict[str, str], repack: int, prompt: int, decode: int) -> dict[str, float]:
    """One run of llama-bench: prefill and decode tok/s, and the run's CPU seconds."""
    cmd = [str(TOOLS / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", str(prompt), "-n", str(decode),
           "-r", "1", "-fa", "0", "-ngl", "0", "--repack", str(repack), "-o", "json"]
    before = os.times()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    after = os.times()
    if done.returncode != 0:
        raise BenchError(f"llama-bench failed ({' '.join(cmd)}): {done.stderr.strip()[-300:]}")
    rates = {("prefill" if t["n_gen"] == 0 else "decode"): float(t["avg_ts"]) for t in json.loads(done.stdout)}
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return {**rates, "cpu_s": cpu}


def engine_run(model: Path, threads: int, prompt: int, decode: int, engine_dir: Path | None) -> dict[str, float]:
    """One run of meshd's engine in a process of its own (with engine_dir, that library)."""
    env = dict(os.environ)
    if engine_dir is not None:
        env["MESHD_ENGINE_DIR"] = str(engine_dir)
    cmd = [sys.executable, __file__, "--engine-run", str(model), "--threads", str(threads),
           "--prefill-tokens", str(prompt), "--decode", str(decode)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parent.parent)
    if done.returncode != 0:
        raise BenchError(f"the engine run failed: {done.stderr.strip()[-300:]}")
    figures: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return figures


def measure_engine(model: Path, threads: int, prompt: int, decode: int) -> dict[str, float]:
    """In this process: the engine's prefill and decode tok/s, and the CPU seconds of each."""
    from benchlib.asks import decode_rate, prefill_rate

    from meshd.engine.chain import LocalChain

    chain = LocalChain(model, None, n_ctx=2048, n_threads=threads)
    try:
        text = " ".join(["The quick brown fox jumps over the lazy dog."] * 200)
        tokens = chain.head.tokenize(text)[:prompt]
        decode_rate(chain, tokens[:8], 2)  # warm: weights paged in
        cpu0 = time.process_time()
        prefill = prefill_rate(chain, tokens)
        cpu1 = time.process_time()
        dec = decode_rate(chain, tokens[:8], decode)
        cpu2 = time.process_time()
    finally:
        chain.close()
    return {"prefill": prefill, "decode": dec, "prefill_cpu_s": cpu1 - cpu0, "decode_cpu_s": cpu2 - cpu1}


def load() -> float:
    return os.getloadavg()[0]


def bench_one(model: Path, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    columns: list[str] = ([] if args.smoke else [name for name, _, _ in LLAMA_CONFIGS])
    columns += (["engine before"] if args.before else []) + ["engine now"]
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in columns}
    loads = [load()]
    for _ in range(args.repeats):
        for name, env, repack in ([] if args.smoke else LLAMA_CONFIGS):
            runs[name].append(llama_bench(model, threads, env, repack, args.prefill_tokens, args.decode))
        if args.before:
            runs["engine before"].append(engine_run(model, threads, args.prefill_tokens, args.decode, args.before))
        runs["engine now"].append(engine_run(model, threads, args.prefill_tokens, args.decode, None))
        loads.append(load())
    median = {c: {k: statistics.median(r[k] for r in rs) for k in ("prefill", "decode")} for c, rs in runs.items()}
    return {"model": str(model), "threads": threads, "runs": runs, "median": median, "load": loads}


def table(reports: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"K-quant prefill ({args.prefill_tokens} tokens) and decode ({args.decode} steps) tok/s, "
             f"median of {args.repeats}; llama-bench: stock = tiled from 8 rows + repacked Q4_K, "
             "tiled off = the engine before, invariant = GGML_CPU_TILED_MM_BATCH_INVARIANT (no repacking)"]
    for metric in ("prefill", "decode"):
        columns = list(reports[0]["median"])
        lines += ["", f"| {metric} | threads | " + " | ".join(columns) + " | now/stock | load |",
                  "|---|---|" + "---|" * len(columns) + "---|---|"]
        for r in reports:
            med = r["median"]
            ratio = f"{med['engine now'][metric] / med['stock'][metric]:.2f}" if "stock" in med else "-"
            lines.append(f"| {Path(r['model']).stem} | {r['threads']} | "
                         + " | ".join(f"{med[c][metric]:.1f}" for c in columns)
                         + f" | {ratio} | {min(r['load']):.1f}-{max(r['load']):.1f} |")
    return "\n".join(lines)


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mixes", nargs="+", choices=MIXES, default=list(MIXES))
    ap.add_argument("--before", type=Path, help="an earlier engine build's directory (libmeshengine.so, meshengine.h)")
    ap.add_argument("--models", type=Path, help="where the models are written (kept); a temporary directory if unset")
    ap.add_argument("--engine-run", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine_run:
        print(json.dumps(measure_engine(args.engine_run, args.threads[0], args.prefill_tokens, args.decode)))
        return 0
    if args.smoke:  # the smallest run through every part
        args.threads, args.prefill_tokens, args.decode, args.repeats, args.layers = [1], 16, 4, 1, 1
    if not args.smoke and not (TOOLS / "llama-bench").exists():
        return fail("kquant", f"{TOOLS / 'llama-bench'} is missing: run tools/build_native.py --tools first")
    if args.before and not (args.before / "libmeshengine.so").exists():
        return fail("kquant", f"{args.before} holds no libmeshengine.so")
    dims = SMALL if args.smoke else Dims(n_layers=args.layers)
    with tempfile.TemporaryDirectory(prefix="bench-kquant-") as tmp:
        # a kept model is reused by its mix and its shape
        where = (args.models or Path(tmp)) / f"{dims.n_embd}x{dims.n_layers}"
        try:
            models = [(write(where, 1, dims, quiet=True, mix=mix) if not (where / f"llama3b-rand-{mix}.gguf").exists()
                       else [where / f"llama3b-rand-{mix}.gguf"])[0] for mix in args.mixes]
            reports = [bench_one(m, t, args) for m in models for t in args.threads]
        except BenchError as exc:
            return fail("kquant", str(exc))
    publish("kquant", args, {"reports": reports}, table(reports, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
