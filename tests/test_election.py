"""Tracker election: the state machine alone, then on top of membership."""

from __future__ import annotations

from instant_net import InstantNet, identity, record, rng

from meshd.mesh.election import Election, ElectionConfig, Tracker, candidate_key
from meshd.mesh.membership import SwimConfig
from meshd.mesh.node import MeshNode, TrackerChanged
from meshd.mesh.records import ROLE_CLIENT

TIMEOUT = ElectionConfig().election_timeout


def election_with(own: int, others: dict[int, dict], now: float = 0.0) -> Election:
    election = Election(record(own).node_id, now)
    election.observe(now, record(own, **others.pop(own, {})), live=True)
    for i, fields in others.items():
        election.observe(now, record(i, **fields), live=True)
    return election


def test_a_lone_founder_claims_after_the_timeout() -> None:
    election = election_with(0, {})
    election.handle_timer(TIMEOUT - 0.1, joined=True)
    assert election.claim == 0 and election.tracker is None
    assert election.next_timer() == TIMEOUT
    election.handle_timer(TIMEOUT, joined=True)
    assert election.claim == 1
    assert election.tracker == Tracker(1, record(0).node_id)
    assert election.next_timer() is None


def test_a_node_still_joining_does_not_claim() -> None:
    election = election_with(0, {})
    election.handle_timer(10 * TIMEOUT, joined=False)
    assert election.claim == 0


def test_candidates_rank_by_reachability_then_uptime_then_id() -> None:
    public_young = record(1, reachability="public", started_at=100.0)
    unknown_old = record(2, reachability="unknown", started_at=1.0)
    nat_oldest = record(3, reachability="nat", started_at=0.0)
    public_old = record(4, reachability="public", started_at=50.0)
    ranked = sorted([public_young, unknown_old, nat_oldest, public_old], key=candidate_key)
    assert ranked == [public_old, public_young, unknown_old, nat_oldest]
    twin_a, twin_b = record(5, started_at=7.0), record(6, started_at=7.0)
    assert sorted([twin_a, twin_b], key=candidate_key)[0].node_id == min(twin_a.node_id, twin_b.node_id)


def test_only_the_best_candidate_claims_at_first_and_others_wait_their_rank() -> None:
    view = {0: {"started_at": 5.0}, 1: {"started_at": 1.0}, 2: {"started_at": 9.0}}
    best = election_with(1, dict(view))
    second = election_with(0, dict(view))
    third = election_with(2, dict(view))
    for election in (best, second, third):
        election.handle_timer(TIMEOUT, joined=True)
    assert (best.claim, second.claim, third.claim) == (1, 0, 0)
    # Had the best one vanished unseen, the second would step in one timeout later.
    second.handle_timer(2 * TIMEOUT, joined=True)
    assert second.claim == 1
    third.handle_timer(2 * TIMEOUT, joined=True)
    assert third.claim == 0


def test_light_clients_never_claim() -> None:
    election = election_with(0, {0: {"roles": [ROLE_CLIENT]}})
    election.handle_timer(100 * TIMEOUT, joined=True)
    assert election.claim == 0


def test_everyone_follows_the_highest_term_and_id_and_a_lower_tracker_steps_down() -> None:
    election = election_with(0, {})
    election.handle_timer(TIMEOUT, joined=True)
    assert election.claim == 1
    other = record(1, tracker_term=1)
    election.observe(TIMEOUT + 1, other, live=True)
    expected = max(Tracker(1, record(0).node_id), Tracker(1, other.node_id))
    assert election.tracker == expected
    assert (election.claim == 1) == (expected.node_id == record(0).node_id)
    election.observe(TIMEOUT + 2, record(2, tracker_term=5), live=True)
    assert election.tracker == Tracker(5, record(2).node_id)
    assert election.claim == 0


def test_when_the_tracker_dies_the_next_term_is_claimed() -> None:
    election = election_with(0, {})
    tracker = record(1, tracker_term=3)
    election.observe(0.0, tracker, live=True)
    assert election.tracker == Tracker(3, tracker.node_id)
    election.observe(10.0, tracker, live=False)
    assert election.tracker is None
    election.handle_timer(10.0 + TIMEOUT, joined=True)
    assert election.tracker == Tracker(4, record(0).node_id)


def mesh_nodes(n: int, started_at: list[float] | None = None) -> tuple[InstantNet, list[MeshNode]]:
    nodes = [
        MeshNode(
            identity(i),
            record(i, reachability="public", started_at=(started_at or [float(i)] * n)[i]),
            0.0,
            SwimConfig(),
            ElectionConfig(),
            rng(i),
        )
        for i in range(n)
    ]
    net = InstantNet(*nodes)
    for node in nodes[1:]:
        node.join(0.0, [nodes[0].node_id])
    return net, nodes


def test_one_tracker_is_elected_and_announced_through_gossip() -> None:
    net, nodes = mesh_nodes(5)
    net.run_until(10.0)
    founder = nodes[0]  # the longest uptime
    assert {node.tracker for node in nodes} == {Tracker(1, founder.node_id)}
    assert founder.record.tracker_term == 1
    assert [node.record.tracker_term for node in nodes[1:]] == [0] * 4
    changes = [event for event in nodes[3].events() if isinstance(event, TrackerChanged)]
    assert changes == [TrackerChanged(Tracker(1, founder.node_id))]


def test_a_dead_tracker_is_replaced_within_detection_plus_election_timeout() -> None:
    net, nodes = mesh_nodes(5)
    net.run_until(10.0)
    net.down.add(nodes[0].node_id)
    killed_at = net.now
    survivors = nodes[1:]
    while {node.tracker for node in survivors} != {Tracker(2, nodes[1].node_id)}:
        net.run_until(net.now + 0.1)
        assert net.now - killed_at < 30, "no new tracker"
    elapsed = net.now - killed_at
    print(f"\nnew tracker followed by all {elapsed:.1f} s after the old one died")
    # Failure detection (a probe round, then Lifeguard's minimum suspicion) plus one election timeout.
    assert elapsed <= 4 + 8 + TIMEOUT
