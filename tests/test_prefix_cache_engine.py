"""The prefix cache's engine step: a sequence given another's prefix (me_seq_copy) computes the rest
exactly as a sequence that ran the whole prompt itself, bit for bit (the engine is batch-invariant,
and the copied cells are where the sequence's own would be)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf_variants import write_mamba

from meshd.engine.engine import Context, InvalidInput, Model, UnsupportedModel

CHUNK = 64


def _prefill(ctx: Context, seq: int, tokens: list[int], start: int = 0) -> np.ndarray:
    """Runs tokens[start:] on ``seq`` in chunks; the last row's logits."""
    out = np.empty(0)
    for p in range(start, len(tokens), CHUNK):
        part = tokens[p:p + CHUNK]
        want = [False] * (len(part) - 1) + [True]
        out = ctx.forward([seq] * len(part), range(p, p + len(part)), tokens=part, want_output=want)
    return out


# the entry both cuts copy from: 400 random ids, prefilled once for the module on sequence 0
ENTRY = 400


@pytest.fixture(scope="module")
def entry(default_model: Path) -> Iterator[tuple[Model, Context, list[int]]]:
    with Model(default_model) as m, Context(m, n_ctx=3 * 512, n_seq_max=3, n_batch=CHUNK, n_threads=1) as ctx:
        first = np.random.default_rng(3).integers(3, m.report.n_vocab, ENTRY).tolist()
        _prefill(ctx, 0, first)
        yield m, ctx, first


@pytest.mark.parametrize("cut", [100, 299])
def test_a_copied_prefix_gives_the_logits_of_the_whole_prompt(entry: tuple[Model, Context, list[int]],
                                                              cut: int) -> None:
    m, ctx, first = entry
    rng = np.random.default_rng(cut)
    try:
        # the second prompt shares the first's first `cut` ids and goes elsewhere from there
        second = first[:cut] + rng.integers(3, m.report.n_vocab, 300 - cut + 1).tolist()
        whole = _prefill(ctx, 2, second)
        ctx.copy_prefix(0, 1, cut)
        assert ctx.pos_max(1) == cut - 1
        cached = _prefill(ctx, 1, second, start=cut)
        assert np.array_equal(cached, whole)
        # the entry is untouched: its own next step is what it would have been
        ctx.copy_prefix(0, 2, ENTRY)
        step = [int(rng.integers(3, m.report.n_vocab))]
        a = ctx.forward([0], [ENTRY], tokens=step)
        b = ctx.forward([2], [ENTRY], tokens=step)
        assert np.array_equal(a, b)
    finally:
        # the entry as the fixture made it, for the other cut
        ctx.remove(0, ENTRY)
        ctx.remove(1)
        ctx.remove(2)


def test_bad_copies_are_refused(default_model: Path) -> None:
    with Model(default_model) as m, Context(m, n_ctx=2 * 256, n_seq_max=2, n_batch=CHUNK, n_threads=1) as ctx:
        _prefill(ctx, 0, list(range(3, 40)))
        for src, dst, n in [(0, 0, 1), (0, 2, 1), (-1, 1, 1), (0, 1, 38), (0, 1, 257), (0, 1, -1)]:
            with pytest.raises(InvalidInput):
                ctx.copy_prefix(src, dst, n)
        ctx.copy_prefix(0, 1, 0)
        assert ctx.pos_max(1) == -1


def test_a_recurrent_model_has_no_prefix_copy(tmp_path: Path) -> None:
    # its state folds every position in: a prefix's state is not a part of the whole's
    path = write_mamba(tmp_path / "mamba.gguf")
    with Model(path) as m, Context(m, n_ctx=2 * 256, n_seq_max=2, n_batch=CHUNK, n_threads=1) as ctx:
        _prefill(ctx, 0, list(range(3, 40)))
        with pytest.raises(UnsupportedModel):
            ctx.copy_prefix(0, 1, 8)
