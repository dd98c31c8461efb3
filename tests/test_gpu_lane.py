"""The GPU lane (`-m gpu`, tests/gpu_lane.py), run on every machine through Mesa's lavapipe: the
load names its device, a split on the GPU gives the whole model's logits bit for bit, a CPU stage
chains to a GPU stage, and batch rows equal decode steps on the GPU as on the CPU.

Tiny random-weight models only: lavapipe decodes SmolLM2 at about 1 token/s.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gpu_lane import engine_gpu
from test_batch_invariance import BATCH, assert_identical, batched_and_single, models  # noqa: F401 (a fixture)

from meshd.engine import Model
from meshd.engine.chain import LocalChain

pytestmark = pytest.mark.gpu

STEPS = 24


def teacher_forced(chain: LocalChain, prompt: list[int], forced: list[int]) -> list[np.ndarray]:
    """The last row's logits after the prompt and after each forced token."""
    for c in chain.contexts:
        c.clear()
    seen = [chain.forward(prompt, 0)[-1].copy()]
    for i, t in enumerate(forced):
        seen.append(chain.forward([t], len(prompt) + i)[-1].copy())
    return seen


def tokens(n: int, seed: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(3, 200, n).tolist()


def test_the_load_report_names_the_device(tiny_models: dict[str, Path]) -> None:
    device, _ = engine_gpu()
    with Model(tiny_models["llama-gqa-untied"], n_gpu_layers=-1) as on_gpu, \
            Model(tiny_models["llama-gqa-untied"], n_gpu_layers=0) as on_cpu:
        assert on_gpu.report.device == device and 0 < on_gpu.report.n_bytes_gpu <= on_gpu.report.n_bytes
        assert on_gpu.report.numerics.endswith(f"/{device}")
        # no layer asked for the GPU: none there, and the numerics are the CPU's
        assert on_cpu.report.device == "" and on_cpu.report.n_bytes_gpu == 0
        assert on_cpu.report.numerics.endswith("/cpu")


@pytest.mark.parametrize("name", ["llama-gqa-tied", "llama-gqa-untied", "qwen2-bias", "qwen3-qknorm"])
def test_split_equals_whole_on_the_gpu(tiny_models: dict[str, Path], name: str) -> None:
    prompt, forced = tokens(12), tokens(STEPS, seed=4)
    whole = LocalChain(tiny_models[name], None, n_ctx=256, n_threads=1, gpu_layers=[-1])
    split = LocalChain(tiny_models[name], [(0, 2), (2, 5), (5, 6)], n_ctx=256, n_threads=1, gpu_layers=[-1, -1, -1])
    try:
        assert all(m.report.device for m in whole.models + split.models)
        want, got = teacher_forced(whole, prompt, forced), teacher_forced(split, prompt, forced)
    finally:
        whole.close()
        split.close()
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert np.array_equal(a, b), f"step {step}: split logits differ from whole by up to {np.abs(a - b).max():.3g}"


def test_a_cpu_stage_chains_to_a_gpu_stage(tiny_models: dict[str, Path]) -> None:
    """The CPU stage computes the CPU's bytes in the GPU build (no GPU in its context), the GPU stage
    takes its rows; the answer is the GPU's numerics, close to the CPU's, not equal."""
    path = tiny_models["llama-gqa-tied"]
    prompt, forced = tokens(12), tokens(STEPS, seed=4)
    mixed = LocalChain(path, [(0, 3), (3, 6)], n_ctx=256, n_threads=1, gpu_layers=[0, -1])
    cpu = LocalChain(path, [(0, 3), (3, 6)], n_ctx=256, n_threads=1, gpu_layers=[0, 0])
    try:
        assert [m.report.device == "" for m in mixed.models] == [True, False]
        rows = np.arange(len(prompt), dtype=np.int32)
        seq = np.zeros(len(prompt), dtype=np.int32)
        residual = [c.contexts[0].forward(seq, rows, tokens=prompt) for c in (mixed, cpu)]
        assert np.array_equal(*residual), "a CPU stage of the GPU build computed other bytes than the CPU's"
        got, want = teacher_forced(mixed, prompt, forced), teacher_forced(cpu, prompt, forced)
    finally:
        mixed.close()
        cpu.close()
    gap = max(float(np.abs(a - b).max()) for a, b in zip(got, want, strict=True))
    assert 0 < gap < 0.05, f"the mixed chain's logits are {gap:.3g} from the CPU chain's"


def test_batch_rows_equal_decode_steps_with_no_layer_offloaded(models: dict[str, Path]) -> None:  # noqa: F811
    # A GPU in the context and layers on the CPU: ggml's scheduler would move a batch's ops to the GPU
    # (op_offload); the engine keeps a layer's ops where its weights are.
    assert_identical(*batched_and_single(models["f16"], BATCH, gpu_layers=0))


# With every layer offloaded, ggml-vulkan took matrix-vector kernels for up to 8 rows and the tiled
# matmul above, f16 accumulators for f16 weights in the latter: every row of all 7 cases below differed
# from its decode step on lavapipe with ggml's choice (MESHD_STOCK_KERNELS=1: f16 by up to 0.02, Q6_K's
# random weights by 134). Patch 0015 sends every row of a product by the weights through ggml's
# matrix-vector shaders, full groups of 8 through the 8-column pipeline and the rest through the one-column
# one a decode step runs, which sum a column alike; the engine turns ggml-vulkan's fusions off (with them
# an IQ4_NL batch's rows 9-15 still differed). Rows not a multiple of 8 (13, 11, 70) take both pipelines.
@pytest.mark.parametrize(("kind", "rows"), [("f16", BATCH), ("f32", 16), ("q4_1", 16), ("q4_k", 13), ("q6_k", 16),
                                            ("iq4_nl", 16), ("iq4_xs", 11)])
def test_batch_rows_equal_decode_steps_on_the_gpu(models: dict[str, Path], kind: str, rows: int) -> None:  # noqa: F811
    assert_identical(*batched_and_single(models[kind], rows, gpu_layers=-1))


# The experts' product (MUL_MAT_ID) took its matrix-vector kernel for up to 8 tokens and the tiled one
# above; patch 0015 gives every token count the former, one dispatch a token (with ggml's choice every
# row of 11 differed: qwen3moe by up to 0.022, gpt-oss by 0.51).
@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
def test_moe_batch_rows_equal_decode_steps_on_the_gpu(tmp_path: Path, name: str) -> None:
    from gguf_moe import MOE_SPECS, write_moe_gguf

    path = write_moe_gguf(tmp_path / f"{name}.gguf", MOE_SPECS[name])
    assert_identical(*batched_and_single(path, 11, gpu_layers=-1))


def test_batch_rows_equal_decode_steps_past_512_cells_on_the_gpu(models: dict[str, Path]) -> None:  # noqa: F811
    assert_identical(*batched_and_single(models["f16"], 16, prefix=600, gpu_layers=-1))


# Attention's V*KQ sums over n_kv cells, which the KV cache pads to a multiple of 256 (or the whole cache,
# 1024 here): a batch across a boundary sums over more cells than its first rows' decode steps did (the
# extra ones the mask's zeros), and past 768 over the whole cache, whose V view is contiguous (ggml gives
# that no matrix-vector kernel; patch 0015 gives both mul_mat_vec_nc, which sums those cells after the rest).
@pytest.mark.parametrize("prefix", [250, 760])
def test_batch_rows_equal_decode_steps_across_kv_padding_on_the_gpu(models: dict[str, Path], prefix: int) -> None:  # noqa: F811
    assert_identical(*batched_and_single(models["f16"], 16, prefix=prefix, gpu_layers=-1))
