"""qwen35, qwen35moe, kimi-linear and lfm2 split by layer ranges, bit-identical to the whole model.

Tiny random-weight GGUFs (tests/gguf_hybrid_a.py). Each stage keeps the recurrent states and
the KV cache of its own layers only (native/patches/0009: the range composed into the hybrid
memory's layer filters, the hybrid inputs set only where a stage's graph reads them). Every
architecture is cut into three stages twice, so that one stage holds no attention layer, one
holds no recurrent layer, and cuts fall on both sides of an attention layer:

- qwen35/qwen35moe (attention at 3 and 7, an MTP block after 7): recurrent-only, attention-only,
  mixed; and mixed, recurrent-only, mixed ending right beside the MTP block. A later stage's
  rows get the four interleaved M-RoPE positions a text token has (native/meshengine.cpp).
- kimi-linear (MLA at 3 and 6, layer 0 a dense lead): the dense lead alone, KDA-only, mixed;
  and KDA-only, MLA-only, mixed.
- lfm2 (attention at 2, 5, 6): convolution-only, attention-only, mixed; and mixed,
  convolution-only, attention-only; the sliding-window variant takes the hybrid-iswa memory.

Prompts of one, a few and many tokens, 24 greedy decode steps, logits compared at every step.
The MTP block belongs to the tail; meshengine never sets load_mtp, so no stage loads it and each
stage's report is exactly its own blocks and endpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_factory import byte_level_vocab, owned_tensors
from gguf_hybrid_a import write_kimi_linear, write_lfm2, write_qwen35
from parity import assert_same_logits
from test_engine_arch_parity import NEW_TOKENS, PROMPT_LENGTHS, Run, chain_runs

from meshd.engine import Model

Chain = list[tuple[int, int]]

WRITERS: dict[str, Callable[[Path], Path]] = {
    "qwen35": lambda p: write_qwen35(p, moe=False),
    "qwen35moe": lambda p: write_qwen35(p, moe=True),
    "kimi-linear": write_kimi_linear,
    "lfm2": write_lfm2,
    "lfm2-swa": lambda p: write_lfm2(p, n_swa=4),
}
# every architecture this file checks for parity (tests/test_arch_supported.py counts them)
HYBRID_A_ARCHS = ("qwen35", "qwen35moe", "kimi-linear", "lfm2")

_QWEN35: list[Chain] = [[(0, 3), (3, 4), (4, 8)], [(0, 4), (4, 6), (6, 8)]]
CHAINS: dict[str, list[Chain]] = {
    "qwen35": _QWEN35,
    "qwen35moe": _QWEN35,
    "kimi-linear": [[(0, 1), (1, 3), (3, 7)], [(0, 3), (3, 4), (4, 7)]],
    "lfm2": [[(0, 2), (2, 3), (3, 7)], [(0, 3), (3, 5), (5, 7)]],
    "lfm2-swa": [[(0, 2), (2, 3), (3, 7)], [(0, 3), (3, 5), (5, 7)]],
}
CASES = [(name, chain) for name, chains in CHAINS.items() for chain in chains]


def _case_id(case: tuple[str, Chain]) -> str:
    name, chain = case
    return f"{name}-" + "-".join(str(end) for _, end in chain[:-1])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-hybrid-a")
    return {name: write(root / f"{name}.gguf") for name, write in WRITERS.items()}


def prompts_for(name: str) -> list[list[int]]:
    # random ids, control tokens included: parity must hold for any input
    rng = np.random.default_rng(sorted(WRITERS).index(name) + 2000)
    n_vocab = len(byte_level_vocab()[0])
    return [rng.integers(0, n_vocab, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def whole(models: dict[str, Path]) -> dict[str, list[Run]]:
    return {name: chain_runs(path, None, prompts_for(name)) for name, path in models.items()}


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_a_chain_of_three_matches_the_whole_model(
    case: tuple[str, Chain], models: dict[str, Path], whole: dict[str, list[Run]],
) -> None:
    name, chain = case
    split = chain_runs(models[name], chain, prompts_for(name))
    for p, (a, b) in enumerate(zip(whole[name], split, strict=True)):
        assert len(a.logits) == len(b.logits) == NEW_TOKENS + 1
        for step, (la, lb) in enumerate(zip(a.logits, b.logits, strict=True)):
            assert_same_logits(la, lb, f"prompt {p}, step {step}")
            if step < NEW_TOKENS:
                assert a.tokens[step] == b.tokens[step], f"prompt {p}, step {step}: greedy token differs"


def _owned(reader: gguf.GGUFReader, layers: tuple[int, int], n_layer: int) -> dict[str, int]:
    own = owned_tensors(reader, layers)
    # LFM2's output norm goes by token_embd_norm: it belongs to the tail, beside the head
    for t in reader.tensors:
        if t.name == "token_embd_norm.weight" and layers[1] == n_layer:
            own[t.name] = int(t.n_bytes)
    return own


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_each_stage_loads_its_own_tensors(name: str, models: dict[str, Path]) -> None:
    reader = gguf.GGUFReader(models[name])
    arch = name.split("-swa")[0]
    for chain in CHAINS[name]:
        n_layer = chain[-1][1]
        for layers in chain:
            own = _owned(reader, layers, n_layer)
            with Model(models[name], layers) as m:
                assert (m.report.n_tensors, m.report.n_bytes) == (len(own), sum(own.values())), layers
                assert m.report.arch == arch and m.report.stage_width == 64
