"""The speeds routes and placements count, sans-IO: what the tracker timed wins over what a member
says, a member not timed yet counts at a conservative default, the route in use is kept over noise
(hysteresis), and the view `meshd status` shows says where each figure came from."""

from __future__ import annotations

import random

import pytest
from instant_net import record

from meshd.mesh.records import ModelInfo, ServedRange
from meshd.mesh.routing import (
    DECLARED,
    DEFAULT,
    DEFAULT_SECONDS_PER_LAYER,
    OWN,
    PROBED,
    ROUTE_MARGIN,
    SpeedBook,
    believe,
    plan_route,
    route_key,
    stage_options,
)
from meshd.mesh.status import stage_speeds
from wire.meshrpc import MAX_SECONDS_PER_LAYER

LAYERS = 8
WHOLE = [ServedRange(model="m", start=0, end=LAYERS)]


def timed(speeds: SpeedBook, node_id: str, seconds_per_layer: float, times: int = 1) -> None:
    for _ in range(times):
        speeds.observe(node_id, LAYERS, seconds_per_layer * LAYERS)


def test_each_figure_says_where_it_came_from_and_no_word_makes_a_member_faster() -> None:
    speeds = SpeedBook()
    timed(speeds, "probed", 5e-4, times=3)
    timed(speeds, "slow", 2e-3)
    reported = {"probed": 1e-9, "slow": 0.0, "liar": 1e-9, "modest": 5e-3, "silent": 0.0, "me": 2e-4}
    got = believe(reported, speeds, own="me")
    # timed: the time measured, whatever it says (1e-9), with how many probes it is the median of
    assert (got["probed"].seconds_per_layer, got["probed"].source, got["probed"].samples) == (
        pytest.approx(5e-4), PROBED, 3)
    # not timed: the conservative default, the slowest timed figure (2e-3) and the route margin, where
    # that is slower than the default: a word of 1e-9 buys nothing, and no untimed member even ties a
    # timed one
    untimed = 2e-3 * (1 + ROUTE_MARGIN)
    assert (got["liar"].seconds_per_layer, got["liar"].source) == (pytest.approx(untimed), DEFAULT)
    assert (got["silent"].seconds_per_layer, got["silent"].source) == (pytest.approx(untimed), DEFAULT)
    # a word against itself (slower than that default) counts
    assert (got["modest"].seconds_per_layer, got["modest"].source) == (5e-3, DECLARED)
    # the planner itself: its own figure (it does not probe itself)
    assert (got["me"].seconds_per_layer, got["me"].source) == (2e-4, OWN)
    # nothing timed: the default itself
    assert believe({"liar": 1e-9}, SpeedBook())["liar"].seconds_per_layer == DEFAULT_SECONDS_PER_LAYER


def test_a_declared_speed_never_wins_a_route_over_a_measured_one() -> None:
    honest, liar = record(1, served=WHOLE), record(2, seconds_per_layer=1e-9, served=WHOLE)
    speeds = SpeedBook()
    timed(speeds, honest.node_id, 9e-4)  # a little faster than the default the liar counts at
    assert plan_route(stage_options([honest, liar], "m", speeds=speeds), LAYERS).node_ids == (honest.node_id,)
    # timed too, and slow: still not the liar, however fast it says it is
    timed(speeds, liar.node_id, 0.1)
    assert plan_route(stage_options([honest, liar], "m", speeds=speeds), LAYERS).node_ids == (honest.node_id,)
    # the honest one measured slower than the default: the untimed liar counts slower still
    other = SpeedBook()
    timed(other, honest.node_id, 3e-3)
    believed = {o.node_id: o.seconds_per_layer for o in stage_options([honest, liar], "m", speeds=other)}
    assert believed[liar.node_id] == pytest.approx(3e-3 * (1 + ROUTE_MARGIN))
    assert plan_route(stage_options([honest, liar], "m", speeds=other), LAYERS).node_ids == (honest.node_id,)


