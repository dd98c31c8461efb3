"""The tracker times the stages it placed (meshd.mesh.probes), and routes follow what it timed, with
hysteresis: sans-IO, the probes answered with fake timings (named so) on an instant network."""

from __future__ import annotations

import random

import pytest
from instant_net import identity, record, rng
from test_mesh_duty import MODEL, Mesh, duty

from meshd.mesh.duty import MeshDuty
from meshd.mesh.duty_events import DutyConfig
from meshd.mesh.election import ElectionConfig
from meshd.mesh.membership import SwimConfig
from meshd.mesh.node import MeshNode
from meshd.mesh.probes import ProbeConfig, Prober, ProbeResult, StageProbe, probe_seconds
from meshd.mesh.records import ServedRange
from meshd.mesh.routing import SpeedBook, plan_route, route_key, stage_options

RTT = 1e-3
FAST_PROBES = ProbeConfig(interval=1.0, retry=0.5, timeout=2.0)


def stage(name: str, start: int = 0, end: int = 8) -> StageProbe:
    return StageProbe(name, "m", start, end)


def test_a_newly_placed_stage_is_timed_at_once_then_at_most_once_an_interval_one_probe_at_a_time() -> None:
    prober = Prober(SpeedBook(), ProbeConfig(interval=30.0, retry=5.0, concurrent=1, timeout=10.0))
    a, b = stage("a"), stage("b")
    assert prober.due(0.0, [a, b]) == [a]  # one in flight, mesh-wide
    assert prober.due(1.0, [a, b]) == [] and prober.next_timer() == 20.0  # waits for it (or gives up then)
    prober.finished(2.0, a, ProbeResult(RTT, (RTT + 8e-3,) * 3))
    assert prober.due(2.0, [a, b]) == [b]
    prober.finished(3.0, b, None)  # busy or refused: no sample, tried again sooner than the interval
    assert prober.speeds.measured("a") == pytest.approx(1e-3) and prober.speeds.measured("b") is None
    assert prober.next_timer() == 8.0
    assert prober.due(7.9, [a, b]) == [] and prober.due(8.0, [a, b]) == [b]
    prober.finished(8.5, b, ProbeResult(RTT, (RTT,) * 3))
    assert prober.due(31.9, [a, b]) == [] and prober.due(32.0, [a, b]) == [a]
    # a probe whose report never comes (a lost task) is given up on after twice its timeout
    assert prober.due(51.9, [a, b]) == [] and prober.due(52.0, [a, b]) == [a]
    # a stage no longer placed is forgotten (b, due since 38.5, goes next), and its late report counts for nothing
    assert prober.due(53.0, [b]) == [b]
    prober.finished(53.0, a, ProbeResult(RTT, (1.0,) * 3))
    assert prober.speeds.measured("a") == pytest.approx(1e-3)
    assert prober.due(54.0, []) == [] and prober.next_timer() is None


def test_a_probe_counts_its_median_step_less_the_link_and_a_stall_as_the_time_it_took() -> None:
    assert probe_seconds(ProbeResult(2e-3, (5e-3, 9.0, 6e-3))) == pytest.approx(4e-3)
    assert probe_seconds(ProbeResult(2e-3, (1e-3, 1e-3))) == 0.0  # noise never makes a stage faster than free
    assert probe_seconds(ProbeResult(2e-3, (5e-3, 7.5), timed_out=True)) == 7.5
    assert probe_seconds(ProbeResult(2e-3, ())) is None
    assert probe_seconds(ProbeResult(float("nan"), (1.0,))) is None
    assert probe_seconds(ProbeResult(1e-3, (float("inf"), -1.0, 3e-3))) == pytest.approx(2e-3)


