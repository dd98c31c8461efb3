"""Layer range assignment: coverage, memory, rebalancing."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from instant_net import record

from meshd.mesh.assignment import (
    Assignment,
    AssignmentPolicy,
    CoverageError,
    ModelSpec,
    NodeCapacity,
    capacities,
    held_ranges,
    unheld_layers,
)
from meshd.mesh.placement import assign
from meshd.mesh.records import ROLE_CLIENT, HeldRange, ModelInfo

GB = 2**30
# 32 layers of 0.5 GiB (+ 0.1 GiB of KV each), a 1 GiB embedding and a 1 GiB output head.
MODEL = ModelSpec("m", 32, GB // 2, kv_bytes_per_layer=GB // 10, head_bytes=GB, tail_bytes=GB)


def node(name: str, memory_gib: float, seconds_per_layer: float = 0.01) -> NodeCapacity:
    return NodeCapacity(name, int(memory_gib * GB), seconds_per_layer)


def segments(assignment: Assignment) -> list[tuple[int, int]]:
    return list(zip(assignment.boundaries, assignment.boundaries[1:], strict=False))


def check_valid(assignment: Assignment, nodes: list[NodeCapacity], model: ModelSpec) -> None:
    """Every layer covered by a chain; every stage within a segment and within its node's memory."""
    memory = {n.node_id: n.memory_bytes for n in nodes}
    assert assignment.boundaries[0] == 0 and assignment.boundaries[-1] == model.n_layers
    assert len({stage.node_id for stage in assignment.stages}) == len(assignment.stages)
    for stage in assignment.stages:
        assert model.stage_bytes(stage.start, stage.end) <= memory[stage.node_id]
        assert any(s <= stage.start < stage.end <= e for s, e in segments(assignment))
    # The fastest chain is made of assigned stages and meets end to end over every layer.
    assert set(assignment.chain) <= set(assignment.stages)
    assert [s.start for s in assignment.chain] == [0] + [s.end for s in assignment.chain[:-1]]
    assert assignment.chain[-1].end == model.n_layers


def test_a_model_that_fits_one_node_gets_one_stage_per_node() -> None:
    nodes = [node("a", 64), node("b", 64)]
    result = assign(nodes, MODEL)
    check_valid(result, nodes, MODEL)
    assert result.boundaries == (0, 32)
    assert sorted(result.ranges().values()) == [(0, 32), (0, 32)]  # the second is a full replica


def test_every_layer_is_covered_and_memory_respected_across_small_nodes() -> None:
    nodes = [node(f"n{i}", 8) for i in range(6)]  # 8 GiB hold at most 13 layers, fewer with head/tail
    result = assign(nodes, MODEL)
    check_valid(result, nodes, MODEL)
    assert len(segments(result)) == 3
    assert sum(e - s for s, e in segments(result)) == 32
    # Six nodes, three segments: each segment gets a replica.
    hosts = Counter((stage.start, stage.end) for stage in result.stages)
    assert all(hosts[segment] == 2 for segment in segments(result))


def test_faster_nodes_get_more_layers() -> None:
    nodes = [node("slow", 16, 0.02), node("fast", 16, 0.005)]
    result = assign(nodes, MODEL)
    ranges = result.ranges()
    layers = {name: end - start for name, (start, end) in ranges.items()}
    assert layers["fast"] > layers["slow"]
    # The fast node is filled to what its memory allows: 16 GiB less the head or tail, at 0.6 GiB a layer.
    assert layers["fast"] == int((16 - 1) / 0.6)


def test_fewer_stages_are_preferred_when_hops_cost_more_than_they_save() -> None:
    big_slow = node("big", 40, 0.0105)
    small_fast = [node(f"s{i}", 6, 0.010) for i in range(6)]
    cheap_hops = assign([big_slow, *small_fast], MODEL, AssignmentPolicy(hop_seconds=0.0))
    assert len(segments(cheap_hops)) > 1
    dear_hops = assign([big_slow, *small_fast], MODEL, AssignmentPolicy(hop_seconds=0.01))
    assert dear_hops.boundaries == (0, 32) and dear_hops.stages[0].node_id == "big"