def test_an_untimed_stage_never_takes_a_range_from_a_timed_one_where_timed_stages_do_not_cover() -> None:
    # Three segments: the first two timed (the first slower than the second), the third served by a
    # member the tracker has not timed yet; and the liar, untimed, on the first segment, saying 1e-9.
    # Before, an untimed member counted at the fastest timed figure (1.5e-3) at least, so the liar
    # took the first segment from the timed 3e-3 stage.
    first, second, third = ([ServedRange(model="m", start=a, end=a + 4)] for a in (0, 4, 8))
    slow, fast, new = record(1, served=first), record(2, served=second), record(3, served=third)
    liar = record(4, seconds_per_layer=1e-9, served=first)
    speeds = SpeedBook()
    speeds.observe(slow.node_id, 4, 4 * 3e-3)
    speeds.observe(fast.node_id, 4, 4 * 1.5e-3)
    route = plan_route(stage_options([slow, fast, new, liar], "m", speeds=speeds), 12)
    assert route.node_ids == (slow.node_id, fast.node_id, new.node_id)


def test_the_route_in_use_is_kept_over_noise_in_the_book_and_moves_for_a_replica_past_the_margin() -> None:
    a, b = record(1, served=WHOLE), record(2, served=WHOLE)
    speeds = SpeedBook()
    rng = random.Random(3)
    timed(speeds, a.node_id, 1e-3)
    timed(speeds, b.node_id, 1.01e-3)
    kept = route_key(plan_route(stage_options([a, b], "m", speeds=speeds), LAYERS))
    assert kept == ((a.node_id, 0, LAYERS),)
    chosen, cheapest = set(), set()
    for _ in range(200):
        # one replica's sample, off by up to 20% either way: each the same speed underneath
        node = rng.choice([a, b])
        timed(speeds, node.node_id, 1e-3 * rng.uniform(0.8, 1.2))
        options = stage_options([a, b], "m", speeds=speeds)
        chosen.add(plan_route(options, LAYERS, keep=kept).node_ids)
        cheapest.add(plan_route(options, LAYERS).node_ids)
    assert chosen == {(a.node_id,)}
    assert cheapest == {(a.node_id,), (b.node_id,)}  # without the margin it would have flapped
    # b gets faster for good: once its median (of the last 8) is past the margin, the route moves
    for _ in range(8):
        timed(speeds, b.node_id, 1e-3 / (1 + ROUTE_MARGIN) * 0.9)
    assert plan_route(stage_options([a, b], "m", speeds=speeds), LAYERS, keep=kept).node_ids == (b.node_id,)


def test_the_status_view_lists_every_served_range_with_its_figure_source_and_word() -> None:
    model = ModelInfo(digest="m", name="tiny", n_layers=LAYERS, bytes_per_layer=1, kv_bytes_per_token=0)
    halves = [ServedRange(model="m", start=0, end=4), ServedRange(model="m", start=4, end=8)]
    honest = record(1, models=[model], served=halves)
    liar = record(2, models=[model], seconds_per_layer=1e-9, served=WHOLE)
    # a word past anything the reply carries is cut to its bound, not refused
    huge = record(3, models=[model], seconds_per_layer=1e12, served=WHOLE)
    gone = record(4, models=[model], leaving=True, served=WHOLE)
    speeds = SpeedBook()
    timed(speeds, honest.node_id, 4e-4, times=2)
    view = {(s.node_id, s.start, s.end): s for s in stage_speeds([honest, liar, huge, gone], speeds, None)}
    assert set(view) == {(honest.node_id, 0, 4), (honest.node_id, 4, 8), (liar.node_id, 0, LAYERS),
                         (huge.node_id, 0, LAYERS)}
    first = view[honest.node_id, 0, 4]
    assert (first.seconds_per_layer, first.source, first.samples, first.declared) == (pytest.approx(4e-4), PROBED, 2, 0.0)
    lie = view[liar.node_id, 0, LAYERS]
    assert (lie.seconds_per_layer, lie.source, lie.declared) == (DEFAULT_SECONDS_PER_LAYER, DEFAULT, 1e-9)
    big = view[huge.node_id, 0, LAYERS]
    assert (big.seconds_per_layer, big.source, big.declared) == (MAX_SECONDS_PER_LAYER, DECLARED, MAX_SECONDS_PER_LAYER)
    # with a placement (the tracker's), only the ranges placed: a claim beyond it is in no route
    placed = stage_speeds([honest, liar, huge], speeds, None, lambda digest: {honest.node_id: {(0, 4), (4, 8)}})
    assert [(s.node_id, s.start, s.end) for s in placed] == [(honest.node_id, 0, 4), (honest.node_id, 4, 8)]
