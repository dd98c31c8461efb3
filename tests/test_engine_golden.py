"""meshd's engine against STOCK llama.cpp: the whole range and a split reproduce its answers exactly.

The goldens in tests/golden/ were produced once by tools/make_goldens.py, with
the pinned llama.cpp built WITHOUT meshd's patches; every other parity test
compares the patched engine with itself. On the CPU build the comparison is
exact: the same token ids, and logits equal bit for bit.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshd.engine import Sampler
from meshd.engine.chain import LocalChain

GOLDEN = Path(__file__).resolve().parent / "golden"
TINY = "llama-gqa-untied"
SPLITS = {
    "whole": None,
    "thirds": [(0, 10), (10, 20), (20, 30)],
    "thin-ends": [(0, 1), (1, 29), (29, 30)],
}
TINY_SPLITS = {"whole": None, "thirds": [(0, 2), (2, 4), (4, 6)], "one-layer-head": [(0, 1), (1, 6)]}


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((GOLDEN / name).read_text())
    return data


def same_file(path: Path, golden: dict[str, Any]) -> None:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == golden["model_sha256"], (
        f"{path.name} is not the file the goldens were made from: run tools/make_goldens.py again")


@pytest.fixture(scope="module")
def smollm2(default_model: Path) -> dict[str, Any]:
    golden = load("smollm2_greedy.json")
    same_file(default_model, golden)
    return golden


def chain_of(path: Path, ranges: list[tuple[int, int]] | None, golden: dict[str, Any]) -> LocalChain:
    return LocalChain(path, ranges, n_ctx=golden["n_ctx"], n_batch=golden["n_batch"], n_threads=golden["n_threads"])


def test_meshd_tokenizes_the_chat_prompt_as_stock_llama_cpp(default_model: Path, smollm2: dict[str, Any]) -> None:
    chain = chain_of(default_model, [(0, 30)], smollm2)
    try:
        for run in smollm2["runs"]:
            text = chain.head.apply_chat([{"role": "user", "content": run["text"]}])
            assert chain.head.tokenize(text, add_special=False) == run["prompt"]
    finally:
        chain.close()


@pytest.mark.parametrize("split", list(SPLITS))
def test_greedy_tokens_equal_stock_llama_cpp(default_model: Path, smollm2: dict[str, Any], split: str) -> None:
    chain = chain_of(default_model, SPLITS[split], smollm2)
    try:
        for run in smollm2["runs"]:
            assert list(chain.generate(run["prompt"], smollm2["new_tokens"])) == run["greedy"], run["text"]
    finally:
        chain.close()


@pytest.mark.parametrize("split", list(TINY_SPLITS))
def test_logits_equal_stock_llama_cpp_bit_for_bit(tiny_models: dict[str, Path], split: str) -> None:
    golden = load(f"tiny_{TINY}.json")
    want = np.load(GOLDEN / f"tiny_{TINY}.npy")
    same_file(tiny_models[TINY], golden)
    prompt, greedy = golden["prompt"], golden["greedy"]
    chain = chain_of(tiny_models[TINY], TINY_SPLITS[split], golden)
    sampler = Sampler(chain.head)
    try:
        rows = [chain.forward(prompt, 0, want_all=True)]
        picks = [sampler.sample(rows[0][-1])]
        for step in range(len(greedy) - 1):
            rows.append(chain.forward([picks[-1]], len(prompt) + step))
            picks.append(sampler.sample(rows[-1][-1]))
        got = np.concatenate(rows)
        assert picks == greedy
        assert got.shape == want.shape
        differ = np.flatnonzero(~(got == want).all(axis=1))
        assert np.array_equal(got, want), (
            f"{len(differ)} of {len(want)} logits rows differ from stock llama.cpp, first row {differ[:1]}, "
            f"max abs difference {float(np.max(np.abs(got - want)))}")
    finally:
        sampler.close()
        chain.close()