def test_spare_capacity_becomes_replicas_of_the_weakest_segment() -> None:
    primary = [node("a", 12, 0.005), node("b", 12, 0.005)]
    base = assign(primary, MODEL)
    assert len(segments(base)) == 2
    longest = max(segments(base), key=lambda segment: segment[1] - segment[0])
    one_more = assign(primary + [node("x", 12, 0.01)], MODEL)
    assert one_more.boundaries == base.boundaries
    assert one_more.ranges()["x"] == longest  # the segment with the least throughput
    two_more = assign(primary + [node("x", 12, 0.01), node("y", 12, 0.01)], MODEL)
    check_valid(two_more, primary + [node("x", 12), node("y", 12)], MODEL)
    assert Counter(two_more.ranges().values()) == {segment: 2 for segment in segments(base)}


def test_nodes_too_small_for_a_segment_cover_it_together() -> None:
    big = [node("big", 40, 0.001)]  # hosts everything alone, so the segment is the whole model
    small = [node(f"s{i}", 6, 0.01) for i in range(8)]
    result = assign(big + small, MODEL)
    check_valid(result, big + small, MODEL)
    group = [stage for stage in result.stages if stage.node_id != "big"]
    assert len(group) == len(small)
    # Six GiB hold at most ten layers: the small nodes form chains of four over [0, 32), each one
    # a full replica of the big node, with layers spread evenly.
    starts = Counter(stage.start for stage in group)
    ends = Counter(stage.end for stage in group)
    assert starts[0] == 2 and ends[32] == 2
    assert all(starts[boundary] == ends[boundary] for boundary in set(starts) - {0})
    assert max(stage.layers for stage in group) - min(stage.layers for stage in group) <= 1


def test_a_node_listed_twice_gets_one_range() -> None:
    twice = [node("a", 64, 0.001), node("a", 64, 0.001), node("b", 64)]
    result = assign(twice, MODEL)
    assert sorted(stage.node_id for stage in result.stages) == ["a", "b"]


def test_unmeasured_nodes_count_as_typical() -> None:
    nodes = [node("a", 16, 0.01), node("b", 16, 0.03), node("new", 16, 0.0)]
    result = assign(nodes, MODEL)
    check_valid(result, nodes, MODEL)


def test_a_model_too_big_for_the_mesh_is_a_clear_error() -> None:
    with pytest.raises(
        CoverageError, match=r"needs 18\.0 GiB of weights \+ 3\.2 GiB of KV but the 2 volunteers offer 2 × 8\.0 GiB"
    ):
        assign([node("a", 8), node("b", 8)], MODEL)
    with pytest.raises(CoverageError, match="no member volunteers the model"):
        assign([], MODEL)
    # Plenty of memory in total, but no node can take the 1 GiB embedding along with a layer.
    with pytest.raises(CoverageError, match="none of which holds the first stage"):
        assign([node(f"n{i}", 1.5) for i in range(40)], MODEL)


