#!/usr/bin/env python3
"""What splitting costs inside one process: whole model vs. a chain of ranges, same threads.

Decode: greedy tokens/s over --decode steps after a short prompt.
Prefill: tokens/s of a --prefill-token prompt in one pass.
Runs are interleaved (whole, chain, whole, chain, ...) and the median is kept,
so drift on a shared machine hits both sides alike.

After the model, the same for each --also GGUF (e.g. tiny random-weight MoE
models written by tests/gguf_moe.py, widened so the layers, not the per-call
overhead, decide the rate), each split as --also-ranges says.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from benchlib.asks import decode_rate, prefill_rate
from benchlib.result import parser, publish

from meshd.engine.chain import LocalChain, parse_ranges
from meshd.mesh.models import default_model_path


def bench(path: Path, ranges: str, args: argparse.Namespace) -> dict[str, object]:
    """Prints the table of one model; returns its runs and medians."""
    whole = LocalChain(path, None, n_ctx=2048, n_threads=args.threads)
    split = LocalChain(path, parse_ranges(ranges), n_ctx=2048, n_threads=args.threads)
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 200)
    long_prompt = whole.head.tokenize(text)[: args.prefill_tokens]
    short_prompt = whole.head.tokenize(whole.head.apply_chat([{"role": "user", "content": "Tell me a story."}]),
                                       add_special=False)
    results: dict[str, dict[str, list[float]]] = {"whole": {"decode": [], "prefill": []},
                                                  "split": {"decode": [], "prefill": []}}
    decode_rate(whole, short_prompt, 8)
    decode_rate(split, short_prompt, 8)
    for _ in range(args.repeats):
        for name, chain in (("whole", whole), ("split", split)):
            results[name]["decode"].append(decode_rate(chain, short_prompt, args.decode))
            results[name]["prefill"].append(prefill_rate(chain, long_prompt))
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in results.items()}
    print(f"model {path.name}, {args.threads} threads, split {ranges}, median of {args.repeats}")
    print("| metric | whole tok/s | split tok/s | split/whole |")
    print("|---|---|---|---|")
    for k, label in (("decode", f"decode ({args.decode} steps)"), ("prefill", f"prefill ({len(long_prompt)} tokens)")):
        w, s = med["whole"][k], med["split"][k]
        print(f"| {label} | {w:.1f} | {s:.1f} | {s / w:.3f} |")
    whole.close()
    split.close()
    return {"model": str(path), "ranges": ranges, "runs": results, "median": med}


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--ranges", default="0:10,10:20,20:30")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--also", type=Path, nargs="*", default=[], help="more GGUFs to bench, each split by --also-ranges")
    ap.add_argument("--also-ranges", default="0:2,2:4,4:6", help="the split of each --also model")
    args = ap.parse_args()
    if args.smoke:  # the smallest run through every part
        args.decode, args.prefill_tokens, args.repeats, args.threads = 4, 16, 1, 1
    path = args.model or default_model_path()
    reports = [bench(path, args.ranges, args)]
    for other in args.also:
        print()
        reports.append(bench(other, args.also_ranges, args))
    publish("engine", args, {"model": str(path), "models": reports})
    return 0


if __name__ == "__main__":
    sys.exit(main())