def replica(i: int, seconds_per_layer: float = 0.0) -> MeshDuty:
    """A volunteer that holds the whole model (memory 900: eight layers of 100), saying its speed."""
    fields: dict[str, object] = {"seconds_per_layer": seconds_per_layer} if seconds_per_layer else {}
    node = MeshNode(identity(i), record(i, reachability="public", started_at=float(i), memory_bytes=900,
                                        models=[MODEL], **fields), 0.0, SwimConfig(), ElectionConfig(), rng(i))
    return MeshDuty(node, DutyConfig(volunteer=MODEL, kv_tokens=1, settle=0.5, probes=FAST_PROBES))


class FakeStageTimings:
    """Answers the tracker's probes as the shell would, with made-up step times: each node's true
    seconds per layer, times a noise factor the test draws."""

    def __init__(self, mesh: Mesh, tracker: MeshDuty, per_layer: dict[str, float], noise: float = 0.0,
                 held_back: dict[str, float] | None = None) -> None:
        self.mesh, self.tracker, self.per_layer, self.noise = mesh, tracker, per_layer, noise
        # seconds a stage holds back its answer to the probe's round-trip request (a liar's trick)
        self.held_back = held_back or {}
        self.rng = random.Random(7)
        self.answered = 0

    def run_until(self, end: float) -> None:
        while self.mesh.net.now < end:
            self.mesh.run_until(min(end, self.mesh.net.now + 0.5))
            probes = [e for e in self.mesh.seen[self.tracker.node_id] if isinstance(e, StageProbe)]
            for probe in probes[self.answered:]:
                if probe.node_id not in self.per_layer:
                    # a stage that refuses every probe (or looks busy, or breaks off): no sample
                    self.tracker.probe_finished(self.mesh.net.now, probe, None)
                    continue
                # the link's round trip as SWIM measured it in the simulation (the same link the probe takes)
                swim = self.tracker.node.membership.rtt(probe.node_id)
                link = RTT if swim is None else swim
                steps = tuple(link + probe.layers * self.per_layer[probe.node_id]
                              * self.rng.uniform(1 - self.noise, 1 + self.noise) for _ in range(3))
                rtt = link + self.held_back.get(probe.node_id, 0.0)
                self.tracker.probe_finished(self.mesh.net.now, probe, ProbeResult(rtt, steps))
            self.answered = len(probes)
            self.mesh.net.flush()


def dial(record: object) -> str:
    return "10.0.0.1:7400"


def probing_tracker() -> MeshDuty:
    """A tracker that serves nothing itself and times its stages often (FAST_PROBES)."""
    return MeshDuty(MeshNode(identity(0), record(0, reachability="public", started_at=0.0, memory_bytes=0),
                             0.0, SwimConfig(), ElectionConfig(), rng(0)),
                    DutyConfig(volunteer=None, settle=0.5, probes=FAST_PROBES))


def test_a_stage_holding_back_the_probes_round_trip_does_not_look_free() -> None:
    # The probe takes its round trip off each step, and the stage answers that round trip: holding it
    # back by a step's time made the step look free (0 s/layer), and the slow liar won the route.
    tracker = probing_tracker()
    honest, liar = replica(1), replica(2, seconds_per_layer=1e-9)
    mesh = Mesh(tracker, honest, liar)
    mesh.run_until(10.0)
    swim = tracker.node.membership.rtt(liar.node_id)
    assert swim is not None and swim < 0.05
    timings = FakeStageTimings(mesh, tracker, {honest.node_id: 1e-3, liar.node_id: 5e-3},
                               held_back={liar.node_id: MODEL.n_layers * 5e-3})
    timings.run_until(20.0)
    # its SWIM round trip (which it did not slow, and which routes charge as link time) is taken off instead
    liar_timed = tracker.speeds.measured(liar.node_id)
    assert liar_timed is not None and liar_timed > 4e-3
    assert [s.node_id for s in tracker.route(MODEL.digest, (), dial).stages] == [honest.node_id]


