"""Route poisoning by one member (the attacker: meshd's own node signing a record that lies about
what it serves, how fast, or which model it holds), against the tracker's duty on an instant network."""

from __future__ import annotations

import pytest
from instant_net import identity, record, rng
from test_mesh_duty import MODEL, Mesh, duty

from meshd.cli.parser import build_parser
from meshd.mesh.duty import MeshDuty
from meshd.mesh.duty_events import AskAssignment, DutyConfig, LoadRange, RangeRefused
from meshd.mesh.election import ElectionConfig
from meshd.mesh.membership import SwimConfig
from meshd.mesh.node import MeshNode
from meshd.mesh.records import ModelInfo, ServedRange
from meshd.mesh.routing import DEFAULT_SECONDS_PER_LAYER, SpeedBook, plan_route, stage_options
from wire.errors import ErrorCode, ProtocolError
from wire.meshrpc import AssignmentReply

FAKE = ModelInfo(digest="sha256:made-up", name=MODEL.name, n_layers=MODEL.n_layers, bytes_per_layer=100,
                 kv_bytes_per_token=0)


def attacker(i: int, **fields: object) -> MeshDuty:
    """A member offering no memory (so it is placed nowhere) whose record says what `fields` say."""
    node = MeshNode(identity(i), record(i, reachability="public", memory_bytes=0, **fields), 0.0, SwimConfig(),
                    ElectionConfig(), rng(i))
    return MeshDuty(node, DutyConfig(volunteer=None))


def join(mesh: Mesh, newcomer: MeshDuty) -> None:
    """`newcomer` joins a running mesh through its tracker (after the election: it is no candidate)."""
    mesh.net.add(newcomer)
    mesh.duties[newcomer.node_id] = newcomer
    mesh.seen[newcomer.node_id] = []
    newcomer.node.join(mesh.net.now, [mesh.tracker.node_id])


def dial(record: object) -> str:
    return "10.0.0.1:7400"


def test_a_member_declaring_every_layer_at_a_made_up_speed_gets_no_route() -> None:
    liar = attacker(9, models=[MODEL], seconds_per_layer=1e-9,
                    served=[ServedRange(model=MODEL.digest, start=0, end=MODEL.n_layers)])
    duties = [duty(i) for i in range(3)]
    mesh = Mesh(*duties)
    mesh.run_until(10.0)
    join(mesh, liar)
    mesh.run_until(20.0)
    tracker = mesh.tracker
    route = tracker.route(MODEL.digest, (), dial)
    assert liar.node_id not in [stage.node_id for stage in route.stages]
    placed = tracker.assignments[MODEL.digest].ranges()
    assert {(s.node_id, s.start, s.end) for s in route.stages} <= {(n, *r) for n, r in placed.items()}
    # Any member planning from its records alone would have used the liar; its speed is not believed
    # either: unmeasured, it counts at the default, as the honest members do.
    view = tracker.node.membership.live_records()
    believed = next(o for o in stage_options(view, MODEL.digest) if o.node_id == liar.node_id)
    assert believed.seconds_per_layer == DEFAULT_SECONDS_PER_LAYER


def test_an_unmeasured_speed_self_report_counts_only_where_it_is_slower_than_the_default() -> None:
    served = [ServedRange(model="m", start=0, end=4)]
    records = [record(1, seconds_per_layer=1e-3, served=served), record(2, seconds_per_layer=2e-3, served=served),
               record(3, seconds_per_layer=1e-9, served=served)]
    speeds = {o.node_id: o.seconds_per_layer for o in stage_options(records, "m")}
    assert speeds[records[2].node_id] == DEFAULT_SECONDS_PER_LAYER
    assert speeds[records[0].node_id] == 1e-3 and speeds[records[1].node_id] == 2e-3



def test_a_measured_speed_wins_over_a_self_report() -> None:
    served = [ServedRange(model="m", start=0, end=4)]
    # Two replicas of the whole model: the liar says it is a thousand times faster than it measured.
    honest, liar = record(1, seconds_per_layer=1e-3, served=served), record(2, seconds_per_layer=1e-6, served=served)
    speeds = SpeedBook()
    for seconds in (4.1e-3, 3.9e-3, 4.0e-3):
        speeds.observe(honest.node_id, 4, seconds)  # 1e-3 s/layer, as it says
    for seconds in (8.0e-3, 8.2e-3, 1e-9, 7.9e-3):  # 2e-3 s/layer, and one sample nobody can run at
        speeds.observe(liar.node_id, 4, seconds)
    believed = {o.node_id: o.seconds_per_layer for o in stage_options([honest, liar], "m", speeds=speeds)}
    assert believed[liar.node_id] == pytest.approx(2e-3, rel=0.05)
    assert believed[honest.node_id] == pytest.approx(1e-3, rel=0.05)
    route = plan_route(stage_options([honest, liar], "m", speeds=speeds), 4)
    assert route.node_ids == (honest.node_id,)
    # Unmeasured, the liar's report buys nothing: both count at the default.
    assert {o.seconds_per_layer for o in stage_options([honest, liar], "m")} == {DEFAULT_SECONDS_PER_LAYER}


