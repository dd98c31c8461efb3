#!/usr/bin/env python3
"""How far an honest CPU and GPU pair's outputs lie apart, and how far the lies a check must catch do:
the measurements behind wire.sketch's tolerances.

One range (the first half of the model's layers) runs a prompt in one batch and then a decode step a
row, once with no layer offloaded (the CPU's numerics) and once with every layer on the GPU, fed the
same tokens; then the tail range (the second half) fed the CPU's rows, on each. Rows are compared as a
check across numerics compares them (the largest relative error at the replica's 16 largest entries of
a row), and picks by the greedy token's gap below the replica's likeliest, in logit standard
deviations. The lies: a negated row, the row of a changed input token, another position's row, noise
of 10% of a row's norm, and the next token id instead of the greedy pick.

Needs the Vulkan build: on a machine without a GPU, lavapipe (Mesa's Vulkan on the CPU) is the GPU.

    MESHD_VULKAN=1 MESHD_VULKAN_DEVICE=0 .venv/bin/python tools/numerics_gap.py            # the tiny models
    MESHD_VULKAN=1 MESHD_VULKAN_DEVICE=0 .venv/bin/python tools/numerics_gap.py --default  # SmolLM2 (slow there)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT = 12
K = 16


def run_range(path: Path, layers: tuple[int, int], gpu: int, tokens: np.ndarray | None = None,
              hidden: np.ndarray | None = None) -> np.ndarray:
    from meshd.engine import Model
    from meshd.engine.engine import Context

    with Model(path, layers, n_gpu_layers=gpu) as m, Context(m, n_ctx=512, n_batch=512, n_threads=1) as c:
        source = tokens if tokens is not None else hidden
        assert source is not None
        out = []
        for a, b in [(0, PROMPT)] + [(i, i + 1) for i in range(PROMPT, len(source))]:
            want = np.ones(b - a, bool) if m.report.has_output else None
            out.append(np.array(c.forward(np.zeros(b - a, np.int32), np.arange(a, b, dtype=np.int32),
                                          tokens=None if tokens is None else tokens[a:b],
                                          hidden=None if hidden is None else hidden[a:b], want_output=want)))
        return np.concatenate(out).astype(np.float64)


def row_error(route: np.ndarray, replica: np.ndarray) -> np.ndarray:
    """wire.sketch.rows_differ's measure, per row: the largest relative error at the replica's K largest entries."""
    idx = np.argsort(-np.abs(replica), axis=1)[:, :K]
    theirs = np.take_along_axis(replica, idx, 1)
    return np.asarray((np.abs(np.take_along_axis(route, idx, 1) - theirs) / np.abs(theirs)).max(axis=1))


def pick_gap(tokens: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """wire.sketch.tokens_differ's measure: each token's gap below the likeliest, in logit standard deviations."""
    return np.asarray((logits.max(axis=1) - logits[np.arange(len(tokens)), tokens]) / logits.std(axis=1))


def measure(path: Path, steps: int) -> dict[str, float]:
    from meshd.engine import Model

    with Model(path, None) as m:
        n_layer, n_vocab = m.report.n_layer, m.report.n_vocab
    cut = n_layer // 2
    tokens = np.random.default_rng(5).integers(3, n_vocab, PROMPT + steps).astype(np.int32)
    cpu, gpu = (run_range(path, (0, cut), g, tokens=tokens) for g in (0, -1))
    other = tokens.copy()
    other[20] = (other[20] + 7) % n_vocab
    changed = run_range(path, (0, cut), 0, tokens=other)
    noise = np.random.default_rng(1).standard_normal(cpu.shape)
    noise *= 0.1 * np.linalg.norm(cpu, axis=1, keepdims=True) / np.linalg.norm(noise, axis=1, keepdims=True)
    logits_cpu, logits_gpu = (run_range(path, (cut, n_layer), g, hidden=cpu.astype(np.float32)) for g in (0, -1))
    sampled = slice(PROMPT - 1, None)
    greedy = logits_cpu[sampled].argmax(axis=1)
    theirs = logits_gpu[sampled]
    return {
        "rows": len(cpu),
        "honest rows": float(row_error(cpu, gpu).max()),
        "honest rows, relative L2": float((np.linalg.norm(cpu - gpu, axis=1) / np.linalg.norm(gpu, axis=1)).max()),
        "negated row": float(row_error(-cpu, gpu).min()),
        "a changed token's row": float(row_error(changed[20:21], gpu[20:21]).min()),
        "another position's row": float(row_error(np.roll(cpu, 1, 0)[1:], gpu[1:]).min()),
        "noise of 10% of the norm": float(row_error(cpu + noise, gpu).min()),
        "largest entry / median": float((np.abs(gpu).max(axis=1) / np.median(np.abs(gpu), axis=1)).max()),
        "honest logits, in standard deviations": float((np.abs(logits_cpu - logits_gpu).max(axis=1)
                                                        / logits_gpu.std(axis=1)).max()),
        "greedy tokens that differ": int((greedy != theirs.argmax(axis=1)).sum()),
        "honest pick gap": float(pick_gap(greedy, theirs).max()),
        "the next token's gap": float(pick_gap((greedy + 1) % n_vocab, theirs).min()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--default", action="store_true", help="the default model (SmolLM2) instead of the tiny ones")
    ap.add_argument("--steps", type=int, default=48, help="decode steps after the prompt (24 with --default)")
    args = ap.parse_args()
    from meshd.engine.devices import gpus

    if not gpus():
        print("numerics_gap: the engine sees no GPU (MESHD_VULKAN=1 for the Vulkan build, MESHD_VULKAN_DEVICE=0 "
              "for lavapipe)", file=sys.stderr)
        return 2
    if args.default:
        from meshd.mesh.models import default_model_path

        models = {"smollm2": default_model_path()}
        steps = min(args.steps, 24)
    else:
        from gguf_factory import TINY_SPECS, write_tiny_gguf

        root = Path(tempfile.mkdtemp(prefix="numerics-gap-"))
        models = {name: write_tiny_gguf(root / f"{name}.gguf", spec) for name, spec in TINY_SPECS.items()}
        steps = args.steps
    for name, path in models.items():
        print(json.dumps({"model": name, **{k: round(v, 4) for k, v in measure(path, steps).items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