def liar_beside_two_honest() -> tuple[MeshDuty, list[MeshDuty], MeshDuty, Mesh]:
    """Two honest volunteers that hold five layers each (a chain of two), and an attacker that holds
    the whole model and signs 1e-9 s/layer, settled for 10 s under a probing tracker."""
    tracker = probing_tracker()
    honest = [duty(i, memory=500, probes=FAST_PROBES) for i in (1, 2)]
    liar = replica(3, seconds_per_layer=1e-9)
    mesh = Mesh(tracker, *honest, liar)
    mesh.run_until(10.0)
    return tracker, honest, liar, mesh


def test_a_replica_claiming_a_made_up_speed_is_timed_slow_and_loses_the_route_to_an_honest_one() -> None:
    # The tracker (no memory: placed nowhere, so every route goes through the others), an honest
    # replica of the whole model, and the attacker: placed as a replica too, signing 1e-9 s/layer,
    # really five times slower than the honest one (as a stage sleeping at each step is).
    tracker = probing_tracker()
    honest, liar = replica(1), replica(2, seconds_per_layer=1e-9)
    mesh = Mesh(tracker, honest, liar)
    mesh.run_until(10.0)
    assert mesh.tracker is tracker
    assert set(tracker.assignments[MODEL.digest].ranges()) == {honest.node_id, liar.node_id}
    # Unmeasured, the liar's word (raised only to a quarter of the median) buys it the route.
    assert [s.node_id for s in tracker.route(MODEL.digest, (), dial).stages] == [liar.node_id]
    timings = FakeStageTimings(mesh, tracker, {honest.node_id: 1e-3, liar.node_id: 5e-3})
    timings.run_until(20.0)
    assert tracker.speeds.measured(liar.node_id) == pytest.approx(5e-3)
    assert tracker.speeds.measured(honest.node_id) == pytest.approx(1e-3)
    # the route in use moves (it costs five times the cheapest, far past the hysteresis margin)
    assert [s.node_id for s in tracker.route(MODEL.digest, (), dial).stages] == [honest.node_id]
    # each stage was timed about once a second (FAST_PROBES), one at a time: not at every step
    assert 10 <= timings.answered <= 22


def test_a_member_claiming_a_made_up_speed_draws_the_placement_only_until_it_is_timed() -> None:
    # Two honest volunteers that hold five layers each (a chain of two), and the attacker, who holds
    # the whole model and signs 1e-9 s/layer: counted at the default as the untimed honest ones are,
    # its one stage is the placement's chain; timed five times slower than them, the chain moves.
    tracker, honest, liar, mesh = liar_beside_two_honest()
    assert [s.node_id for s in tracker.assignments[MODEL.digest].chain] == [liar.node_id]
    timings = FakeStageTimings(mesh, tracker, {d.node_id: 1e-3 for d in honest} | {liar.node_id: 5e-3})
    timings.run_until(20.0)
    route = tracker.route(MODEL.digest, (), dial)
    assert {s.node_id for s in route.stages} == {d.node_id for d in honest}
    # (it keeps a replica's place: spare capacity, which the asker's spot checks may use)
    assert {s.node_id for s in tracker.assignments[MODEL.digest].chain} == {d.node_id for d in honest}


def test_a_member_that_keeps_out_of_the_probes_gets_no_route_while_timed_stages_cover_the_model() -> None:
    # As above, but the attacker answers no probe: it stays untimed, at the default (which, one stage
    # against two, would still buy it the route where nothing is timed).
    tracker, honest, liar, mesh = liar_beside_two_honest()
    assert [s.node_id for s in tracker.route(MODEL.digest, (), dial).stages] == [liar.node_id]
    timings = FakeStageTimings(mesh, tracker, {d.node_id: 1e-3 for d in honest})
    timings.run_until(20.0)
    assert tracker.speeds.measured(liar.node_id) is None
    route = tracker.route(MODEL.digest, (), dial)
    assert {s.node_id for s in route.stages} == {d.node_id for d in honest}
    believed = {o.node_id: o.seconds_per_layer for o in stage_options(
        tracker.node.membership.live_records(), MODEL.digest, speeds=tracker.speeds)}
    assert believed[liar.node_id] == pytest.approx(1.25e-3)  # the default: slower than the slowest timed
    # with the honest ones excluded (or gone) it is all there is: routes still cover the model
    assert [s.node_id for s in tracker.route(MODEL.digest, [d.node_id for d in honest], dial).stages] == \
        [liar.node_id]


