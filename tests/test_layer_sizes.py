"""The tracker's memory estimate per layer comes from the file's real tensor sizes.

A MoE model's layers are many times its dense lead layers: an estimate that spreads
the file's blocks evenly over its layers puts more MoE layers on a node than it
holds. The per-layer sizes come from the GGUF header; a stage's estimate is the sum
of its own layers, and it equals what the engine loads for the range.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import pytest
from gguf_factory import TINY_SPECS
from gguf_variants import with_uneven_layers, write_dense_lead_moe, write_mamba2, write_variant

from meshd.engine import Model
from meshd.mesh.assignment import ModelSpec, NodeCapacity
from meshd.mesh.models import weight_budget
from meshd.mesh.placement import assign
from meshd.stage.model_file import describe_model
from wire.swim import ModelInfo

N_LAYER, N_DENSE = 6, 2


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dense_lead_moe(tmp_path_factory.mktemp("moe") / "dense-lead-moe.gguf", N_LAYER, N_DENSE)


@pytest.fixture(scope="module")
def uneven_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_variant(tmp_path_factory.mktemp("uneven"), TINY_SPECS["llama-gqa-tied"], with_uneven_layers)


def test_each_layer_weighs_its_own_tensors(moe_file: Path) -> None:
    reader = gguf.GGUFReader(moe_file)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    info = describe_model(moe_file, "d")
    # the nextn block past the last layer is no layer of a range: the tail holds it
    assert info.n_layers == N_LAYER
    for i, size in enumerate(info.layer_bytes):
        assert size == sum(v for k, v in sizes.items() if k.startswith(f"blk.{i}."))
    dense, moe = info.layer_bytes[:N_DENSE], info.layer_bytes[N_DENSE:]
    assert len(set(dense)) == len(set(moe)) == 1 and moe[0] > dense[0]
    assert info.bytes_per_layer == moe[0]
    assert info.head_bytes == sizes["token_embd.weight"]
    nextn = sum(v for k, v in sizes.items() if k.startswith(f"blk.{N_LAYER}."))
    assert info.tail_bytes == sizes["output.weight"] + sizes["output_norm.weight"] + nextn
    # nothing is counted twice or left out (the head is untied here)
    assert sum(info.layer_bytes) + info.head_bytes + info.tail_bytes == sum(sizes.values())


def test_a_tied_head_is_counted_at_the_tail_too() -> None:
    layers, head, tail = weight_budget({"token_embd.weight": 100, "output_norm.weight": 4, "blk.0.x": 7}, 1)
    assert (layers, head, tail) == ([7], 100, 104)


@pytest.mark.parametrize("layers", [(0, 1), (0, 3), (1, 4), (2, 5), (3, 6), (5, 6)])
def test_a_stage_estimate_is_what_the_engine_loads(uneven_file: Path, layers: tuple[int, int]) -> None:
    info = describe_model(uneven_file, "d")
    assert len(set(info.layer_bytes)) > 1  # the file's layers differ
    spec = ModelSpec.from_info(info, kv_tokens=0)
    with Model(uneven_file, layers) as m:
        assert m.report.n_bytes == spec.stage_bytes(*layers)


def test_the_whole_model_estimate_holds_what_it_loads(uneven_file: Path) -> None:
    spec = ModelSpec.from_info(describe_model(uneven_file, "d"), kv_tokens=0)
    with Model(uneven_file) as m:
        # a tied head is one tensor that both ends hold, so a single stage may count it twice, never short
        assert m.report.n_bytes <= spec.stage_bytes(0, N_LAYER)


def test_a_moe_assignment_fits_where_an_even_spread_would_not(moe_file: Path) -> None:
    info = describe_model(moe_file, "d")
    spec = ModelSpec.from_info(info, kv_tokens=64)
    # six equal nodes, each two and a half MoE layers and the embedding
    memory = 5 * (info.layer_bytes[-1] + spec.kv_bytes_per_layer) // 2 + info.head_bytes
    nodes = [NodeCapacity(f"n{i}", memory, 1e-3) for i in range(6)]
    placed = assign(nodes, spec)
    covered = 0
    for stage in placed.chain:
        assert stage.start == covered
        covered = stage.end
    assert covered == N_LAYER
    for stage in placed.stages:
        assert spec.stage_bytes(stage.start, stage.end) <= memory, stage
    # an even spread of the file's blocks over its layers places the same nodes beyond their memory
    spread = replace(spec, bytes_per_layer=-(-sum(info.layer_bytes) // N_LAYER), layer_sizes=())
    assert any(spec.stage_bytes(s.start, s.end) > memory for s in assign(nodes, spread).stages)


def test_layer_sizes_on_the_wire_must_match_the_layers() -> None:
    with pytest.raises(ValueError, match="2 layer sizes for 3 layers"):
        ModelInfo(digest="d", name="m", n_layers=3, bytes_per_layer=5, kv_bytes_per_token=0, layer_bytes=[5, 5])
    with pytest.raises(ValueError, match="largest"):
        ModelInfo(digest="d", name="m", n_layers=2, bytes_per_layer=4, kv_bytes_per_token=0, layer_bytes=[5, 3])
    with pytest.raises(ValueError):
        ModelInfo(digest="d", name="m", n_layers=2, bytes_per_layer=5, kv_bytes_per_token=0, layer_bytes=[5, -1])


def test_a_model_without_attention_has_no_kv_per_token(tmp_path: Path) -> None:
    info = describe_model(write_mamba2(tmp_path / "mamba2.gguf", N_LAYER), "d")
    assert info.kv_bytes_per_token == 0 and len(info.layer_bytes) == N_LAYER


def test_a_model_whose_layers_weigh_nothing_still_places() -> None:
    # a record's word: bytes_per_layer may be 0, which must not divide the tracker by zero
    spec = ModelSpec("m", 4, 0, head_bytes=10, tail_bytes=10)
    placed = assign([NodeCapacity("a", 100, 1e-3), NodeCapacity("b", 5, 1e-3)], spec)
    assert [(s.start, s.end) for s in placed.chain] == [(0, 4)]
