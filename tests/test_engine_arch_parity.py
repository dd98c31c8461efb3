"""Every supported architecture: a chain of layer ranges gives exactly the whole model's logits and tokens.

Runs on tiny random-weight GGUFs (tools/gguf_factory.py): llama with grouped-query
attention, tied and untied head; qwen2 with q/k/v biases; qwen3 with q/k norms.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_factory import TINY_SPECS, byte_level_vocab
from parity import assert_same_logits

from meshd.engine import Model, Sampler
from meshd.engine.chain import LocalChain

CHAINS: dict[str, list[tuple[int, int]]] = {
    "thirds": [(0, 2), (2, 4), (4, 6)],
    "thin-ends": [(0, 1), (1, 5), (5, 6)],
    "halves": [(0, 3), (3, 6)],
}
# lengths chosen to give a one-token, a short and a longer prefill
PROMPT_LENGTHS = (1, 9, 40)
NEW_TOKENS = 24
N_CTX = 128
# one thread: the tiny models need no more, and ggml's spinning thread barrier can burn
# tens of seconds when a shared, busy machine deschedules one of two threads
N_THREADS = 1


@dataclass(frozen=True)
class Run:
    tokens: list[int]
    logits: list[np.ndarray]  # after prefill, then after each decode step


def prompts_for(name: str) -> list[list[int]]:
    # random ids, not text: parity must hold for any input, control tokens included
    rng = np.random.default_rng(TINY_SPECS[name].seed)
    n_vocab = len(byte_level_vocab()[0])
    return [rng.integers(0, n_vocab, size=n).tolist() for n in PROMPT_LENGTHS]


def greedy_run(chain: LocalChain, prompt: list[int]) -> Run:
    for c in chain.contexts:
        c.clear()
    sampler = Sampler(chain.head)
    try:
        logits = chain.forward(prompt, 0)[-1].copy()
        tokens, seen = [], [logits]
        for step in range(NEW_TOKENS):
            token = sampler.sample(logits)
            tokens.append(token)
            logits = chain.forward([token], len(prompt) + step)[-1].copy()
            seen.append(logits)
        return Run(tokens, seen)
    finally:
        sampler.close()


def chain_runs(path: Path, ranges: list[tuple[int, int]] | None, prompts: list[list[int]]) -> list[Run]:
    chain = LocalChain(path, ranges, n_ctx=N_CTX, n_threads=N_THREADS)
    try:
        return [greedy_run(chain, p) for p in prompts]
    finally:
        chain.close()


@pytest.fixture(scope="module")
def whole_runs(tiny_models: dict[str, Path]) -> dict[str, list[Run]]:
    return {name: chain_runs(path, None, prompts_for(name)) for name, path in tiny_models.items()}


@pytest.mark.parametrize("chain_name", list(CHAINS))
@pytest.mark.parametrize("model_name", list(TINY_SPECS))
def test_chain_of_ranges_matches_whole_model_logits_and_greedy_tokens(
    model_name: str, chain_name: str, tiny_models: dict[str, Path], whole_runs: dict[str, list[Run]],
) -> None:
    whole = whole_runs[model_name]
    split = chain_runs(tiny_models[model_name], CHAINS[chain_name], prompts_for(model_name))
    for p, (a, b) in enumerate(zip(whole, split, strict=True)):
        assert len(a.logits) == len(b.logits) == NEW_TOKENS + 1
        # step by step, so a failure names the first step where the chain left the whole model
        for step, (la, lb) in enumerate(zip(a.logits, b.logits, strict=True)):
            assert_same_logits(la, lb, f"prompt {p}, step {step}")
            if step < NEW_TOKENS:
                assert a.tokens[step] == b.tokens[step], f"prompt {p}, step {step}: greedy token differs"


def _bytes(reader: gguf.GGUFReader, names: set[str]) -> int:
    return sum(int(t.n_bytes) for t in reader.tensors if t.name in names)


@pytest.mark.parametrize(
    ("model_name", "layers", "endpoint_tensors"),
    [
        # the tied head is token_embd itself: the tail must load it although it takes no token ids
        ("llama-gqa-tied", (4, 6), {"output_norm.weight", "token_embd.weight"}),
        ("llama-gqa-tied", (0, 2), {"token_embd.weight"}),
        ("llama-gqa-tied", (2, 4), set()),
        # an untied head belongs to the tail alone: the head must not load output.weight
        ("llama-gqa-untied", (0, 2), {"token_embd.weight"}),
        ("llama-gqa-untied", (4, 6), {"output_norm.weight", "output.weight"}),
    ],
)
def test_endpoint_tensors_follow_whether_the_output_head_is_tied(
    model_name: str, layers: tuple[int, int], endpoint_tensors: set[str], tiny_models: dict[str, Path],
) -> None:
    path = tiny_models[model_name]
    reader = gguf.GGUFReader(path)
    blocks = {t.name for t in reader.tensors
              if t.name.startswith("blk.") and layers[0] <= int(t.name.split(".")[1]) < layers[1]}
    with Model(path, layers) as m:
        r = m.report
    assert (r.has_input, r.has_output) == (layers[0] == 0, layers[1] == TINY_SPECS[model_name].n_layer)
    assert r.n_tensors == len(blocks) + len(endpoint_tensors)
    assert r.n_bytes == _bytes(reader, blocks) + _bytes(reader, endpoint_tensors)
