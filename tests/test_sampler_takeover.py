"""A seeded pick depends on the seed and the tokens before it alone: a sampler that takes a session over
mid-answer (a failover's new tail, given the history) picks what the unbroken one would have."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from meshd.engine import Model, Sampler, SamplingParams

PROMPT = [1, 17, 305, 42, 9, 2001, 33]
ROWS = 24
PARAMS = {
    "temperature": SamplingParams(temperature=1.0, seed=7),
    "nucleus-and-penalty": SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repeat_penalty=1.3,
                                          repeat_last_n=16, seed=123456789),
}


@pytest.fixture(scope="module")
def tail(default_model: Path) -> Iterator[Model]:
    with Model(default_model, (29, 30)) as model:
        yield model


def rows(n_vocab: int) -> np.ndarray:
    """Flat-ish random logits, so a seeded draw has many tokens to choose from at every step."""
    return np.random.default_rng(5).normal(0.0, 1.5, size=(ROWS, n_vocab)).astype(np.float32)


def picks(tail: Model, params: SamplingParams, history: list[int], logits: np.ndarray) -> list[int]:
    sampler = Sampler(tail, params)
    try:
        for t in history:
            sampler.accept(t)
        return [sampler.sample(row) for row in logits]
    finally:
        sampler.close()


@pytest.mark.parametrize("name", list(PARAMS))
def test_a_sampler_taking_over_mid_answer_picks_what_the_unbroken_one_would(tail: Model, name: str) -> None:
    params = PARAMS[name]
    logits = rows(tail.report.n_vocab)
    unbroken = picks(tail, params, PROMPT, logits)
    assert len(set(unbroken)) > ROWS // 2, "the rows leave the draw nothing to choose"
    for k in (1, 5, ROWS - 1):
        assert picks(tail, params, PROMPT + unbroken[:k], logits[k:]) == unbroken[k:], f"taken over after {k}"


def test_the_seed_and_the_history_both_move_the_draw(tail: Model) -> None:
    params = PARAMS["temperature"]
    logits = rows(tail.report.n_vocab)
    unbroken = picks(tail, params, PROMPT, logits)
    assert picks(tail, params, PROMPT, logits) == unbroken
    assert picks(tail, SamplingParams(temperature=1.0, seed=8), PROMPT, logits) != unbroken
    assert picks(tail, params, PROMPT[1:], logits) != unbroken
