#!/usr/bin/env python3
"""The default model on the Vulkan build (a GPU, or Mesa's lavapipe on the CPU) against the CPU build:
decode and prefill tokens/s, whole, split and mixed (a CPU stage, then Vulkan stages), and what
the batch-invariant GPU kernels (patch 0015, the engine's default) cost against ggml's own choice
(MESHD_STOCK_KERNELS=1).

Each configuration runs in a process of its own (the library and the kernel switch are chosen per
process), the configurations interleaved over --repeats rounds and the median kept, so drift on a
shared machine hits all alike. Needs `MESHD_VULKAN=1 tools/build_native.py`; on a machine without a
GPU, --vulkan-device 0 names lavapipe. --smoke runs the CPU build's whole model once, and the
Vulkan build's too where --vulkan-device names a device (the test suite's build is the CPU one).

    .venv/bin/python tools/bench_vulkan.py --vulkan-device 0 --decode 8 --prefill-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchlib.result import parser, publish

# name -> (library, kernels, stages' --gpu-layers: one per range, none: the whole model)
CONFIGS: dict[str, tuple[str, str, list[int]]] = {
    "cpu whole": ("cpu", "-", [0]),
    "vulkan whole": ("vulkan", "invariant", [-1]),
    "vulkan whole, stock kernels": ("vulkan", "stock", [-1]),
    "vulkan split": ("vulkan", "invariant", [-1, -1, -1]),
    "mixed (cpu, vulkan, vulkan)": ("vulkan", "invariant", [0, -1, -1]),
}


def measure(model: Path, ranges: str, gpu_layers: list[int], threads: int, decode: int, prefill: int) -> dict[str, Any]:
    from meshd.engine import Sampler
    from meshd.engine.chain import LocalChain, parse_ranges

    chain = LocalChain(model, parse_ranges(ranges) if len(gpu_layers) > 1 else None, n_ctx=1024,
                       n_threads=threads, gpu_layers=gpu_layers)
    try:
        head = chain.head
        prompt = head.tokenize(head.apply_chat([{"role": "user", "content": "Tell me about lighthouses."}]),
                               add_special=False)
        long = (prompt * (prefill // len(prompt) + 1))[:prefill]
        for c in chain.contexts:
            c.clear()
        t = time.perf_counter()
        chain.forward(long, 0)
        prefill_rate = prefill / (time.perf_counter() - t)
        for c in chain.contexts:
            c.clear()
        sampler = Sampler(head)
        logits = chain.forward(prompt, 0)
        t = time.perf_counter()
        for i in range(decode):
            logits = chain.forward([sampler.sample(logits[-1])], len(prompt) + i)
        decode_rate = decode / (time.perf_counter() - t)
        sampler.close()
        return {"decode": decode_rate, "prefill": prefill_rate, "devices": [m.report.device or "cpu" for m in chain.models]}
    finally:
        chain.close()


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    library, kernels, gpu_layers = CONFIGS[name]
    env = dict(os.environ, MESHD_VULKAN="1" if library == "vulkan" else "0")
    if kernels == "stock":
        env["MESHD_STOCK_KERNELS"] = "1"
    else:
        env.pop("MESHD_STOCK_KERNELS", None)
    if args.vulkan_device is not None:
        env["MESHD_VULKAN_DEVICE"] = str(args.vulkan_device)
    cmd = [sys.executable, __file__, "--worker", json.dumps(gpu_layers), "--model", str(args.model),
           "--ranges", args.ranges, "--threads", str(args.threads), "--decode", str(args.decode),
           "--prefill-tokens", str(args.prefill_tokens)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"bench_vulkan: {name} failed: {tail[0]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    from meshd.mesh.models import default_model_path

    ap = parser(__doc__)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--ranges", default="0:10,10:20,20:30", help="the split and mixed chains' ranges")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--prefill-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--vulkan-device", type=int, help="MESHD_VULKAN_DEVICE: 0 for lavapipe where there is no GPU")
    ap.add_argument("--only", action="append", choices=sorted(CONFIGS), help="run only these configurations")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = args.model or default_model_path()
    if args.worker:
        print(json.dumps(measure(args.model, args.ranges, json.loads(args.worker), args.threads, args.decode,
                                 args.prefill_tokens)))
        return 0
    names = args.only or list(CONFIGS)
    if args.smoke:
        # one thread: two of llama.cpp's spin on a busy 2-core box, and a smoke run took 5.6 CPU-s for 10 tokens
        args.repeats, args.decode, args.prefill_tokens, args.threads = 1, 2, 8, 1
        names = ["cpu whole"] + (["vulkan whole"] if args.vulkan_device is not None else [])
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for n in names:
            runs[n].append(run_one(n, args))
    figures = {n: {"decode_tok_s": statistics.median(r["decode"] for r in runs[n]),
                   "prefill_tok_s": statistics.median(r["prefill"] for r in runs[n]), "devices": runs[n][0]["devices"]}
               for n in names}
    table = "\n".join([f"{args.model.name}, {args.threads} threads, decode {args.decode} tokens, prefill "
                        f"{args.prefill_tokens}, median of {args.repeats}"] +
                       [f"  {n:30s} decode {f['decode_tok_s']:7.2f} tok/s  prefill {f['prefill_tok_s']:7.2f} tok/s  "
                        f"({', '.join(f['devices'])})" for n, f in figures.items()])
    publish("bench_vulkan", args, figures, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
