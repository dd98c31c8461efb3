#!/usr/bin/env python3
"""Write a random-weight GGUF with a 3B-class llama's dimensions, Q4_K_M, as a gguf-split set (issue 29, part 3).

The dimensions are Llama 3.2 3B's (3072 wide, 28 blocks, 24 query heads and 8
KV heads of 128, a feed-forward of 8192, a tied head) with the default model's
tokenizer (SmolLM2's 49,152 tokens, so meshd's tests can prompt it), quantized
as llama-quantize's Q4_K_M lays such a model out: Q4_K for the matrices, Q6_K
for attn_v and ffn_down (llama.cpp gives them more bits) and for the tied
token embedding (the output head), f32 norms. About 1.9 GB in all.

The blocks are random bytes with their scales set small (Q4_K's d and dmin,
Q6_K's d): a real K-quant block layout whose weights are bounded, so
activations stay finite, and whose answers are nonsense but deterministic
(the seed fixes every byte). Written a tensor at a time through the `gguf`
package's split writer (``split_max_tensors``), so the whole model is never in
memory.

With --mix Q5_K_M the matrices are Q5_K in the same layout; with --mix Q6_K, Q3_K or Q2_K every
matrix is that type instead (tools/bench_kquant.py times each).

Usage: .venv/bin/python tools/make_big_gguf.py OUT_DIR [--parts 3] [--layers 28] [--seed 0] [--mix Q4_K_M]
       writes OUT_DIR/llama3b-rand-Q4_K_M-0000i-of-0000N.gguf (one part: OUT_DIR/llama3b-rand-Q4_K_M.gguf)
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf_factory import add_vocab_of, tokenizer_of

from meshd.mesh.models import default_model_path


@dataclass(frozen=True)
class Dims:
    """A llama's shape; the defaults are Llama 3.2 3B's."""

    n_embd: int = 3072
    n_ff: int = 8192
    n_head: int = 24
    n_head_kv: int = 8
    head_dim: int = 128
    n_layers: int = 28


# The same layout at a few MB: a benchmark's smoke run.
SMALL = Dims(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64, n_layers=3)
NAME = "llama3b-rand-Q4_K_M"
Q = gguf.GGMLQuantizationType
# The quantization mixes written, by the type of their matrices. The "_M" ones lay the model out as
# llama-quantize's Q4_K_M and Q5_K_M do: attn_v, ffn_down and the tied head Q6_K (llama.cpp gives them
# more bits); the others make every matrix that one type (tools/bench_kquant.py times each K-quant).
MIX_TYPES = {"Q4_K_M": Q.Q4_K, "Q6_K": Q.Q6_K, "Q5_K_M": Q.Q5_K, "Q3_K": Q.Q3_K, "Q2_K": Q.Q2_K}
MIXES = tuple(MIX_TYPES)
FILE_TYPES = {"Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
              "Q5_K_M": gguf.LlamaFileType.MOSTLY_Q5_K_M, "Q3_K": gguf.LlamaFileType.MOSTLY_Q3_K_S,
              "Q2_K": gguf.LlamaFileType.MOSTLY_Q2_K}
QK = 256
# K-quant super-blocks of 256 weights (ggml-common.h's layouts): the bytes of one, and where its f16
# scale(s) sit with the value written there. A sub-scale (6 bits; Q2_K's 4) times a quant (Q3_K's and
# Q6_K's signed) times d keeps each weight within about +-0.1 to 0.25, and the mins small.
BLOCKS: dict[gguf.GGMLQuantizationType, tuple[int, dict[int, float]]] = {
    Q.Q2_K: (84, {80: 1.0 / 512, 82: 1.0 / 1024}),          # 16 scale/min bytes, 64 of 2-bit quants, d, dmin
    Q.Q3_K: (110, {108: 1.0 / 1024}),                        # 32 high bits, 64 low bits, 12 scale bytes, d
    Q.Q4_K: (144, {0: 1.0 / 4096, 2: 1.0 / 8192}),           # d, dmin, 12 scale bytes, 128 of nibbles
    Q.Q5_K: (176, {0: 1.0 / 8192, 2: 1.0 / 16384}),          # d, dmin, 12 scale bytes, 32 high bits, nibbles
    Q.Q6_K: (210, {208: 1.0 / 8192}),                        # 128 low bits, 64 high bits, 16 int8 scales, d
}


def quant_blocks(rng: np.random.Generator, rows: int, cols: int, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """Random K-quant blocks of a rows x cols matrix, scales set small: uint8 of shape (rows, bytes a row)."""
    blocks = rows * cols // QK
    size, scales = BLOCKS[kind]
    data = rng.integers(0, 256, (blocks, size), dtype=np.uint8)
    if kind == Q.Q6_K:  # its sub-scales are int8: positive ones, as the others' are
        data[:, 192:208] = rng.integers(1, 32, (blocks, 16), dtype=np.int8).view(np.uint8)
    for at, d in scales.items():
        data[:, at:at + 2] = np.array([d], dtype=np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def plan(dims: Dims, n_vocab: int, mix: str = "Q4_K_M") -> list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType]]:
    """Every tensor: name, shape (rows, cols) as ggml counts it (cols fastest), type."""
    f32, main = Q.F32, MIX_TYPES[mix]
    side = Q.Q6_K if mix.endswith("_M") else main
    e, q, kv, ff = dims.n_embd, dims.n_head * dims.head_dim, dims.n_head_kv * dims.head_dim, dims.n_ff
    out: list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType]] = [
        ("token_embd.weight", (n_vocab, e), side), ("output_norm.weight", (e,), f32)]
    for i in range(dims.n_layers):
        b = f"blk.{i}"
        out += [(f"{b}.attn_norm.weight", (e,), f32), (f"{b}.attn_q.weight", (q, e), main),
                (f"{b}.attn_k.weight", (kv, e), main), (f"{b}.attn_v.weight", (kv, e), side),
                (f"{b}.attn_output.weight", (e, q), main), (f"{b}.ffn_norm.weight", (e,), f32),
                (f"{b}.ffn_gate.weight", (ff, e), main), (f"{b}.ffn_up.weight", (ff, e), main),
                (f"{b}.ffn_down.weight", (e, ff), side)]
    return out


def tensor_data(rng: np.random.Generator, shape: tuple[int, ...], kind: gguf.GGMLQuantizationType) -> np.ndarray:
    if kind == Q.F32:
        return (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
    return quant_blocks(rng, shape[0], shape[1], kind)


def write(out_dir: Path, parts: int = 3, dims: Dims = Dims(), seed: int = 0, quiet: bool = False,
          mix: str = "Q4_K_M") -> list[Path]:
    """The set's parts, written to ``out_dir`` (OUT_DIR/NAME-0000i-of-0000N.gguf)."""
    if mix not in MIXES:
        raise ValueError(f"mix {mix!r} is none of {', '.join(MIXES)}")
    model = f"llama3b-rand-{mix}"
    rng = np.random.default_rng(seed)
    tokenizer = tokenizer_of(default_model_path())
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"])
    tensors = plan(dims, n_vocab, mix)
    out_dir.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(out_dir / f"{model}.gguf", "llama", split_max_tensors=-(-len(tensors) // parts))
    w.add_name(model)
    w.add_context_length(8192)
    w.add_embedding_length(dims.n_embd)
    w.add_block_count(dims.n_layers)
    w.add_feed_forward_length(dims.n_ff)
    w.add_head_count(dims.n_head)
    w.add_head_count_kv(dims.n_head_kv)
    w.add_rope_dimension_count(dims.head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_vocab_size(n_vocab)
    w.add_file_type(FILE_TYPES[mix])
    add_vocab_of(w, tokenizer)
    for name, shape, kind in tensors:
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        nbytes = int(np.prod(shape)) // block * block_bytes
        if kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        else:
            # a quant's bytes: rows of blocks (the writer turns the byte shape back into weights)
            w.add_tensor_info(name, (shape[0], shape[1] // block * block_bytes), np.dtype(np.uint8), nbytes,
                              raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    written, started = 0, time.monotonic()
    for name, shape, kind in tensors:
        data = tensor_data(rng, shape, kind)
        w.write_tensor_data(data)
        written += data.nbytes
        if not quiet:
            print(f"\r{written / 2**20:8.0f} MiB  {name:32}", end="", file=sys.stderr, flush=True)
    w.close()
    if not quiet:
        print(f"\r{written / 2**20:8.0f} MiB of tensors in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return list(w.format_shard_names(out_dir / f"{model}.gguf"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--parts", type=int, default=3)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mix", choices=MIXES, default="Q4_K_M")
    args = p.parse_args()
    for path in write(args.out_dir, args.parts, Dims(n_layers=args.layers), args.seed, mix=args.mix):
        print(path, path.stat().st_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
