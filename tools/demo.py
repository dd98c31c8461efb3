#!/usr/bin/env python3
"""Answer one prompt with the default model cut into three layer ranges; print the answer and tokens/s."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshd.engine import EngineError, SamplingParams  # noqa: E402
from meshd.engine.chain import LocalChain, even_ranges  # noqa: E402
from meshd.models import ModelNotFound, default_model_path  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="?", default="What is the capital of France? Answer in one sentence.")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    try:
        path = args.model or default_model_path()
        from meshd.engine import Model
        with Model(path, (0, 1)) as probe:
            n_layer = probe.report.n_layer
        ranges = even_ranges(n_layer, args.stages)
        chain = LocalChain(path, ranges, n_ctx=1024)
        prompt = chain.head.tokenize(chain.head.apply_chat([{"role": "user", "content": args.prompt}]),
                                     add_special=False)
        print(f"model {path.name}: {n_layer} layers as {' + '.join(f'[{a},{b})' for a, b in ranges)}")
        print(f"> {args.prompt}")
        t0 = time.perf_counter()
        pieces, first = [], None
        for token in chain.generate(prompt, args.max_tokens, SamplingParams()):
            first = first or time.perf_counter()
            if chain.head.is_eog(token):
                break
            pieces.append(token)
            sys.stdout.write(chain.head.token_piece(token).decode(errors="replace"))
            sys.stdout.flush()
        t1 = time.perf_counter()
        n = len(pieces)
        rate = (n - 1) / (t1 - first) if first and n > 1 else 0.0
        print(f"\n[{len(prompt)} prompt tokens, {n} new tokens, first token {((first or t1) - t0) * 1000:.0f} ms, "
              f"{rate:.1f} tokens/s decode]")
        chain.close()
    except (EngineError, ModelNotFound, ValueError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
