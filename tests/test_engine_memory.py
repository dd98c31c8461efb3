"""A range loads exactly its own tensors: the report agrees with the GGUF header, tensor by tensor.

The expected set comes from the header alone (gguf_factory.owned_tensors over
gguf.GGUFReader), never from the engine: blk.N.* for N in range, token_embd at
the head (and at the tail of a tied model), output_norm/output at the tail.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_factory import TINY_SPECS, owned_tensors

from meshd.engine import Context, Model, UnsupportedModel

# head, middle, tail and full ranges of each model
TINY_RANGES = [(0, 2), (2, 4), (4, 6), (0, 6)]
DEFAULT_RANGES = [(0, 10), (10, 20), (20, 30), (0, 30)]


@cache
def header(path: Path) -> gguf.GGUFReader:
    # reading the default model's header parses its 49152-token vocabulary (~2 s): once per file
    return gguf.GGUFReader(path)


def assert_report_matches_header(path: Path, layers: tuple[int, int]) -> None:
    expected = owned_tensors(header(path), layers)
    with Model(path, layers) as m:
        r = m.report
    assert (r.layer_begin, r.layer_end) == layers
    assert r.has_input == (layers[0] == 0)
    assert r.has_output == (layers[1] == r.n_layer)
    assert r.n_tensors == len(expected), f"expected {sorted(expected)}"
    assert r.n_bytes == sum(expected.values())


@pytest.mark.parametrize("layers", TINY_RANGES, ids=lambda r: f"{r[0]}-{r[1]}")
@pytest.mark.parametrize("model_name", list(TINY_SPECS))
def test_tiny_model_report_counts_exactly_the_owned_tensors(
    model_name: str, layers: tuple[int, int], tiny_models: dict[str, Path],
) -> None:
    assert_report_matches_header(tiny_models[model_name], layers)


@pytest.mark.parametrize("layers", DEFAULT_RANGES, ids=lambda r: f"{r[0]}-{r[1]}")
def test_default_model_report_counts_exactly_the_owned_tensors(layers: tuple[int, int], default_model: Path) -> None:
    assert_report_matches_header(default_model, layers)


def test_owned_bytes_of_a_tiling_add_up_to_the_file_plus_the_tied_head_once_more(default_model: Path) -> None:
    # the tied head is the only tensor two stages both hold: the head as input, the tail as output
    sizes = {t.name: int(t.n_bytes) for t in header(default_model).tensors}
    assert "output.weight" not in sizes
    total = 0
    for layers in DEFAULT_RANGES[:3]:
        with Model(default_model, layers) as m:
            total += m.report.n_bytes
    assert total == sum(sizes.values()) + sizes["token_embd.weight"]


@pytest.mark.parametrize("layers", [(0, 3), (3, 6), (2, 4)], ids=["head", "tail", "middle"])
def test_partial_range_of_unsupported_architecture_is_refused_by_name(
    layers: tuple[int, int], unsupported_model: Path,
) -> None:
    with pytest.raises(UnsupportedModel, match="gpt2"):
        Model(unsupported_model, layers)


@pytest.mark.parametrize("layers", [None, (0, 6)], ids=["default", "explicit"])
def test_full_range_of_unsupported_architecture_loads_and_runs_like_stock(
    layers: tuple[int, int] | None, unsupported_model: Path,
) -> None:
    # a full range is not a partial one: stock llama.cpp behaviour, whatever the architecture
    with Model(unsupported_model, layers) as m:
        r = m.report
        assert (r.arch, r.layer_begin, r.layer_end, r.has_input, r.has_output) == ("gpt2", 0, 6, True, True)
        expected = owned_tensors(header(unsupported_model), (0, 6))
        assert (r.n_tensors, r.n_bytes) == (len(expected), sum(expected.values()))
        with Context(m, n_ctx=64, n_threads=1) as c:
            logits = c.forward([0, 0, 0], [0, 1, 2], tokens=[5, 6, 7])
    assert logits.shape == (1, r.n_vocab)
    assert np.isfinite(logits).all()
