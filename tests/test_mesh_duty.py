"""The tracker's and the volunteer's duties (`MeshDuty`), driven by hand at explicit times, without trio."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from instant_net import InstantNet, identity, record, rng

from meshd.mesh.duty import MeshDuty
from meshd.mesh.duty_events import AskAssignment, AssignmentChanged, DutyConfig, DutyEvent, LoadRange, RangeRefused
from meshd.mesh.election import ElectionConfig
from meshd.mesh.membership import SwimConfig
from meshd.mesh.node import MeshNode
from meshd.mesh.records import HeldRange, ModelInfo, ServedRange
from wire.errors import ErrorCode, ProtocolError
from wire.meshrpc import AssignmentReply

# eight layers of 100 bytes: a 500-byte node holds five, so a copy takes two of them
MODEL = ModelInfo(digest="sha256:m", name="m", n_layers=8, bytes_per_layer=100, kv_bytes_per_token=0)
SETTLE = 0.5


def duty(i: int, memory: int = 500, **config: object) -> MeshDuty:
    node = MeshNode(identity(i), record(i, reachability="public", started_at=float(i), memory_bytes=memory,
                                        models=[MODEL]), 0.0, SwimConfig(), ElectionConfig(), rng(i))
    settings: dict[str, object] = {"volunteer": MODEL, "kv_tokens": 1, "settle": SETTLE} | config
    return MeshDuty(node, DutyConfig(**settings))  # type: ignore[arg-type]


class Mesh:
    """Duties on an instant network; asks are answered and loads finish at once unless held back."""

    def __init__(self, *duties: MeshDuty) -> None:
        self.duties = {d.node_id: d for d in duties}
        self.net = InstantNet(*duties)
        self.seen: dict[str, list[DutyEvent]] = {d.node_id: [] for d in duties}
        self.answer_asks = True
        self.finish_loads = True
        for d in duties[1:]:
            d.node.join(0.0, [duties[0].node_id])

    def run_until(self, end: float) -> None:
        while True:
            self.net.run_until(min(end, self.net.now + 0.1))
            self.act()
            if self.net.now >= end:
                return

    def act(self) -> None:
        now = self.net.now
        for d in self.duties.values():
            for event in d.events():
                self.seen[d.node_id].append(event)
                if isinstance(event, AskAssignment) and self.answer_asks:
                    # As the daemon's rpc does: a tracker that does not see its own election carried
                    # yet (its votes still on their way) answers NOT_FOUND, and the ask failed.
                    try:
                        reply: AssignmentReply | None = self.duties[event.tracker.node_id].assignment_for(d.node_id)
                    except ProtocolError:
                        reply = None
                    d.assignment_reply(now, reply)
                elif isinstance(event, LoadRange) and self.finish_loads:
                    d.range_loaded(now, event.start, event.end)
        self.net.flush()

    @property
    def tracker(self) -> MeshDuty:
        """The elected tracker (all start together, so the lowest node id wins: uptime is as observed)."""
        (tracker,) = [d for d in self.duties.values() if d.is_tracker]
        return tracker

    @property
    def volunteers(self) -> list[MeshDuty]:
        return [d for d in self.duties.values() if not d.is_tracker]

    def of(self, d: MeshDuty, kind: type) -> list[DutyEvent]:
        return [e for e in self.seen[d.node_id] if isinstance(e, kind)]


def served(d: MeshDuty) -> list[tuple[int, int]]:
    return [(s.start, s.end) for s in d.node.record.served]


def tiles(ranges: Iterable[tuple[int, int]], n: int) -> bool:
    reach = {0}
    for start, end in sorted(ranges):
        if start in reach:
            reach.add(end)
    return n in reach


def test_the_tracker_places_the_model_and_every_volunteer_loads_and_publishes_its_range() -> None:
    duties = [duty(i) for i in range(4)]
    mesh = Mesh(*duties)
    mesh.run_until(10.0)
    tracker = mesh.tracker
    assert not any(d.is_tracker for d in mesh.volunteers)
    placed = tracker.assignments[MODEL.digest].ranges()
    assert set(placed) == {d.node_id for d in duties}
    for d in duties:
        assert served(d) == [placed[d.node_id]] and d.serving == placed[d.node_id] and d.loading is None
    assert tiles(placed.values(), MODEL.n_layers)
    # the tracker counted its placements in its record; the others asked over the mesh, it asked itself
    assert tracker.node.record.assignment_version == len(mesh.of(tracker, AssignmentChanged)) >= 1
    assert mesh.of(tracker, AskAssignment) == [] and all(mesh.of(d, AskAssignment) for d in mesh.volunteers)
    # a quiet mesh asks nothing more
    asks = sum(len(mesh.of(d, AskAssignment)) for d in duties)
    mesh.run_until(40.0)
    assert sum(len(mesh.of(d, AskAssignment)) for d in duties) == asks


def test_a_burst_of_joins_costs_one_placement() -> None:
    duties = [duty(i) for i in range(6)]
    mesh = Mesh(*duties[:2])
    mesh.run_until(10.0)
    tracker = mesh.tracker
    placements = len(mesh.of(tracker, AssignmentChanged))
    for d in duties[2:]:
        mesh.net.add(d)
        mesh.duties[d.node_id] = d
        mesh.seen[d.node_id] = []
        d.node.join(mesh.net.now, [tracker.node_id])
        mesh.run_until(mesh.net.now + SETTLE / 5)
    mesh.run_until(mesh.net.now + 10.0)
    # four joins within a settle period, and the ranges they publish afterwards: one placement
    assert len(mesh.of(tracker, AssignmentChanged)) == placements + 1
    assert all(served(d) for d in duties)


def test_a_dead_volunteer_is_replaced_and_the_others_move_only_if_needed() -> None:
    duties = [duty(i) for i in range(5)]
    mesh = Mesh(*duties)
    mesh.run_until(10.0)
    tracker = mesh.tracker
    before = tracker.assignments[MODEL.digest].ranges()
    victim = next(d for d in mesh.volunteers if before.get(d.node_id))
    mesh.net.down.add(victim.node_id)
    mesh.run_until(mesh.net.now + 30.0)
    after = tracker.assignments[MODEL.digest].ranges()
    assert victim.node_id not in after
    live = [d for d in duties if d is not victim]
    assert tiles((after[d.node_id] for d in live if d.node_id in after), MODEL.n_layers)
    for d in live:
        assert served(d) == ([after[d.node_id]] if d.node_id in after else served(d))


def test_a_new_tracker_moves_only_the_layers_the_dead_one_served_and_routes_over_the_rest_meanwhile() -> None:
    # the volunteers ask the new tracker for their ranges before it has placed, and are told none: each
    # dropped the placement that put it where it is, and with no member placed to start from the new
    # tracker cut the model afresh (three members moved here, and no route was left until they loaded)
    duties = [duty(i) for i in range(6)]
    mesh = Mesh(*duties)
    mesh.run_until(10.0)
    old = mesh.tracker
    assert old.serving is not None
    mesh.finish_loads = False
    mesh.net.down.add(old.node_id)
    rest = [d for d in duties if d is not old]
    for _ in range(300):
        mesh.run_until(mesh.net.now + 0.1)
        new = next((d for d in rest if d.is_tracker and MODEL.digest in d.assignments), None)
        if new is not None:
            break
    assert new is not None, "no tracker placed the model within 30 s"
    placed = new.assignments[MODEL.digest].ranges()
    moved = [d for d in rest if d.node_id in placed and d.serving != placed[d.node_id]]
    assert len(moved) == 1 and all(d.node.record.placement is not None for d in rest)
    route = new.route(MODEL.digest, (), lambda r: "10.0.0.1:7400")
    assert tiles([(s.start, s.end) for s in route.stages], MODEL.n_layers) and moved[0].loading is not None


def test_a_failed_ask_is_retried_after_a_doubling_backoff() -> None:
    duties = [duty(i) for i in range(2)]
    mesh = Mesh(*duties)
    mesh.answer_asks = False
    mesh.run_until(10.0)
    volunteer = mesh.volunteers[0]
    (ask,) = mesh.of(volunteer, AskAssignment)
    assert ask.tracker.node_id == mesh.tracker.node_id
    now = mesh.net.now
    volunteer.assignment_reply(now, None)
    mesh.run_until(now + 0.9)
    assert len(mesh.of(volunteer, AskAssignment)) == 1
    mesh.run_until(now + 1.1)
    assert len(mesh.of(volunteer, AskAssignment)) == 2
    volunteer.assignment_reply(mesh.net.now, None)
    again = mesh.net.now
    mesh.run_until(again + 1.9)
    assert len(mesh.of(volunteer, AskAssignment)) == 2
    mesh.run_until(again + 2.1)
    assert len(mesh.of(volunteer, AskAssignment)) == 3
    mesh.answer_asks = True
    volunteer.assignment_reply(mesh.net.now, mesh.tracker.assignment_for(volunteer.node_id))
    mesh.run_until(mesh.net.now + 1.0)
    assert served(volunteer)


def test_a_failed_load_is_asked_for_again_later() -> None:
    duties = [duty(i) for i in range(2)]
    mesh = Mesh(*duties)
    mesh.finish_loads = False
    mesh.run_until(10.0)
    volunteer = mesh.volunteers[0]
    (load,) = mesh.of(volunteer, LoadRange)
    volunteer.range_failed(mesh.net.now, load.start, load.end)
    assert volunteer.loading is None and not served(volunteer)
    mesh.finish_loads = True
    mesh.run_until(mesh.net.now + 2.0)
    assert len(mesh.of(volunteer, LoadRange)) == 2 and served(volunteer) == [(load.start, load.end)]


@pytest.mark.parametrize("model, start, end", [
    ("sha256:other", 0, 2),  # not the model it holds
    (MODEL.digest, 4, 9),  # beyond the model's layers
    (MODEL.digest, 0, 8),  # 800 bytes, beyond its 500
])
def test_a_volunteer_refuses_a_range_beyond_its_model_or_its_memory(model: str, start: int, end: int) -> None:
    duties = [duty(i) for i in range(2)]
    mesh = Mesh(*duties)
    mesh.answer_asks = False
    mesh.run_until(10.0)
    volunteer = mesh.volunteers[0]
    (ask,) = mesh.of(volunteer, AskAssignment)
    volunteer.assignment_reply(mesh.net.now, AssignmentReply(term=ask.tracker.term, model=model, start=start, end=end))
    mesh.run_until(mesh.net.now + 5.0)
    assert len(mesh.of(volunteer, RangeRefused)) == 1 and not mesh.of(volunteer, LoadRange)
    assert volunteer.wanted is None and not served(volunteer)


def test_only_the_tracker_answers_assignment_asks() -> None:
    duties = [duty(i) for i in range(2)]
    mesh = Mesh(*duties)
    mesh.run_until(10.0)
    with pytest.raises(ProtocolError) as caught:
        mesh.volunteers[0].assignment_for(mesh.tracker.node_id)
    assert caught.value.code is ErrorCode.NOT_FOUND
    stranger = duty(9)
    reply = mesh.tracker.assignment_for(stranger.node_id)
    assert reply.model is None and reply.reason


def test_a_claimant_awaits_the_votes_its_voters_ask_it_before() -> None:
    duties = [duty(i) for i in range(2)]
    mesh = Mesh(*duties)
    mesh.run_until(1.0)
    claimant = min(duties, key=lambda d: d.node_id)  # all start together: the lowest id claims first
    (voter,) = [d for d in duties if d is not claimant]
    mesh.net.blocked.add((voter.node_id, claimant.node_id))  # the vote is on its way
    mesh.run_until(3.0 + 1.0)
    assert voter.node.tracker is not None and voter.node.tracker.node_id == claimant.node_id
    # the voter follows it already; the claimant, one vote of two, is no tracker yet: the shell holds
    # the voter's ask while this says so, instead of refusing it
    assert claimant.awaiting_votes and not claimant.is_tracker and not voter.awaiting_votes
    with pytest.raises(ProtocolError, match=r"^NOT_FOUND: this node is not the tracker$"):
        claimant.assignment_for(voter.node_id)
    mesh.net.blocked.clear()
    mesh.run_until(mesh.net.now + 1.0)
    assert claimant.is_tracker and not claimant.awaiting_votes
    assert claimant.assignment_for(voter.node_id).term == claimant.node.tracker.term


def test_a_model_nobody_can_cover_is_reported_once_with_the_reason() -> None:
    duties = [duty(0, memory=300), duty(1, memory=300)]
    mesh = Mesh(*duties)
    mesh.run_until(10.0)
    changes = mesh.of(mesh.tracker, AssignmentChanged)
    assert len(changes) == 1 and changes[0].assignment is None and "raise --memory" in changes[0].reason
    assert MODEL.digest in mesh.tracker.uncovered and not mesh.tracker.assignments
    assert not any(mesh.of(d, LoadRange) for d in duties)


def test_leaving_is_announced_after_the_last_record_went_round() -> None:
    duties = [duty(i) for i in range(4)]
    mesh = Mesh(*duties)
    mesh.run_until(10.0)
    leaver = mesh.volunteers[1]
    leaver.leave(mesh.net.now)
    assert not leaver.left_announced
    mesh.run_until(mesh.net.now + 2.0)
    assert leaver.left_announced
    assert all(d.node.membership.state(leaver.node_id).value == "left" for d in duties if d is not leaver)
    # and nobody asks it to serve any more
    assert leaver.node_id not in mesh.tracker.assignments[MODEL.digest].ranges()
    alone = duty(7)
    alone.leave(0.0)
    assert alone.left_announced


def test_served_ranges_reach_the_record_only_once_loaded() -> None:
    duties = [duty(i) for i in range(2)]
    mesh = Mesh(*duties)
    mesh.finish_loads = False
    mesh.run_until(10.0)
    volunteer = mesh.volunteers[0]
    (load,) = mesh.of(volunteer, LoadRange)
    assert not served(volunteer) and volunteer.loading == (load.start, load.end)
    volunteer.range_loaded(mesh.net.now, load.start + 1, load.end)  # not what it was asked to load
    assert not served(volunteer)
    volunteer.range_loaded(mesh.net.now, load.start, load.end)
    assert volunteer.node.record.served == [ServedRange(model=MODEL.digest, start=load.start, end=load.end)]


def serving_volunteer() -> tuple[Mesh, MeshDuty, tuple[int, int]]:
    """Three members settled for 10 s: the mesh, its first volunteer and the range it serves."""
    mesh = Mesh(*[duty(i) for i in range(3)])
    mesh.run_until(10.0)
    volunteer = mesh.volunteers[0]
    assert volunteer.serving is not None
    return mesh, volunteer, volunteer.serving


def test_a_range_whose_worker_is_down_is_not_offered_until_it_is_back() -> None:
    mesh, volunteer, rng_ = serving_volunteer()
    assert served(volunteer) == [rng_]
    observer = mesh.volunteers[1]
    placements = len(mesh.of(mesh.tracker, AssignmentChanged))
    volunteer.range_down(mesh.net.now, *rng_)
    assert served(volunteer) == []
    mesh.run_until(mesh.net.now + 5.0)
    # the others no longer see it served; the tracker does not move it for a restart
    held = observer.node.membership.record_of(volunteer.node_id)
    assert held is not None and held.served == []
    assert len(mesh.of(mesh.tracker, AssignmentChanged)) == placements
    volunteer.range_down(mesh.net.now, rng_[0], rng_[1] + 1)  # not the range it serves: nothing to do
    volunteer.range_up(mesh.net.now, *rng_)
    mesh.run_until(mesh.net.now + 5.0)
    held = observer.node.membership.record_of(volunteer.node_id)
    assert held is not None and [(s.start, s.end) for s in held.served] == [rng_]


def test_a_range_whose_worker_is_gone_for_good_is_withdrawn_and_the_tracker_places_its_layers_elsewhere() -> None:
    mesh, volunteer, rng_ = serving_volunteer()
    assert volunteer.node.record.placement is not None
    volunteer.range_down(mesh.net.now, *rng_)
    volunteer.range_gone(mesh.net.now, rng_[0], rng_[1] + 1)  # not the range it serves: nothing to do
    assert volunteer.node.record.models == [MODEL]
    volunteer.range_gone(mesh.net.now, *rng_)
    record = volunteer.node.record
    assert (record.served, record.models, record.holds, record.placement) == ([], [], [], None)
    assert volunteer.serving is None and volunteer.config.volunteer is None
    asks, loads = len(mesh.of(volunteer, AskAssignment)), len(mesh.of(volunteer, LoadRange))
    mesh.run_until(mesh.net.now + 10.0)
    # the tracker places the model on the others alone, and the volunteer asks for and loads no range again
    placed = mesh.tracker.assignments[MODEL.digest].ranges()
    assert volunteer.node_id not in placed and tiles(placed.values(), MODEL.n_layers)
    assert (len(mesh.of(volunteer, AskAssignment)), len(mesh.of(volunteer, LoadRange))) == (asks, loads)
    assert volunteer.node.record.models == []


def test_after_leaving_nothing_the_shell_reports_signs_a_record() -> None:
    duties = [duty(i) for i in range(2)]
    mesh = Mesh(*duties)
    mesh.finish_loads = False
    mesh.run_until(10.0)
    tracker, volunteer = mesh.tracker, mesh.volunteers[0]
    (load,) = mesh.of(volunteer, LoadRange)
    for d in duties:
        d.leave(mesh.net.now)
    version = volunteer.node.record.version
    volunteer.range_loaded(mesh.net.now, load.start, load.end)
    volunteer.range_down(mesh.net.now, load.start, load.end)
    tracker.handle_timer(mesh.net.now + 100.0)
    assert volunteer.node.record.version == version and not served(volunteer)


# ----- volunteers that fetch their range instead of holding the file

FETCHED = MODEL.model_copy(update={"whole": False})


def fetcher(i: int, memory: int = 500, **config: object) -> MeshDuty:
    """A volunteer with no file: it offers the model once it knows it (`volunteer`), holding nothing yet."""
    node = MeshNode(identity(i), record(i, reachability="public", started_at=float(i), memory_bytes=memory),
                    0.0, SwimConfig(), ElectionConfig(), rng(i))
    settings: dict[str, object] = {"kv_tokens": 1, "settle": SETTLE} | config
    return MeshDuty(node, DutyConfig(**settings))  # type: ignore[arg-type]


def offer(d: MeshDuty, now: float) -> None:
    d.node.update_record(now, models=[FETCHED], kv_tokens=1)
    d.volunteer(now, FETCHED)


def test_volunteers_without_the_file_are_assigned_ranges_once_a_member_holds_every_layer() -> None:
    # a 300-byte holder takes three of the eight layers: the rest must go to the fetchers
    holder, fetchers = duty(0, memory=300), [fetcher(i) for i in range(1, 4)]
    mesh = Mesh(holder, *fetchers)
    mesh.run_until(5.0)
    assert all(mesh.of(d, LoadRange) == [] and mesh.of(d, AskAssignment) == [] for d in fetchers)
    for d in fetchers:
        offer(d, mesh.net.now)
    mesh.run_until(mesh.net.now + 10.0)
    placed = holder.assignments[MODEL.digest].ranges()
    assert {d.node_id for d in fetchers} <= set(placed) and tiles(placed.values(), MODEL.n_layers)
    for d in fetchers:
        assert [(e.start, e.end) for e in mesh.of(d, LoadRange)] == [placed[d.node_id]]


def test_a_model_whose_layers_no_member_holds_is_not_placed_and_status_says_why() -> None:
    # only fetchers: nobody could serve the bytes they would fetch
    fetchers = [fetcher(i) for i in range(3)]
    mesh = Mesh(*fetchers)
    mesh.run_until(5.0)
    for d in fetchers:
        offer(d, mesh.net.now)
    mesh.run_until(mesh.net.now + 10.0)
    tracker = next(d for d in fetchers if d.is_tracker)
    assert MODEL.digest not in tracker.assignments
    assert "no member holds layers [0, 8) on disk" in tracker.uncovered[MODEL.digest]
    assert all(mesh.of(d, LoadRange) == [] for d in fetchers)
    (coverage,) = tracker.status().coverage
    assert coverage.held_layers == 0 and coverage.holders == []
    assert "no member holds layers [0, 8)" in coverage.reason
    # one fetcher announces what it fetched of layers [0, 4): [4, 8) is still held by nobody
    fetchers[0].held(mesh.net.now, [HeldRange(model=MODEL.digest, start=0, end=4)])
    mesh.run_until(mesh.net.now + 5.0)
    assert "no member holds layers [4, 8) on disk" in tracker.uncovered[MODEL.digest]
    (coverage,) = tracker.status().coverage
    assert coverage.held_layers == 4 and coverage.holders == [f"{fetchers[0].node_id[:12]} [0, 4)"]


def test_a_fetcher_refuses_a_range_beyond_its_disk_budget() -> None:
    holder, small = duty(0, memory=300), fetcher(1, disk_bytes=250)
    mesh = Mesh(holder, small)
    mesh.run_until(5.0)
    offer(small, mesh.net.now)
    mesh.run_until(mesh.net.now + 10.0)
    (refused,) = mesh.of(small, RangeRefused)
    assert "bytes of disk" in refused.reason and "--disk" in refused.reason
    assert mesh.of(small, LoadRange) == []


def test_a_route_is_asked_for_by_model_id_or_by_the_name_of_one_model() -> None:
    duties = [duty(i) for i in range(3)]
    mesh = Mesh(*duties)
    mesh.run_until(10.0)

    def address(r: object) -> str:
        return "10.0.0.1:7400"

    by_id = duties[1].route(MODEL.digest, (), address)
    by_name = duties[1].route(MODEL.name, (), address)
    assert by_name == by_id and by_name.model == MODEL.digest
    with pytest.raises(ProtocolError, match="no member holds model"):
        duties[1].route("another", (), address)


def test_a_stage_far_from_the_planner_loses_the_route_and_rtt_noise_does_not_move_it() -> None:
    duties = [duty(i) for i in range(4)]
    mesh = Mesh(*duties)
    mesh.run_until(10.0)
    planner = duties[1]

    def address(r: object) -> str:
        return "10.0.0.1:7400"

    def route_with(rtts: dict[str, float]) -> list[str]:
        planner.node.membership.rtt = rtts.get  # type: ignore[method-assign]
        return [s.node_id for s in planner.route(MODEL.digest, (), address).stages]

    near = {d.node_id: 0.001 for d in duties}
    kept = route_with(near)
    assert len(kept) == 2
    # every range has a second server here: the tail's replica is as near as the rest
    for k in range(20):
        # each stage's RTT to the planner moves by up to 30%: the hop bound moves with it, inside the margin
        assert route_with({n: 0.001 * (0.7 + 0.6 * ((k * 7 + i * 3) % 10) / 9) for i, n in enumerate(near)}) == kept
    far = route_with(near | {kept[-1]: 0.05})
    assert far[0] == kept[0] and far[-1] != kept[-1]


def test_a_record_change_after_the_leave_publishes_nothing_and_raises_nothing() -> None:
    """A daemon's relay reservation can end while it leaves (the relay stops too): the leaving record stays."""
    node = duty(0).node
    node.leave(0.0)
    last = node.record
    assert last.leaving
    assert node.update_record(0.1, relay_addresses=["10.0.0.1:7400/p2p-circuit/x"], load=0.5) is last
    assert node.record is last