def test_honest_replicas_timed_with_noise_keep_the_route_in_use() -> None:
    tracker = probing_tracker()
    a, b = replica(1), replica(2)
    mesh = Mesh(tracker, a, b)
    mesh.run_until(10.0)
    # same speed, each probe off by up to 30% either way
    timings = FakeStageTimings(mesh, tracker, {a.node_id: 1e-3, b.node_id: 1e-3}, noise=0.3)
    routes, cheapest = [], []
    for second in range(11, 71):
        timings.run_until(float(second))
        routes.append(tuple(s.node_id for s in tracker.route(MODEL.digest, (), dial).stages))
        options = stage_options(tracker.node.membership.live_records(), MODEL.digest, speeds=tracker.speeds)
        cheapest.append(plan_route(options, MODEL.n_layers).node_ids)
    assert timings.answered >= 50
    assert len(set(routes)) == 1
    # without the margin the route would have moved with the noise: the test sees what it guards
    assert len(set(cheapest)) == 2


def test_a_kept_route_goes_once_a_stage_of_it_is_excluded_gone_or_much_slower() -> None:
    served = [ServedRange(model="m", start=0, end=4)]
    one, two = record(1, seconds_per_layer=1e-3, served=served), record(2, seconds_per_layer=1.1e-3, served=served)
    options = stage_options([one, two], "m")
    kept = route_key(plan_route(options, 4))
    assert kept == ((one.node_id, 0, 4),)
    slower = stage_options([one.model_copy(update={"seconds_per_layer": 1.2e-3}), two], "m")
    assert plan_route(slower, 4, keep=kept).node_ids == (one.node_id,)  # within the margin
    assert plan_route(slower, 4, keep=kept, margin=0.0).node_ids == (two.node_id,)
    much = stage_options([one.model_copy(update={"seconds_per_layer": 2e-3}), two], "m")
    assert plan_route(much, 4, keep=kept).node_ids == (two.node_id,)
    assert plan_route(options, 4, keep=kept, exclude=[one.node_id]).node_ids == (two.node_id,)
    assert plan_route(stage_options([two], "m"), 4, keep=kept).node_ids == (two.node_id,)
    # a kept route that does not tile the layers (a range moved) is not one
    assert plan_route(options, 4, keep=((one.node_id, 0, 2),)).node_ids == (one.node_id,)


def test_a_member_that_is_never_timed_is_believed_no_faster_than_the_slowest_timed_one() -> None:
    served = [ServedRange(model="m", start=0, end=4)]
    timed, shy = record(1, seconds_per_layer=1e-3, served=served), record(2, seconds_per_layer=1e-9, served=served)
    slow = record(3, served=served)
    speeds = SpeedBook()
    speeds.observe(timed.node_id, 4, 2e-3)  # 5e-4 s/layer: faster than the default
    believed = {o.node_id: o.seconds_per_layer for o in stage_options([timed, shy], "m", speeds=speeds)}
    assert believed[timed.node_id] == pytest.approx(5e-4)  # measured: its own word (1e-3) does not count
    assert believed[shy.node_id] == pytest.approx(1e-3)  # the default, not its 1e-9
    speeds.observe(slow.node_id, 4, 8e-3)  # 2e-3 s/layer: slower than the default
    believed = {o.node_id: o.seconds_per_layer for o in stage_options([timed, shy, slow], "m", speeds=speeds)}
    assert believed[shy.node_id] == pytest.approx(2.5e-3)  # the slowest timed, and the route margin
