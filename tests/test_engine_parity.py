"""A chain of layer ranges gives exactly the whole model's logits and greedy tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from parity import assert_same_logits

from meshd.engine import Model, Sampler
from meshd.engine.chain import LocalChain

pytestmark = pytest.mark.slow  # the default model, whole and split, 3 prompts x 32 tokens

# three prompts of different shapes (a fact, verse, a list of steps): every chain's logits are compared
# bit for bit at each of 33 positions, so more prompts or tokens add time (~1.5 s each a chain), hardly
# coverage (a split that differs shows at the prefill's logits already, each position a fresh check);
# tests/test_stage_pipeline.py checks the tokens of five prompts through served stages
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me a short recipe for pancakes.",
]
CHAINS = {
    "thirds": [(0, 10), (10, 20), (20, 30)],
    "thin-ends": [(0, 1), (1, 29), (29, 30)],
    "halves": [(0, 15), (15, 30)],
}
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompts(default_model: Path) -> list[list[int]]:
    with Model(default_model, (0, 1)) as head:
        return [head.tokenize(head.apply_chat([{"role": "user", "content": p}]), add_special=False) for p in PROMPTS]


def run_teacher_forced(chain: LocalChain, prompt: list[int], forced: list[int] | None) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and the logits after prefill and after each decode step.

    With `forced`, the given tokens are fed instead of the chain's own picks, so
    the logits of two runs stay comparable step by step even if a pick differed.
    """
    for c in chain.contexts:
        c.clear()
    sampler = Sampler(chain.head)
    logits = chain.forward(prompt, 0)[-1].copy()
    picks, seen = [], [logits]
    pos = len(prompt)
    for step in range(NEW_TOKENS):
        token = sampler.sample(logits)
        picks.append(token)
        feed = forced[step] if forced is not None else token
        logits = chain.forward([feed], pos)[-1].copy()
        seen.append(logits)
        pos += 1
    sampler.close()
    return picks, seen


@pytest.fixture(scope="module")
def whole_runs(default_model: Path, prompts: list[list[int]]) -> list[tuple[list[int], list[np.ndarray]]]:
    chain = LocalChain(default_model, None, n_ctx=512, n_threads=1)
    try:
        return [run_teacher_forced(chain, p, None) for p in prompts]
    finally:
        chain.close()


@pytest.mark.parametrize("name", list(CHAINS))
def test_chain_matches_whole_model_tokens_and_logits(name: str, default_model: Path, prompts: list[list[int]],
                                                     whole_runs: list[tuple[list[int], list[np.ndarray]]]) -> None:
    chain = LocalChain(default_model, CHAINS[name], n_ctx=512, n_threads=1)
    try:
        for p, (prompt, (whole_tokens, whole_logits)) in enumerate(zip(prompts, whole_runs, strict=True)):
            tokens, logits = run_teacher_forced(chain, prompt, whole_tokens)
            assert tokens == whole_tokens
            assert len(logits) == NEW_TOKENS + 1
            for step, (a, b) in enumerate(zip(whole_logits, logits, strict=True)):
                assert_same_logits(a, b, f"prompt {p}, step {step}")
    finally:
        chain.close()


def test_whole_model_generates_real_text(default_model: Path, prompts: list[list[int]],
                                         whole_runs: list[tuple[list[int], list[np.ndarray]]]) -> None:
    with Model(default_model, (29, 30)) as tail:
        answer = tail.detokenize(whole_runs[0][0])
    assert "Paris" in answer
