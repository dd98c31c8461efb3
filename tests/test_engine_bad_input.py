"""Every bad input to the engine is a Python exception that names the problem, never a crash."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshd.engine import Context, InvalidInput, Model, ModelLoadError, Sampler, SamplingParams


@pytest.fixture(scope="module")
def middle(default_model: Path) -> Model:
    m = Model(default_model, (10, 20))
    yield m
    m.close()


@pytest.fixture(scope="module")
def head(default_model: Path) -> Model:
    m = Model(default_model, (0, 10))
    yield m
    m.close()


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found.*nope.gguf"):
        Model(tmp_path / "nope.gguf")


def test_directory_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a file"):
        Model(tmp_path)


def test_empty_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty"):
        Model(path)


def test_non_gguf_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        Model(path)


@pytest.mark.parametrize("keep", [4, 100, 4096, 5_000_000])
def test_truncated_gguf_is_refused(tmp_path: Path, default_model: Path, keep: int) -> None:
    path = tmp_path / "truncated.gguf"
    with default_model.open("rb") as f:
        path.write_bytes(f.read(keep))
    with pytest.raises(ModelLoadError, match="cannot load truncated.gguf: (invalid GGUF file|.*not within the file bounds)"):
        Model(path)


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ((5, 5), "empty or inverted"),
        ((7, 3), "empty or inverted"),
        ((-1, 3), "below 0"),
        ((0, 31), "out of bounds for a model with 30 layers"),
        ((30, 40), "out of bounds"),
    ],
)
def test_bad_layer_range_is_refused(default_model: Path, layers: tuple[int, int], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        Model(default_model, layers)


def test_residual_of_wrong_width_is_refused(middle: Model) -> None:
    with Context(middle, n_ctx=64, n_threads=1) as ctx:
        with pytest.raises(InvalidInput, match=r"shape \(2, 512\).*\(2, 576\)"):
            ctx.forward([0, 0], [0, 1], hidden=np.zeros((2, 512), dtype=np.float32))
        with pytest.raises(InvalidInput, match="float32"):
            ctx.forward([0], [0], hidden=np.zeros((1, 576), dtype=np.float64))
        # the context still works after refusing
        out = ctx.forward([0], [0], hidden=np.zeros((1, 576), dtype=np.float32))
        assert out.shape == (1, 576)


def test_token_ids_at_a_middle_stage_are_refused(middle: Model) -> None:
    with Context(middle, n_ctx=64, n_threads=1) as ctx:
        with pytest.raises(InvalidInput, match="residual rows, not token ids"):
            ctx.forward([0], [0], tokens=[1])


def test_token_outside_vocabulary_is_refused(head: Model) -> None:
    with Context(head, n_ctx=64, n_threads=1) as ctx:
        for bad in (49152, -1, 10**9):
            with pytest.raises(InvalidInput, match=f"token id {bad} is outside the vocabulary"):
                ctx.forward([0], [0], tokens=[bad])
        with pytest.raises(InvalidInput, match="outside the vocabulary"):
            head.detokenize([49152])


def test_sequence_id_out_of_range_is_refused(head: Model) -> None:
    with Context(head, n_ctx=64, n_seq_max=2, n_threads=1) as ctx:
        with pytest.raises(InvalidInput, match="sequence id outside"):
            ctx.forward([2], [0], tokens=[1])
        with pytest.raises(InvalidInput, match="sequence id outside"):
            ctx.forward([-1], [0], tokens=[1])
        with pytest.raises(InvalidInput, match="sequence id 5"):
            ctx.remove(5)


def test_position_beyond_context_is_refused(head: Model) -> None:
    with Context(head, n_ctx=64, n_threads=1) as ctx:
        with pytest.raises(InvalidInput, match="position outside"):
            ctx.forward([0], [64], tokens=[1])


def test_position_gap_is_refused_by_llama_cpp_not_a_crash(head: Model) -> None:
    with Context(head, n_ctx=64, n_threads=1) as ctx:
        ctx.forward([0, 0], [0, 1], tokens=[1, 2])
        with pytest.raises(Exception, match="forward"):
            ctx.forward([0], [5], tokens=[3])
        ctx.forward([0], [2], tokens=[3])


def test_sampler_rejects_nonsense_parameters(head: Model) -> None:
    with pytest.raises(InvalidInput, match="top_p"):
        Sampler(head, SamplingParams(temperature=0.7, top_p=0.0))
    with pytest.raises(InvalidInput, match="NaN"):
        Sampler(head, SamplingParams(temperature=float("nan")))


def test_mismatched_lengths_are_refused(head: Model) -> None:
    with Context(head, n_ctx=64, n_threads=1) as ctx:
        with pytest.raises(InvalidInput, match="2 tokens for 1 positions"):
            ctx.forward([0], [0], tokens=[1, 2])
        with pytest.raises(InvalidInput, match="sequence ids"):
            ctx.forward([0, 0], [0], tokens=[1])


def test_greedy_shortcut_picks_what_llamas_greedy_chain_picks(head: Model) -> None:
    """Sampler.sample takes argmax where the chain is llama.cpp's greedy sampler alone: the same token on
    ties (the first of the highest) and on ordinary rows; a row with a NaN goes to the chain itself."""
    fast, chain = Sampler(head), Sampler(head)
    chain._greedy = False  # the chain's own path, for reference
    rng = np.random.default_rng(7)
    n = head.report.n_vocab
    rows = [rng.standard_normal(n).astype(np.float32) for _ in range(20)]
    tie = np.zeros(n, dtype=np.float32)
    tie[[50, 9, 4000]] = 3.0
    nan = rng.standard_normal(n).astype(np.float32)
    nan[[3, 700]] = np.nan
    for row in [*rows, tie, nan, np.full(n, -np.inf, dtype=np.float32)]:
        assert fast.sample(row) == chain.sample(row)
    assert fast.sample(tie) == 9
    assert fast.sample(nan) != 3  # argmax would have picked the first NaN
