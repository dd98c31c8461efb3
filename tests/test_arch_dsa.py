"""The DSA models (deepseek32, glm-dsa): chains of three or more layer ranges give exactly the whole model's logits.

Tiny random-weight GGUFs (tests/gguf_dsa.py): deepseek2's MLA with a q LoRA, two
dense-lead layers, routed and shared experts and a nextn block, plus the lightning
indexer, whose top-k (8, fewer positions than most contexts here) picks what each
query attends. The cuts sit right after the dense lead, inside it, and one layer
before the nextn block; glm-dsa's only where it allows a cut.

What native/patches/0010 makes true, and these tests check: both halves of the DSA
cache (the MLA keys and the indexer keys) hold only the owned layers; glm-dsa's
shared-indexer layers reuse the top-k of the full layer before them, which stays
inside a stage, so a range may be cut only just before a full-indexer layer and any
other cut is refused at load with one line naming the rule and the nearest allowed
cuts. The nextn block belongs to the tail as deepseek2's does (meshengine never asks
for it, so no stage loads it: each stage's report is exactly its blocks and endpoints).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_dsa import DSA_SPECS, write_dsa_gguf
from gguf_factory import byte_level_vocab, owned_tensors
from parity import assert_same_logits
from test_engine_arch_parity import NEW_TOKENS, PROMPT_LENGTHS, Run, chain_runs

from meshd.engine import InvalidInput, Model

ROOT = Path(__file__).resolve().parent.parent
Chain = list[tuple[int, int]]

CHAINS: dict[str, list[Chain]] = {
    # dense lead is layers 0-1: a cut right after it, one inside it; a one-layer tail beside the nextn block
    "deepseek32": [[(0, 2), (2, 4), (4, 6)], [(0, 1), (1, 3), (3, 5), (5, 6)]],
    # full indexers on 0-2, 5 and 7: a cut right after the dense lead, stages that carry a top-k over
    # two shared layers, a one-layer tail beside the nextn block
    "glm-dsa": [[(0, 2), (2, 5), (5, 8)], [(0, 1), (1, 2), (2, 5), (5, 7), (7, 8)]],
}
CASES = [(name, chain) for name, chains in CHAINS.items() for chain in chains]
# glm-dsa's refused cuts (before a shared-indexer layer), with the nearest allowed cuts the refusal names
REFUSED: list[tuple[tuple[int, int], int, str]] = [
    ((0, 3), 3, "the nearest allowed cuts are 2 and 5"),
    ((3, 8), 3, "the nearest allowed cuts are 2 and 5"),
    ((2, 4), 4, "the nearest allowed cuts are 2 and 5"),
    ((5, 6), 6, "the nearest allowed cuts are 5 and 7"),
]


def _case_id(case: tuple[str, Chain]) -> str:
    name, chain = case
    return f"{name}-" + "-".join(str(end) for _, end in chain[:-1])


@pytest.fixture(scope="module")
def dsa_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-dsa")
    return {name: write_dsa_gguf(root / f"{name}.gguf", spec) for name, spec in DSA_SPECS.items()}


def prompts_for(name: str) -> list[list[int]]:
    # random ids, control tokens included: parity must hold for any input
    rng = np.random.default_rng(DSA_SPECS[name].moe.seed + 1000)
    n_vocab = len(byte_level_vocab()[0])
    return [rng.integers(0, n_vocab, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def whole_runs(dsa_models: dict[str, Path]) -> dict[str, list[Run]]:
    return {name: chain_runs(path, None, prompts_for(name)) for name, path in dsa_models.items()}


def test_every_chain_has_three_stages_and_cuts_only_where_the_architecture_allows() -> None:
    assert set(CHAINS) == set(DSA_SPECS)
    for name, chains in CHAINS.items():
        spec = DSA_SPECS[name]
        assert any(len(c) >= 3 for c in chains), name
        for c in chains:
            assert c[0][0] == 0 and c[-1][1] == spec.n_layer, (name, c)
            assert all(a[1] == b[0] for a, b in zip(c, c[1:], strict=False)), (name, c)
            assert {b for b, _ in c[1:]} <= set(spec.allowed_cuts()), (name, c)
        # right after the dense lead, and a one-layer tail beside the nextn block
        assert any(spec.moe.n_dense_lead in {b for b, _ in c} for c in chains), name
        assert any(c[-1] == (spec.n_layer - 1, spec.n_layer) for c in chains), name
    # glm-dsa: some stage starts on a full layer and carries its top-k over shared layers
    assert any(not DSA_SPECS["glm-dsa"].indexes(il) for b, e in CHAINS["glm-dsa"][0] for il in range(b + 1, e))


@pytest.mark.parametrize(("model_name", "ranges"), CASES, ids=[_case_id(c) for c in CASES])
def test_chain_of_ranges_matches_whole_model_logits_and_greedy_tokens(
    model_name: str, ranges: Chain, dsa_models: dict[str, Path], whole_runs: dict[str, list[Run]],
) -> None:
    whole = whole_runs[model_name]
    split = chain_runs(dsa_models[model_name], ranges, prompts_for(model_name))
    for p, (a, b) in enumerate(zip(whole, split, strict=True)):
        assert len(a.logits) == len(b.logits) == NEW_TOKENS + 1
        for step, (la, lb) in enumerate(zip(a.logits, b.logits, strict=True)):
            assert_same_logits(la, lb, f"prompt {p}, step {step}")
            if step < NEW_TOKENS:
                assert a.tokens[step] == b.tokens[step], f"prompt {p}, step {step}: greedy token differs"


def test_greedy_runs_wander_over_the_vocabulary(whole_runs: dict[str, list[Run]]) -> None:
    # a model stuck on one token would let a broken split pass on tokens alone
    for name, runs in whole_runs.items():
        assert max(len(set(r.tokens)) for r in runs) >= 4, name


@pytest.mark.parametrize("model_name", list(DSA_SPECS))
def test_the_indexer_selection_decides_the_logits(
    model_name: str, whole_runs: dict[str, list[Run]], tmp_path: Path,
) -> None:
    # with a top-k past every context the indexer selects everything: if that changed nothing, the parity
    # above would not show that each stage's indexer cache holds the right keys
    spec = dataclasses.replace(DSA_SPECS[model_name], indexer_top_k=4096)
    dense = chain_runs(write_dsa_gguf(tmp_path / "dense.gguf", spec), None, prompts_for(model_name)[-1:])
    assert not np.array_equal(dense[0].logits[0], whole_runs[model_name][-1].logits[0])


@pytest.mark.parametrize("model_name", list(CHAINS))
def test_each_stage_loads_exactly_its_blocks_and_endpoints(model_name: str, dsa_models: dict[str, Path]) -> None:
    path = dsa_models[model_name]
    spec = DSA_SPECS[model_name]
    reader = gguf.GGUFReader(path)
    nextn = {t.name for t in reader.tensors if t.name.startswith(f"blk.{spec.n_layer}.")}
    assert nextn
    for layers in [(0, spec.n_layer), *CHAINS[model_name][-1]]:
        expected = owned_tensors(reader, layers)
        assert not nextn & set(expected)
        with Model(path, layers) as m:
            r = m.report
        assert (r.arch, r.n_layer, r.layer_begin, r.layer_end) == (model_name, spec.n_layer, *layers)
        assert (r.has_input, r.has_output) == (layers[0] == 0, layers[1] == spec.n_layer)
        assert (r.n_tensors, r.n_bytes) == (len(expected), sum(expected.values())), layers


# loads each range with a context and prints the layer counts llama.cpp logs for the DSA cache's two halves
_CACHE_PROBE = """
import json, re, sys
from meshd.engine import Context, Model
path, ranges = sys.argv[1], json.loads(sys.argv[2])
for begin, end in ranges:
    with Model(path, (begin, end)) as m, Context(m, n_ctx=64, n_threads=1):
        pass
    print("--", file=sys.stderr, flush=True)
