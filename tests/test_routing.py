"""Route planning over served stages."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from instant_net import record

from meshd.mesh.records import ServedRange
from meshd.mesh.routing import NoRouteError, StageOption, plan_route, stage_options


def stage(node: str, start: int, end: int, speed: float = 0.01, load: float = 0.0) -> StageOption:
    return StageOption(node, start, end, speed, load)


def test_a_chain_that_meets_end_to_end() -> None:
    route = plan_route([stage("c", 20, 32), stage("a", 0, 10), stage("b", 10, 20)], 32)
    assert route.node_ids == ("a", "b", "c")
    assert route.seconds == pytest.approx(32 * 0.01)


def test_the_faster_and_less_loaded_replica_wins() -> None:
    stages = [stage("a", 0, 16), stage("b1", 16, 32, 0.02), stage("b2", 16, 32, 0.01)]
    assert plan_route(stages, 32).node_ids == ("a", "b2")
    busy = [stage("a", 0, 16), stage("b1", 16, 32, 0.02), stage("b2", 16, 32, 0.01, load=1.5)]
    assert plan_route(busy, 32).node_ids == ("a", "b1")


def test_link_latency_counts_from_the_asker_and_between_stages() -> None:
    stages = [stage("near", 0, 16), stage("far", 0, 16), stage("tail", 16, 32)]
    rtts = {("me", "near"): 0.001, ("me", "far"): 0.050, ("near", "tail"): 0.100, ("far", "tail"): 0.001}

    def rtt(a: str | None, b: str) -> float:
        return rtts.get((a, b), 0.0)

    route = plan_route(stages, 32, rtt=rtt, asker="me")
    # near costs 0.001 + 0.100 in links, far 0.050 + 0.001.
    assert route.node_ids == ("far", "tail")
    assert route.seconds == pytest.approx(32 * 0.01 + 0.051)


def test_fewer_hops_win_when_compute_is_equal() -> None:
    stages = [stage("whole", 0, 32), stage("a", 0, 16), stage("b", 16, 32)]
    route = plan_route(stages, 32, rtt=lambda a, b: 0.0 if a is None else 0.002)
    assert route.node_ids == ("whole",)


def test_failover_excludes_the_dead_stage() -> None:
    stages = [stage("a", 0, 10), stage("mid", 10, 20), stage("mid-replica", 10, 20, 0.02), stage("c", 20, 32)]
    assert plan_route(stages, 32).node_ids == ("a", "mid", "c")
    assert plan_route(stages, 32, exclude={"mid"}).node_ids == ("a", "mid-replica", "c")


def test_overlapping_ranges_must_still_meet_exactly() -> None:
    stages = [stage("a", 0, 12), stage("b", 10, 32), stage("c", 12, 32, 0.05)]
    assert plan_route(stages, 32).node_ids == ("a", "c")
    with pytest.raises(NoRouteError, match="nothing served continues from layer 12"):
        plan_route([stage("a", 0, 12), stage("b", 10, 32)], 32)
    with pytest.raises(NoRouteError, match="without 1 excluded node"):
        plan_route(stages, 32, exclude={"c"})


def test_any_node_plans_from_the_records_in_its_view() -> None:
    records = [
        # unmeasured, its word counts only where it says it is slower than the default
        record(1, seconds_per_layer=0.006, served=[ServedRange(model="m", start=0, end=20)]),
        record(2, seconds_per_layer=0.0, load=0.5, served=[ServedRange(model="m", start=20, end=30)]),
        record(3, served=[ServedRange(model="other", start=0, end=30)]),
        record(4, leaving=True, served=[ServedRange(model="m", start=0, end=30)]),
    ]
    options = stage_options(records, "m", default_seconds_per_layer=0.004)
    assert options == [
        StageOption(records[0].node_id, 0, 20, 0.006, 0.0),
        StageOption(records[1].node_id, 20, 30, 0.004, 0.5),
    ]
    assert plan_route(options, 30).seconds == pytest.approx(20 * 0.006 + 10 * 0.004 * 1.5)


def brute_force(stages: list[StageOption], n: int, rtt, asker: str) -> float:
    best = float("inf")
    for k in range(1, len(stages) + 1):
        for chain in itertools.permutations(stages, k):
            if chain[0].start != 0 or chain[-1].end != n:
                continue
            if any(a.end != b.start for a, b in zip(chain, chain[1:], strict=False)):
                continue
            cost = sum(s.compute_seconds for s in chain) + rtt(asker, chain[0].node_id)
            cost += sum(rtt(a.node_id, b.node_id) for a, b in zip(chain, chain[1:], strict=False) if a.node_id != b.node_id)
            best = min(best, cost)
    return best


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 5),
            st.integers(1, 3),
            st.sampled_from("abcde"),
            st.floats(0.001, 0.02),
            st.floats(0, 2),
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(0, 2**32),
)
def test_property_the_route_is_the_cheapest_chain(raw, seed) -> None:
    n = 6
    stages = [
        stage(node, start, min(start + length, n), speed, load)
        for start, length, node, speed, load in raw
        if start < n
    ]

    def rtt(a: str | None, b: str) -> float:
        return ((ord(a[0]) * 31 + ord(b[0]) * 7 + seed) % 97) / 1000

    best = brute_force(stages, n, rtt, "me")
    try:
        route = plan_route(stages, n, rtt=rtt, asker="me", max_arrivals=len(stages) + 1)
    except NoRouteError:
        assert best == float("inf")
        return
    assert route.seconds == pytest.approx(best)