def test_capacities_come_from_the_records_of_nodes_holding_the_model() -> None:
    info = ModelInfo(digest="m", name="m", n_layers=32, bytes_per_layer=GB // 2, kv_bytes_per_token=10)
    records = [
        record(1, memory_bytes=8 * GB, seconds_per_layer=0.01, models=[info]),
        record(2, memory_bytes=8 * GB, models=[]),
        record(3, memory_bytes=8 * GB, models=[info], roles=[ROLE_CLIENT]),
        record(4, memory_bytes=8 * GB, models=[info], leaving=True),
    ]
    assert capacities(records, "m") == [NodeCapacity(records[0].node_id, 8 * GB, 0.01, holds=((0, 32),))]
    spec = ModelSpec.from_info(info, kv_tokens=4096)
    assert spec.kv_bytes_per_layer == 40960 and spec.n_layers == 32


def test_rebalancing_on_join_keeps_every_range_and_adds_a_replica() -> None:
    nodes = [node(f"n{i}", 8, 0.01) for i in range(3)]
    before = assign(nodes, MODEL)
    after = assign(nodes + [node("joiner", 8, 0.01)], MODEL, current=before)
    assert after.boundaries == before.boundaries
    assert set(before.ranges().items()) <= set(after.ranges().items())
    assert "joiner" in after.ranges()


def test_rebalancing_on_leave_replaces_only_the_departed_host() -> None:
    nodes = [node(f"n{i}", 8, 0.01) for i in range(3)] + [node("spare", 16, 0.01)]
    before = assign(nodes[:3], MODEL)
    departed = before.stages[1]
    remaining = [n for n in nodes if n.node_id != departed.node_id]
    after = assign(remaining, MODEL, current=before)
    check_valid(after, remaining, MODEL)
    assert after.boundaries == before.boundaries
    assert after.ranges()["spare"] == (departed.start, departed.end)
    for stage in before.stages:
        if stage.node_id != departed.node_id:
            assert after.ranges()[stage.node_id] == (stage.start, stage.end)


def test_a_departed_hosts_segment_goes_to_a_spare_that_holds_its_layers_before_one_that_would_fetch() -> None:
    nodes = [node(f"n{i}", 8, 0.01) for i in range(3)]
    before = assign(nodes, MODEL)
    departed = before.stages[1]
    segment = (departed.start, departed.end)
    # two alike spares: the one first in line would have to fetch the segment, the other fetched it earlier
    fetcher = node("fetcher", 16, 0.01)
    holder = NodeCapacity("holder", 16 * GB, 0.01, holds=((0, 2), (segment[0], segment[1] + 1)))
    remaining = [n for n in nodes if n.node_id != departed.node_id] + [fetcher, holder]
    after = assign(remaining, MODEL, current=before)
    check_valid(after, remaining, MODEL)
    assert after.ranges()["holder"] == segment
    # with nothing held the first in line gets it
    plain = [n for n in remaining if n.node_id != "holder"] + [node("holder", 16, 0.01)]
    assert assign(plain, MODEL, current=before).ranges()["fetcher"] == segment


def test_only_layers_some_member_holds_on_disk_can_be_placed() -> None:
    info = ModelInfo(digest="m", name="m", n_layers=8, bytes_per_layer=1, kv_bytes_per_token=0)
    fetching = info.model_copy(update={"whole": False})
    holds = [HeldRange(model="m", start=0, end=3), HeldRange(model="m", start=5, end=6),
             HeldRange(model="other", start=0, end=8)]
    records = [record(1, models=[fetching], holds=holds), record(2, models=[fetching]),
               record(3, models=[fetching], holds=[HeldRange(model="m", start=2, end=4)], leaving=True)]
    assert held_ranges(records[0], "m") == ((0, 3), (5, 6)) and held_ranges(records[1], "m") == ()
    assert unheld_layers(records, "m", 8) == [(3, 5), (6, 8)]
    assert unheld_layers([*records, record(4, models=[info])], "m", 8) == []
    assert [c.holds for c in capacities(records, "m")] == [((0, 3), (5, 6)), ()]


def test_a_much_faster_newcomer_triggers_a_fresh_plan() -> None:
    nodes = [node(f"n{i}", 8, 0.02) for i in range(3)]
    before = assign(nodes, MODEL)
    rocket = node("rocket", 64, 0.001)
    after = assign(nodes + [rocket], MODEL, current=before)
    assert after.boundaries == (0, 32) and after.stages[0].node_id == "rocket"


@st.composite
def meshes(draw):
    n_layers = draw(st.integers(1, 48))
    model = ModelSpec(
        "m",
        n_layers,
        draw(st.integers(1, 4)) * GB // 4,
        kv_bytes_per_layer=draw(st.integers(0, 4)) * GB // 16,
        head_bytes=draw(st.integers(0, 4)) * GB // 4,
        tail_bytes=draw(st.integers(0, 4)) * GB // 4,
    )
    nodes = [
        NodeCapacity(
            f"n{i}", draw(st.integers(1, 64)) * GB // 4, draw(st.sampled_from([0.0, 0.001, 0.004, 0.01]))
        )
        for i in range(draw(st.integers(1, 30)))
    ]
    return model, nodes


# One layer, an embedding no node holds together with the output head and a
# layer: a cover must not split that layer into an empty stage and a full one.
ONE_LAYER = ModelSpec("m", 1, GB // 4, kv_bytes_per_layer=0, head_bytes=GB, tail_bytes=GB // 4)


@settings(max_examples=60, deadline=None)
@given(meshes())
@example((ONE_LAYER, [NodeCapacity("n0", GB // 2, 0.0), NodeCapacity("n1", 5 * GB // 4, 0.0)]))
@example((ONE_LAYER, [NodeCapacity("n0", GB // 2, 0.0), NodeCapacity("n1", 5 * GB // 4, 0.0),
                      NodeCapacity("n2", 3 * GB // 2, 0.0)]))
def test_property_assignments_cover_every_layer_within_memory(case) -> None:
    model, nodes = case
    # If every node could carry both the embedding and the output head and still hold enough
    # layers between them, a cover certainly exists and must be found.
    extras = model.head_bytes + model.tail_bytes
    easy = sum(max(0, n.memory_bytes - extras) // model.layer_bytes for n in nodes) >= model.n_layers
    try:
        result = assign(nodes, model)
    except CoverageError as error:
        assert not easy
        assert "the model needs" in str(error) and "--memory" in str(error)
        return
    check_valid(result, nodes, model)