def test_the_speed_book_takes_only_sane_samples_and_holds_a_bounded_number_of_members() -> None:
    speeds = SpeedBook(samples=4, members=3)
    for bad in (float("nan"), float("inf"), -1.0):
        speeds.observe("a", 4, bad)
    speeds.observe("a", 0, 1.0)
    assert speeds.measured("a") is None
    for name in "abcd":
        speeds.observe(name, 2, 2e-3)
    assert speeds.measured("a") is None and speeds.measured("d") == pytest.approx(1e-3)
    for seconds in (1.0, 1.0, 1.0, 1.0, 2e-3, 2e-3, 2e-3):
        speeds.observe("b", 2, seconds)
    assert speeds.measured("b") == pytest.approx(1e-3)  # the last 4 samples: old ones age out


def test_a_made_up_digest_under_the_real_name_never_takes_the_default_ask() -> None:
    impostor = attacker(9, models=[FAKE], served=[ServedRange(model=FAKE.digest, start=0, end=FAKE.n_layers)])
    duties = [duty(i) for i in range(2)]
    mesh = Mesh(*duties)
    mesh.run_until(10.0)
    join(mesh, impostor)
    mesh.run_until(20.0)
    asked = mesh.volunteers[0] if mesh.volunteers[0] is not impostor else mesh.volunteers[1]
    with pytest.raises(ProtocolError) as caught:
        asked.route(None, (), dial)
    assert caught.value.code is ErrorCode.BAD_REQUEST
    assert MODEL.digest in str(caught.value) and FAKE.digest in str(caught.value)
    with pytest.raises(ProtocolError, match="2 models are named"):
        asked.route(MODEL.name, (), dial)
    route = asked.route(MODEL.digest, (), dial)
    assert route.model == MODEL.digest and impostor.node_id not in [s.node_id for s in route.stages]
    with pytest.raises(ProtocolError, match="no member holds model nonesuch"):
        asked.route("nonesuch", (), dial)


def test_with_one_model_in_the_mesh_it_is_the_default_and_its_name_works() -> None:
    duties = [duty(i) for i in range(2)]
    mesh = Mesh(*duties)
    mesh.run_until(10.0)
    assert mesh.tracker.route(None, (), dial).model == MODEL.digest
    assert mesh.tracker.route(MODEL.name, (), dial).model == MODEL.digest


def test_ask_takes_the_model_by_name_or_digest() -> None:
    parser = build_parser()
    assert parser.parse_args(["ask", "--model", MODEL.digest, "hi"]).model == MODEL.digest
    assert parser.parse_args(["ask", "hi"]).model is None
    with pytest.raises(SystemExit):
        parser.parse_args(["ask", "--model", "x" * 129, "hi"])


def test_a_volunteer_ignores_an_assignment_from_another_term_or_a_tracker_it_does_not_follow() -> None:
    duties = [duty(i) for i in range(2)]
    mesh = Mesh(*duties)
    mesh.answer_asks = False
    mesh.run_until(10.0)
    volunteer = mesh.volunteers[0]
    (ask,) = mesh.of(volunteer, AskAssignment)
    # An answer naming a term the followed tracker does not hold (as a hijacker's would): refused.
    volunteer.assignment_reply(mesh.net.now, AssignmentReply(term=ask.tracker.term + 7, model=MODEL.digest,
                                                             start=0, end=4))
    assert volunteer.wanted is None and not mesh.of(volunteer, LoadRange)
    assert any("not the tracker followed" in e.reason for e in volunteer.events() if isinstance(e, RangeRefused))
    # Unasked answers are dropped outright.
    volunteer.assignment_reply(mesh.net.now, AssignmentReply(term=ask.tracker.term, model=MODEL.digest,
                                                             start=0, end=4))
    assert volunteer.wanted is None
