"""The prefix cache's engine step: a sequence given another's prefix (me_seq_copy) computes the rest
exactly as a sequence that ran the whole prompt itself, bit for bit (the engine is batch-invariant,
and the copied cells are where the sequence's own would be)."""

from __future__ import annotations

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


@pytest.mark.parametrize("cut", [100, 299])
def test_a_copied_prefix_gives_the_logits_of_the_whole_prompt(default_model: Path, cut: int) -> None:
    rng = np.random.default_rng(3)
    with Model(default_model) as m, Context(m, n_ctx=3 * 512, n_seq_max=3, n_batch=CHUNK, n_threads=1) as ctx:
        first = rng.integers(3, m.report.n_vocab, 400).tolist()
        # the second prompt shares the first's first `cut` ids and goes elsewhere from there
        second = first[:cut] + rng.integers(3, m.report.n_vocab, 300 - cut + 1).tolist()
        _prefill(ctx, 0, first)
        whole = _prefill(ctx, 2, second)
        ctx.copy_prefix(0, 1, cut)
        assert ctx.pos_max(1) == cut - 1
        cached = _prefill(ctx, 1, second, start=cut)
        assert np.array_equal(cached, whole)
        # the entry is untouched: its own next step is what it would have been
        ctx.copy_prefix(0, 2, 400)
        step = [int(rng.integers(3, m.report.n_vocab))]
        a = ctx.forward([0], [400], tokens=step)
        b = ctx.forward([2], [400], tokens=step)
        assert np.array_equal(a, b)


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
