"""Stage speeds from real asks (meshd.mesh.traffic), sans-IO: the book's rules (a stage's word about
itself, a quorum of weighted reporters, a rate per reporter, an age, bounds), the attribution of a
route's token time, and the tracker's routes under a stage fast for probes and slow for users, and
under one reporter lying, in virtual time (the simulation's clock; nothing sleeps)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_mesh_duty import MODEL, Mesh
from test_stage_probes import FakeStageTimings, dial, probing_tracker, replica

from meshd.client.ask import AskResult
from meshd.client.traffic import traffic_report
from meshd.mesh.duty import MeshDuty
from meshd.mesh.routing import PROBED, TRAFFIC, TRAFFIC_RATIO, SpeedBook, believe
from meshd.mesh.traffic import (
    MIN_TRAFFIC_TOKENS,
    TRAFFIC_ALLOWANCE,
    TrafficBook,
    TrafficConfig,
    attribute,
    attribute_own,
    route_charges,
)
from wire.meshrpc import TimedStage, TrafficReport
from wire.stage import StageInfo

TRACKER = "tracker"


def test_a_stage_figure_needs_a_quorum_of_reporters_and_one_reporter_moves_nothing_either_way() -> None:
    book = TrafficBook(TRACKER)
    for _ in range(100):  # one reporter, however many reports: no figure
        book.observe(0.0, "a", "stage", 1.0)
    assert book.measured("stage") is None
    # two: the lower of them, so one alone frames no stage
    book.observe(0.0, "b", "stage", 1e-3)
    assert book.measured("stage") == (pytest.approx(1e-3), 2)
    book.observe(0.0, "c", "stage", 2e-3)
    # three: the median of the reporters' own medians, the liar's 1.0 an outlier
    assert book.measured("stage") == (pytest.approx(2e-3), 3)
    # two that agree a stage is slow count (a mesh with two weighted askers beside the tracker)
    pair = TrafficBook(TRACKER)
    pair.observe(0.0, "a", "slow", 0.05)
    pair.observe(0.0, "b", "slow", 0.06)
    assert pair.measured("slow") == (pytest.approx(0.05), 2)
    # a liar shielding a slow stage (reporting it fast) does no better against two honest reporters
    shielded = TrafficBook(TRACKER)
    for reporter, figure in (("liar", 1e-9), ("b", 0.05), ("c", 0.06)):
        shielded.observe(0.0, reporter, "slow", figure)
    assert shielded.measured("slow") == (pytest.approx(0.05), 3)


def test_a_stage_report_about_itself_counts_for_nothing_and_the_trackers_own_counts_alone() -> None:
    book = TrafficBook(TRACKER)
    book.observe(0.0, "stage", "stage", 1e-9)
    assert book.measured("stage") is None
    book.observe(0.0, TRACKER, "stage", 0.05)
    book.observe(0.0, "b", "stage", 1e-3)
    book.observe(0.0, "c", "stage", 1e-3)
    # first-hand, as the tracker's probes are: it wins over what the others say
    assert book.measured("stage") == (pytest.approx(0.05), 1)
    book.observe(0.0, TRACKER, "other", float("nan"))
    book.observe(0.0, TRACKER, "other", -1.0)
    assert book.measured("other") is None


def test_reports_are_rate_limited_per_reporter_and_refill_at_the_rate() -> None:
    book = TrafficBook(TRACKER, TrafficConfig(rate=0.5, burst=3.0))
    assert [book.admit(0.0, "a") for _ in range(4)] == [True, True, True, False]
    assert book.admit(0.0, "b")  # another reporter's bucket is its own
    assert not book.admit(1.0, "a")  # half a report refilled
    assert book.admit(2.1, "a") and not book.admit(2.1, "a")
    assert [book.admit(100.0, "a") for _ in range(4)] == [True, True, True, False]  # never past the burst


def test_figures_age_out_and_every_book_is_bounded() -> None:
    book = TrafficBook(TRACKER, TrafficConfig(ttl=60.0, stages=2, per_stage=3, reporters=2))
    book.observe(0.0, TRACKER, "s1", 0.05)
    book.observe(30.0, TRACKER, "s2", 0.05)
    assert book.next_timer() == 60.0
    assert not book.expire(59.0) and book.expire(60.0)
    assert book.measured("s1") is None and book.measured("s2") is not None and book.next_timer() == 90.0
    book.observe(31.0, TRACKER, "s3", 0.05)
    book.observe(32.0, TRACKER, "s4", 0.05)  # two stages kept: the longest unreported goes
    assert book.measured("s2") is None and book.measured("s3") is not None
    for reporter in "abcd":
        book.observe(33.0, reporter, "s4", 1.0)
    assert book.measured("s4") == (pytest.approx(1.0), 3)  # three reporters a stage kept: the tracker's went first
    for reporter in "xyz":
        book.admit(0.0, reporter)
    assert len(book._buckets) == 2


def test_a_route_token_time_is_charged_to_a_stage_as_far_as_the_others_figures_do_not_explain_it() -> None:
    reference = {"head": 1e-3, "mid": 1e-3, "tail": 1e-3}.__getitem__
    route = [("head", 10), ("mid", 10), ("tail", 10)]
    # the others' 20 ms and 3 ms of links explain 23 of 0.523 s: the rest is each stage's, over its layers
    got = attribute(route, 0.523, 0.003, reference)
    assert got == {n: pytest.approx(0.05) for n in ("head", "mid", "tail")}
    # where the others' figures explain all of it, nothing (never less than nothing)
    assert attribute(route, 0.01, 0.003, reference) == {"head": 0.0, "mid": 0.0, "tail": 0.0}


def test_with_each_stages_own_signed_time_an_honest_stage_beside_a_slow_one_is_charged_its_own() -> None:
    # head 10 layers at 1 ms a layer, a slow stage of 10 layers taking 0.5 s, 3 ms of links, 20 ms of the rest
    token = 0.01 + 0.5 + 0.003 + 0.02
    honest = attribute_own([("head", 10, 0.01), ("slow", 10, 0.5)], token, 0.003, TRAFFIC_ALLOWANCE)
    assert honest == {"head": pytest.approx(1e-3), "slow": pytest.approx(0.05)}
    # the route's time alone (at the head's probed figure for the others) charged the head the slow one's wait
    assert attribute([("head", 10), ("slow", 10)], token, 0.003 + TRAFFIC_ALLOWANCE, lambda n: 1e-3)["head"] > 0.04


def test_a_stage_that_signs_less_than_it_took_is_charged_the_rest_and_its_neighbour_at_most_the_token() -> None:
    token, links = 0.01 + 0.5 + 0.003 + 0.02, 0.003
    lied = attribute_own([("head", 10, 0.01), ("liar", 10, 0.0)], token, links, TRAFFIC_ALLOWANCE)
    # it cannot lower its own figure: what it hid is charged to it (all but the allowance)
    assert lied["liar"] * 10 == pytest.approx(token - links - TRAFFIC_ALLOWANCE - 0.01)
    assert lied["liar"] * 10 >= 0.5 - TRAFFIC_ALLOWANCE
    # nor raise its honest neighbour's past what the asker waited: no more than the route's time charged it
    assert lied["head"] * 10 <= token - links
    assert lied["head"] <= attribute([("head", 10), ("liar", 10)], token, links, lambda n: 0.0)["head"]
    # a stage saying more than the token took is charged at most the token less the links (its own loss)
    assert attribute_own([("a", 5, 30.0), ("b", 5, 0.01)], 0.1, links, TRAFFIC_ALLOWANCE) == {
        "a": pytest.approx((0.1 - links) / 5), "b": pytest.approx(0.01 / 5)}


def test_a_report_is_charged_by_its_stages_own_time_only_where_every_stage_has_one() -> None:
    placed = {"h": [(0, 4)], "t": [(4, 8)]}

    def charges(owns: tuple[float | None, float | None]) -> dict[str, float] | None:
        stages = [TimedStage(node_id=n, start=a, end=b, own=o) for (n, a, b), o in zip(
            (("h", 0, 4), ("t", 4, 8)), owns, strict=True)]
        lone = TrafficReport(model=MODEL.digest, stages=stages, tokens=16, seconds_per_token=0.45)
        return route_charges(lone, placed, 8, lambda a, b: 0.0, lambda n: 1e-3)

    assert charges((0.004, 0.4)) == {"h": pytest.approx(1e-3), "t": pytest.approx(0.1)}
    # one stage's missing: the route's time at the tracker's figures, as before receipts were timed
    assert charges((0.004, None)) == charges((None, None)) == {
        n: pytest.approx((0.45 - TRAFFIC_ALLOWANCE - 4e-3) / 4) for n in "ht"}


def test_a_traffic_figure_counts_only_far_past_the_probe_figure() -> None:
    speeds = SpeedBook()
    speeds.observe("a", 1, 1e-3)
    book = TrafficBook(TRACKER)
    speeds.traffic = book
    book.observe(0.0, TRACKER, "a", 2.5e-3)  # the asks' noise (hops, sampling, a loaded box): not counted
    assert believe({"a": 0.0}, speeds)["a"] == believe({"a": 0.0}, speeds, traffic=False)["a"]
    assert believe({"a": 0.0}, speeds)["a"].source == PROBED
    book.observe(0.0, TRACKER, "a", 1e-3 * TRAFFIC_RATIO * 10)
    book.observe(0.0, TRACKER, "a", 1e-3 * TRAFFIC_RATIO * 10)
    assert believe({"a": 1e-9}, speeds)["a"].source == TRAFFIC  # slow for users: as slow as they see


def report(*nodes: str, seconds_per_token: float, tokens: int = 16) -> TrafficReport:
    return TrafficReport(model=MODEL.digest, stages=[TimedStage(node_id=n, start=0, end=MODEL.n_layers) for n in nodes],
                         tokens=tokens, seconds_per_token=seconds_per_token)


def route_of(tracker: MeshDuty) -> list[str]:
    return [s.node_id for s in tracker.route(MODEL.digest, (), dial).stages]


def timed_replicas(count: int) -> tuple[MeshDuty, list[MeshDuty], Mesh, FakeStageTimings]:
    """A probing tracker that serves nothing, and `count` replicas of the whole model, each probed
    at 1e-3 s/layer (every one of them as fast as the others for the tracker's probes)."""
    tracker = probing_tracker()
    replicas = [replica(i) for i in range(1, count + 1)]
    mesh = Mesh(tracker, *replicas)
    mesh.run_until(10.0)
    timings = FakeStageTimings(mesh, tracker, {r.node_id: 1e-3 for r in replicas})
    timings.run_until(20.0)
    assert all(tracker.speeds.measured(r.node_id) == pytest.approx(1e-3) for r in replicas)
    return tracker, replicas, mesh, timings


def test_a_stage_fast_for_probes_and_slow_for_users_loses_the_route_after_real_asks() -> None:
    tracker, replicas, mesh, timings = timed_replicas(2)
    slow = route_of(tracker)[0]  # the route in use: kept (hysteresis) while it probes as fast as the other
    other = next(r.node_id for r in replicas if r.node_id != slow)
    for _ in range(5):
        timings.run_until(mesh.net.now + 1.0)
        assert route_of(tracker) == [slow]
    # the tracker's own asks over it saw 50 ms a layer (it sleeps at every user's step)
    now = mesh.net.now
    taken = tracker.traffic_report(now, tracker.node_id, report(slow, seconds_per_token=MODEL.n_layers * 0.05))
    assert taken.taken, taken.reason
    assert route_of(tracker) == [other]
    shown = {s.node_id: s for s in tracker.speed_view().speeds}
    # charged what its wait leaves past the allowance every token has (sampling, hops: TRAFFIC_ALLOWANCE)
    charged = (MODEL.n_layers * 0.05 - TRAFFIC_ALLOWANCE) / MODEL.n_layers
    assert (shown[slow].source, shown[slow].seconds_per_layer) == (TRAFFIC, pytest.approx(charged, rel=0.01))
    assert shown[other].source == PROBED
    # its probes go on being fast; the figure stands until it ages out, then the route stays where it is
    timings.run_until(now + tracker.traffic.config.ttl + 5.0)
    assert {s.node_id: s.source for s in tracker.speed_view().speeds}[slow] == PROBED
    assert route_of(tracker) == [other]


def test_one_reporter_lying_about_a_stage_with_many_reports_does_not_move_routes() -> None:
    tracker, replicas, mesh, timings = timed_replicas(3)
    honest = route_of(tracker)[0]
    liar, third = [r.node_id for r in replicas if r.node_id != honest]  # placed: their word has weight
    taken = [tracker.traffic_report(mesh.net.now, liar, report(honest, seconds_per_token=100.0)) for _ in range(50)]
    assert taken[0].taken and not taken[-1].taken and "rate" in taken[-1].reason
    assert tracker.traffic.measured(honest) is None
    assert route_of(tracker) == [honest]
    # a member the tracker did not place and nobody credited: nothing it says is taken
    stranger = tracker.traffic_report(mesh.net.now, "0" * 64, report(honest, seconds_per_token=100.0))
    assert not stranger.taken and "neither placed nor credited" in stranger.reason
    # nor a stage's report of its own route, nor a route of ranges not placed, nor a decode too short to time
    assert tracker.traffic_report(mesh.net.now, honest, report(honest, seconds_per_token=1e-9)).taken
    assert tracker.traffic.measured(honest) is None
    assert "not a route" in tracker.traffic_report(mesh.net.now, third, report("f" * 64, seconds_per_token=1.0)).reason
    short = report(honest, seconds_per_token=100.0, tokens=MIN_TRAFFIC_TOKENS - 1)
    assert "tokens" in tracker.traffic_report(mesh.net.now, third, short).reason
    timings.run_until(mesh.net.now + 5.0)
    assert route_of(tracker) == [honest]


def test_honest_asks_with_noise_keep_the_route_in_use() -> None:
    # every ask's token time over what the probes say by the allowance and then some, and noisy: nothing moves
    tracker, replicas, mesh, timings = timed_replicas(2)
    kept = route_of(tracker)
    for k in range(40):
        timings.run_until(mesh.net.now + 2.0)  # an ask every 2 s: within the rate a reporter may report at
        noisy = TRAFFIC_ALLOWANCE + MODEL.n_layers * 1e-3 * (1.5 + (k % 5) * 0.25)
        assert tracker.traffic_report(mesh.net.now, tracker.node_id, report(*kept, seconds_per_token=noisy)).taken
        assert route_of(tracker) == kept


def test_an_ask_reports_its_route_and_decode_only_where_it_timed_one_route() -> None:
    result = AskResult(tokens=list(range(9)), first_token_at=10.0, finished_at=10.8, epochs=1,
                       route=[StageInfo(node_id=n, model_digest="m", model_name="m", layer_begin=a, layer_end=b,
                                        n_layer=8, stage_width=8, ready=True) for n, a, b in (("h", 0, 3), ("t", 3, 8))])
    seen = traffic_report(result)
    assert seen is not None and seen.tokens == 9 and seen.seconds_per_token == pytest.approx(0.1)
    assert [(s.node_id, s.start, s.end, s.own) for s in seen.stages] == [("h", 0, 3, None), ("t", 3, 8, None)]
    # a verified fast ask's receipts: each stage's signed time per position of the decode's spans
    timed = traffic_report(replace(result, own_seconds=[0.03, 0.6], own_rows=6))
    assert timed is not None and [s.own for s in timed.stages] == [pytest.approx(0.005), pytest.approx(0.1)]
    # a failover mixes two routes' times, a restarted answer two answers', and 3 tokens time no decode
    for other in ({"failovers": 1, "epochs": 2}, {"withdrawn": 4}, {"tokens": [1, 2, 3]}, {"route": []}):
        assert traffic_report(replace(result, **other)) is None, other
