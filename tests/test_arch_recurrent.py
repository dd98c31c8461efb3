"""Recurrent architectures split by layer ranges: Mamba and Mamba-2, bit-identical to the whole model.

Each stage keeps the recurrent state (conv and SSM state) of its own layers only: the
recurrent memory is built with the range as its layer filter, as the hybrid memories
build their recurrent part. Cuts right after the first layer, before the last and
through the middle; prefill of one, a few and many tokens; 16 greedy decode steps.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_factory import owned_tensors
from gguf_variants import write_mamba, write_mamba2
from parity import assert_same_logits

from meshd.engine import Model, Sampler
from meshd.engine.chain import LocalChain

N_LAYER = 6
CHAINS = {"thin-ends": [(0, 1), (1, 5), (5, 6)], "thirds": [(0, 2), (2, 4), (4, 6)]}
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
