"""Recurrent and hybrid architectures split by layer ranges, bit-identical to the whole model.

Mamba and Mamba-2 (recurrent state only) and Qwen3-Next (gated delta-net layers, a
full-attention layer every fourth). Each stage keeps the recurrent states and the KV
cache of its own layers only: the memories are built with the range as their layer
filter. Qwen3-Next's cuts make stages with no attention layer, with only one, and
mixed. Prefill of one, a few and many tokens; 16 greedy decode steps.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_factory import owned_tensors
from gguf_variants import write_mamba, write_mamba2, write_qwen3next
from parity import assert_same_logits

from meshd.engine import Model, Sampler
from meshd.engine.chain import LocalChain

N_LAYER = 6
CHAINS = {"thin-ends": [(0, 1), (1, 5), (5, 6)], "thirds": [(0, 2), (2, 4), (4, 6)]}
# Qwen3-Next's 8 layers: full attention at 3 and 7, the delta net elsewhere
HYBRID_CHAINS = {
    "recurrent-only, attention-only, mixed": [(0, 3), (3, 4), (4, 8)],
    "mixed, recurrent-only, mixed": [(0, 4), (4, 6), (6, 8)],
}
PROMPT_LENGTHS = (1, 9, 40)
DECODE_STEPS = 16


WRITERS = {"mamba": write_mamba, "mamba2": write_mamba2}


@pytest.fixture(scope="module", params=["mamba-untied", "mamba2-untied", "mamba2-tied"])
def recurrent(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, head = request.param.split("-")
    return WRITERS[arch](tmp_path_factory.mktemp(arch) / f"{request.param}.gguf", N_LAYER, tied=head == "tied")


def runs(path: Path, ranges: list[tuple[int, int]] | None) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(3)
    chain = LocalChain(path, ranges, n_ctx=128, n_threads=1)
    try:
        out = []
        for n in PROMPT_LENGTHS:
            for c in chain.contexts:
                c.clear()
            prompt = rng.integers(0, 200, size=n).tolist()
            sampler = Sampler(chain.head)
            logits = [chain.forward(prompt, 0)[-1].copy()]
            for step in range(DECODE_STEPS):
                token = sampler.sample(logits[-1])
                logits.append(chain.forward([token], n + step)[-1].copy())
            sampler.close()
            out.append(logits)
        return out
    finally:
        chain.close()


@pytest.mark.parametrize("chain_name", sorted(CHAINS))
def test_a_chain_of_ranges_matches_the_whole_model(recurrent: Path, chain_name: str) -> None:
    whole, split = runs(recurrent, None), runs(recurrent, CHAINS[chain_name])
    for p, (a, b) in enumerate(zip(whole, split, strict=True)):
        for step, (want, got) in enumerate(zip(a, b, strict=True)):
            assert_same_logits(want, got, f"prompt {p}, step {step}")


@pytest.mark.parametrize("layers", [(0, 1), (1, 5), (5, 6)])
def test_a_stage_loads_its_own_tensors(recurrent: Path, layers: tuple[int, int]) -> None:
    own = owned_tensors(gguf.GGUFReader(recurrent), layers)
    with Model(recurrent, layers) as m:
        assert (m.report.n_tensors, m.report.n_bytes) == (len(own), sum(own.values()))
        assert m.report.stage_width == 64 and m.report.arch == recurrent.name.split("-")[0]


@pytest.fixture(scope="module")
def qwen3next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3next(tmp_path_factory.mktemp("qwen3next") / "qwen3next.gguf", n_layer=8)


@pytest.mark.parametrize("chain_name", sorted(HYBRID_CHAINS))
def test_a_hybrid_chain_matches_the_whole_model(qwen3next: Path, chain_name: str) -> None:
    whole, split = runs(qwen3next, None), runs(qwen3next, HYBRID_CHAINS[chain_name])
    for p, (a, b) in enumerate(zip(whole, split, strict=True)):
        for step, (want, got) in enumerate(zip(a, b, strict=True)):
            assert_same_logits(want, got, f"prompt {p}, step {step}")


@pytest.mark.parametrize("layers", [(0, 3), (3, 4), (4, 8)])
def test_a_hybrid_stage_loads_its_own_tensors(qwen3next: Path, layers: tuple[int, int]) -> None:
    own = owned_tensors(gguf.GGUFReader(qwen3next), layers)
    with Model(qwen3next, layers) as m:
        assert (m.report.n_tensors, m.report.n_bytes) == (len(own), sum(own.values()))
