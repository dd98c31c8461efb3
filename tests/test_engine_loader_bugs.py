"""Loader bugs of partial ranges, each on a tiny GGUF that takes the failing path.

Per-tensor `.scale` tensors (NVFP4/FP8-style) and a fused `attn_qkv` with its bias
are asked for by llama.cpp only once their main tensor loaded, which it never does
outside the owned range: every partial load of such a file failed with "wrong
number of tensors". Each file now splits into three stages that give exactly the
whole model's logits, and each stage's report counts exactly its own tensors.
An architecture without range support is refused at load, by name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_factory import TINY_SPECS, UNSUPPORTED_SPEC, owned_tensors, write_tiny_gguf
from gguf_variants import with_fused_qkv, with_scales, write_variant
from localmesh import run_meshd
from parity import assert_same_logits

from meshd.engine import Model, Sampler, UnsupportedModel
from meshd.engine.chain import LocalChain

VARIANTS: dict[str, Callable[[Path, Path], Path]] = {"scales": with_scales, "fused-qkv": with_fused_qkv}
# a cut right after the head and right before the tail, and one through the middle
CHAINS = [[(0, 1), (1, 5), (5, 6)], [(0, 2), (2, 4), (4, 6)]]
DECODE_STEPS = 16


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # f16 projections, tied head: the fused tensor is a concatenation of f16 rows
    return write_variant(tmp_path_factory.mktemp(request.param), TINY_SPECS["llama-gqa-tied"], VARIANTS[request.param])


def greedy_logits(path: Path, ranges: list[tuple[int, int]] | None, prompt: list[int]) -> list[np.ndarray]:
    chain = LocalChain(path, ranges, n_ctx=64, n_threads=1)
    sampler = Sampler(chain.head)
    try:
        logits = [chain.forward(prompt, 0)[-1].copy()]
        for step in range(DECODE_STEPS):
            token = sampler.sample(logits[-1])
            logits.append(chain.forward([token], len(prompt) + step)[-1].copy())
        return logits
    finally:
        sampler.close()
        chain.close()


@pytest.mark.parametrize("ranges", CHAINS, ids=["thin-ends", "thirds"])
def test_partial_loads_split_the_variant_exactly(variant: Path, ranges: list[tuple[int, int]]) -> None:
    prompt = np.random.default_rng(7).integers(0, 200, size=11).tolist()
    whole = greedy_logits(variant, None, prompt)
    split = greedy_logits(variant, ranges, prompt)
    for step, (want, got) in enumerate(zip(whole, split, strict=True)):
        assert_same_logits(want, got, f"step {step}")


@pytest.mark.parametrize("layers", [(0, 1), (1, 5), (2, 4), (5, 6)])
def test_each_stage_loads_exactly_its_own_tensors(variant: Path, layers: tuple[int, int]) -> None:
    reader = gguf.GGUFReader(variant)
    own = owned_tensors(reader, layers)
    with Model(variant, layers) as m:
        assert (m.report.n_tensors, m.report.n_bytes) == (len(own), sum(own.values()))
    # the variant's own tensors are among them: the scales or the fused projection and its bias
    extra = {"scales": ".scale", "fused-qkv": ".attn_qkv."}
    assert any(marker in name for name in own for marker in extra.values())


def test_the_fused_variant_holds_no_separate_projections(variant: Path) -> None:
    names = {t.name for t in gguf.GGUFReader(variant).tensors}
    if "blk.0.attn_qkv.weight" in names:
        assert not any(".attn_q.weight" in n or ".attn_k.weight" in n for n in names)
        assert all(f"blk.{i}.attn_qkv.bias" in names for i in range(6))
    else:
        assert all(f"blk.{i}.attn_q.scale" in names for i in range(6))


@pytest.mark.parametrize("layers", [(0, 3), (2, 4)])
def test_an_untested_architecture_is_refused_at_load_by_name(tmp_path: Path, layers: tuple[int, int]) -> None:
    path = write_tiny_gguf(tmp_path / "gpt2.gguf", UNSUPPORTED_SPEC)
    with pytest.raises(UnsupportedModel) as refused:
        Model(path, layers)
    message = str(refused.value)
    assert "'gpt2' does not support partial layer ranges" in message and "\n" not in message



@pytest.mark.slow
def test_serve_refuses_an_untested_architecture_in_one_line(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "gpt2.gguf", UNSUPPORTED_SPEC)
    done = run_meshd("serve", "--model", str(path), "--layers", "0:3", "--threads", "1", "--listen", "127.0.0.1:0")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'gpt2' does not support partial layer ranges" in lines[0], done.stderr