"""
_CACHE_LINE = re.compile(r"llama_kv_cache: size = .*?\(\s*\d+ cells,\s*(\d+) layers")


@pytest.mark.slow
@pytest.mark.parametrize("model_name", list(DSA_SPECS))
def test_both_halves_of_the_dsa_cache_hold_only_the_owned_layers(model_name: str, dsa_models: dict[str, Path]) -> None:
    spec = DSA_SPECS[model_name]
    ranges = [(0, spec.n_layer), *CHAINS[model_name][-1]]
    probe = subprocess.run(
        [sys.executable, "-c", _CACHE_PROBE, str(dsa_models[model_name]), json.dumps(ranges)],
        cwd=ROOT, env={**os.environ, "MESHD_LLAMA_LOG": "info"}, capture_output=True, text=True, timeout=120,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    logged = [[int(n) for n in _CACHE_LINE.findall(part)] for part in probe.stderr.split("--\n")[:-1]]
    # the main (MLA) cache first, then the indexer's: owned trunk layers, and of those the indexing ones
    want = [[e - b, sum(spec.indexes(il) for il in range(b, e))] for b, e in ranges]
    assert logged == want


@pytest.mark.parametrize(("layers", "cut", "nearest"), REFUSED, ids=[f"{b}-{e}" for (b, e), _, _ in REFUSED])
def test_a_glm_dsa_cut_before_a_shared_indexer_layer_is_refused_with_the_rule_and_the_nearest_cuts(
    layers: tuple[int, int], cut: int, nearest: str, dsa_models: dict[str, Path],
) -> None:
    with pytest.raises(InvalidInput) as refused:
        Model(dsa_models["glm-dsa"], layers)
    line = str(refused.value)
    assert "\n" not in line
    assert f"layer range [{layers[0]}, {layers[1]}) cuts glm-dsa before layer {cut}, a shared-indexer layer" in line
    assert "may be cut only just before a full-indexer layer" in line
    assert line.endswith(nearest)


def test_the_glm_dsa_refusal_names_the_one_allowed_cut_beside_an_end(dsa_models: dict[str, Path]) -> None:
    # no allowed cut lies below 1 but the head itself: one cut is named
    path = dsa_models["glm-dsa"]
    spec = dataclasses.replace(DSA_SPECS["glm-dsa"], indexer_types=(1, 0, 0, 1, 0, 0, 0, 0))
    alt = write_dsa_gguf(path.with_name("glm-dsa-sparse.gguf"), spec)
    with pytest.raises(InvalidInput, match=r"before layer 1, .*; the nearest allowed cut is 3$"):
        Model(alt, (1, 8))
    with pytest.raises(InvalidInput, match=r"before layer 5, .*; the nearest allowed cut is 3$"):
        Model(alt, (0, 5))
