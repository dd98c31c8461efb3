#!/usr/bin/env python3
"""What splitting costs inside one process: whole model vs. a chain of ranges, same threads.

Decode: greedy tokens/s over --decode steps after a short prompt.
Prefill: tokens/s of a --prefill-token prompt in one pass.
Runs are interleaved (whole, chain, whole, chain, ...) and the median is kept,
so drift on a shared machine hits both sides alike.

After the model, the same for tiny random-weight MoE models (--tiny, written
by tests/gguf_moe.py into a temporary directory, widened by --tiny-embd so the
layers, not the per-call overhead, decide the rate), each split in three.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from meshd.engine import Sampler  # noqa: E402
from meshd.engine.chain import LocalChain, parse_ranges  # noqa: E402
from meshd.mesh.models import default_model_path  # noqa: E402


def decode_rate(chain: LocalChain, prompt: list[int], steps: int, gap: float | None = None) -> float:
    """Greedy decode tok/s of the chain. With ``gap``, each range's call is followed by that many seconds
    asleep: the split's compute as it runs when each stage waits a link's delay for its input (caches and
    cores gone cold), with delays that cost no software (tools/bench_network.py's idle-gap floor)."""
    for c in chain.contexts:
        c.clear()
    sampler = Sampler(chain.head)
    logits = chain.forward(prompt, 0)
    pos = len(prompt)
    t0 = time.perf_counter()
    for _ in range(steps):
        token = sampler.sample(logits[-1])
        logits = chain.forward([token], pos, after_stage=None if gap is None else functools.partial(time.sleep, gap))
        pos += 1
    dt = time.perf_counter() - t0
    sampler.close()
    return steps / dt


def prefill_rate(chain: LocalChain, prompt: list[int]) -> float:
    for c in chain.contexts:
        c.clear()
    t0 = time.perf_counter()
    chain.forward(prompt, 0)
    return len(prompt) / (time.perf_counter() - t0)


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


def tiny_models(names: list[str], n_embd: int, root: Path) -> list[Path]:
    from gguf_moe import MOE_SPECS, write_moe_gguf

    unknown = [n for n in names if n not in MOE_SPECS]
    if unknown:
        raise SystemExit(f"bench_engine: unknown tiny model {unknown[0]!r}; known: {', '.join(MOE_SPECS)}")
    # wider residual, experts and context: the shapes stay those of the architecture
    return [write_moe_gguf(root / f"{n}.gguf", dataclasses.replace(
        MOE_SPECS[n], n_embd=n_embd, n_ff=4 * n_embd, n_ff_exp=n_embd, n_ff_shexp=n_embd if MOE_SPECS[n].n_ff_shexp else 0,
        n_ctx=2048)) for n in names]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--ranges", default="0:10,10:20,20:30")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", default="qwen3moe,deepseek2-mla",
                    help="tiny models of tests/gguf_moe.py to bench too, comma-separated; '' for none")
    ap.add_argument("--tiny-embd", type=int, default=512, help="residual width of the tiny models")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    path = args.model or default_model_path()
    reports = [bench(path, args.ranges, args)]
    names = [n for n in args.tiny.split(",") if n]
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        for tiny in tiny_models(names, args.tiny_embd, Path(tmp)):
            print()
            reports.append(bench(tiny, "0:2,2:4,4:6", args))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"model": str(path), "json": str(args.json)},
                                         "models": reports}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
