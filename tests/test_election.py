"""Tracker election: the state machine alone, then on top of membership."""

from __future__ import annotations

from instant_net import InstantNet, identity, record, rng

from meshd.mesh.election import Election, ElectionConfig, Tracker, candidate_key
from meshd.mesh.membership import SwimConfig
from meshd.mesh.node import MeshNode, TrackerChanged
from meshd.mesh.records import ROLE_CLIENT

TIMEOUT = ElectionConfig().election_timeout


def election_with(own: int, others: dict[int, dict], seen: dict[int, float] | None = None,
                  now: float = 0.0) -> Election:
    """An election at node `own` that first saw each member live at `seen[i]` (default `now`)."""
    seen = seen or {}
    election = Election(record(own).node_id, seen.get(own, now))
    election.observe(seen.get(own, now), record(own, **others.pop(own, {})), live=True)
    for i, fields in sorted(others.items(), key=lambda item: seen.get(item[0], now)):
        election.observe(seen.get(i, now), record(i, **fields), live=True)
    return election


def voting_for(i: int, term: int, **fields: object) -> dict:
    return {"vote_term": term, "vote_for": record(i).node_id, **fields}


def test_a_lone_founder_claims_after_the_timeout() -> None:
    election = election_with(0, {})
    election.handle_timer(TIMEOUT - 0.1, joined=True)
    assert election.claim == 0 and election.tracker is None
    assert election.next_timer() == TIMEOUT
    election.handle_timer(TIMEOUT, joined=True)
    assert election.claim == 1
    assert election.vote == election.tracker == Tracker(1, record(0).node_id)
    assert election.next_timer() is None


def test_a_node_still_joining_does_not_claim() -> None:
    election = election_with(0, {})
    election.handle_timer(10 * TIMEOUT, joined=False)
    assert election.claim == 0


def test_candidates_rank_by_reachability_then_observed_uptime_then_id() -> None:
    public_young = record(1, reachability="public")
    unknown_old = record(2, reachability="unknown")
    nat_oldest = record(3, reachability="nat")
    public_old = record(4, reachability="public")
    seen = {public_young.node_id: 100.0, unknown_old.node_id: 1.0, nat_oldest.node_id: 0.0,
            public_old.node_id: 50.0}
    ranked = sorted([public_young, unknown_old, nat_oldest, public_old],
                    key=lambda r: candidate_key(r, seen[r.node_id]))
    assert ranked == [public_old, public_young, unknown_old, nat_oldest]
    twin_a, twin_b = record(5), record(6)
    assert sorted([twin_a, twin_b], key=lambda r: candidate_key(r, 7.0))[0].node_id == min(
        twin_a.node_id, twin_b.node_id)


def test_only_the_best_candidate_claims_at_first_and_others_wait_their_rank() -> None:
    # Every node saw node 1 first, then 0, then 2 (and itself from its own start).
    seen = {0: 5.0, 1: 1.0, 2: 9.0}
    best = election_with(1, {0: {}, 2: {}}, seen)
    second = election_with(0, {1: {}, 2: {}}, seen)
    third = election_with(2, {0: {}, 1: {}}, seen)
    for election in (best, second, third):
        election.handle_timer(10.0, joined=True)  # each is vacant since it started
    assert (best.claim, second.claim, third.claim) == (1, 0, 0)
    # Had the best one vanished unseen, the second would step in one timeout later.
    second.handle_timer(10.0 + TIMEOUT, joined=True)
    assert second.claim == 1
    third.handle_timer(10.0 + TIMEOUT, joined=True)
    assert third.claim == 0


def test_light_clients_never_claim() -> None:
    election = election_with(0, {0: {"roles": [ROLE_CLIENT]}})
    election.handle_timer(100 * TIMEOUT, joined=True)
    assert election.claim == 0


def test_a_claim_is_followed_once_a_majority_of_live_members_votes_for_it() -> None:
    election = election_with(0, {1: {}, 2: {}, 3: {}}, seen={1: 0.0, 0: 1.0, 2: 2.0, 3: 3.0})
    # the claim comes once all four are live (a claim followed before newcomers came would hold
    # while they have yet to vote: test_a_followed_tracker_holds_while_newcomers_have_yet_to_vote)
    election.observe(3.0, record(1, version=2, tracker_term=1, **voting_for(1, 1)), live=True)
    assert election.tracker is None  # short of a majority of four
    election.handle_timer(TIMEOUT, joined=True)
    # Node 1 is the best candidate in this view, so this node backs it: two votes of four.
    assert election.vote == Tracker(1, record(1).node_id) and election.tracker is None
    election.observe(TIMEOUT, record(2, version=2, **voting_for(1, 1)), live=True)
    assert election.tracker == Tracker(1, record(1).node_id)
    assert election.claim == 0


def test_a_higher_carried_tracker_wins_and_a_lower_one_steps_down() -> None:
    election = election_with(0, {})
    election.handle_timer(TIMEOUT, joined=True)
    assert election.claim == 1
    election.observe(TIMEOUT + 1, record(2, tracker_term=2, **voting_for(2, 2)), live=True)
    election.observe(TIMEOUT + 1, record(3, **voting_for(2, 2)), live=True)
    assert election.tracker == Tracker(2, record(2).node_id)
    assert election.claim == 0
    assert election.vote == Tracker(2, record(2).node_id)  # endorsed, for the majority to hold


def test_when_the_tracker_dies_the_next_term_is_claimed() -> None:
    election = election_with(0, {})
    tracker = record(1, tracker_term=3, **voting_for(1, 3))
    election.observe(0.0, tracker, live=True)
    election.observe(0.0, record(2, **voting_for(1, 3)), live=True)
    assert election.tracker == Tracker(3, tracker.node_id)
    election.observe(10.0, tracker, live=False)
    election.observe(10.0, record(2, version=2), live=True)
    assert election.tracker is None
    election.handle_timer(10.0 + TIMEOUT, joined=True)
    assert election.claim == 4
    election.observe(10.0 + TIMEOUT, record(2, version=3, **voting_for(0, 4)), live=True)
    assert election.tracker == Tracker(4, record(0).node_id)


def mesh_nodes(n: int) -> tuple[InstantNet, list[MeshNode]]:
    nodes = [
        MeshNode(
            identity(i),
            record(i, reachability="public"),
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


def test_one_tracker_is_elected_by_votes_and_announced_through_gossip() -> None:
    net, nodes = mesh_nodes(5)
    net.run_until(10.0)
    # All started together, so the lowest node id is the best candidate (started_at counts for nothing).
    winner = min(nodes, key=lambda node: node.node_id)
    assert {node.tracker for node in nodes} == {Tracker(1, winner.node_id)}
    assert [node.record.tracker_term for node in nodes] == [int(node is winner) for node in nodes]
    assert {(node.record.vote_term, node.record.vote_for) for node in nodes} == {(1, winner.node_id)}
    watcher = next(node for node in nodes if node is not winner)
    changes = [event for event in watcher.events() if isinstance(event, TrackerChanged)]
    assert changes == [TrackerChanged(Tracker(1, winner.node_id))]


def test_a_dead_tracker_is_replaced_within_detection_plus_election_timeout() -> None:
    net, nodes = mesh_nodes(5)
    net.run_until(10.0)
    old = min(nodes, key=lambda node: node.node_id)
    net.down.add(old.node_id)
    killed_at = net.now
    survivors = [node for node in nodes if node is not old]
    new = {Tracker(2, node.node_id) for node in survivors}
    while len({node.tracker for node in survivors}) != 1 or survivors[0].tracker not in new:
        net.run_until(net.now + 0.1)
        assert net.now - killed_at < 30, "no new tracker"
    elapsed = net.now - killed_at
    print(f"\nnew tracker followed by all {elapsed:.1f} s after the old one died")
    # Failure detection (a probe round, then Lifeguard's minimum suspicion) plus one election timeout.
    assert elapsed <= 4 + 8 + TIMEOUT


def test_a_followed_tracker_holds_while_newcomers_have_yet_to_vote() -> None:
    # A founder is tracker, a member backs it; two members join before their votes come (a gossip round).
    election = election_with(0, {})
    election.handle_timer(TIMEOUT, joined=True)
    founder = Tracker(1, record(0).node_id)
    election.observe(5.0, record(1, **voting_for(0, 1)), live=True)
    election.observe(10.0, record(2), live=True)
    election.observe(10.1, record(3), live=True)
    assert election.tracker == founder  # two votes of four live, but two are newcomers
    assert election.next_timer() == 10.0 + TIMEOUT  # the first one's grace ends then
    election.observe(10.2, record(3, version=2, **voting_for(0, 1)), live=True)
    election.handle_timer(10.1 + TIMEOUT, joined=True)
    assert election.tracker == founder  # three of four
    # newcomers that stay silent past their grace count against: three of six is no majority
    election.observe(20.0, record(4), live=True)
    election.observe(20.0, record(5), live=True)
    election.handle_timer(20.0 + TIMEOUT - 0.1, joined=True)
    assert election.tracker == founder
    election.handle_timer(20.0 + TIMEOUT, joined=True)
    assert election.tracker is None


def test_a_claim_not_yet_followed_needs_a_majority_of_every_live_member() -> None:
    # Two newcomers that have not voted yet, then a rushing claim backed by one other; this node
    # holds back (it outranks the claimant): two votes of five, however new the two silent ones are.
    election = election_with(0, {0: {"reachability": "public"}, 1: {"tracker_term": 1, **voting_for(1, 1)},
                                 2: voting_for(1, 1), 3: {}, 4: {}}, seen={0: 9.5, 3: 9.5, 4: 9.5}, now=10.0)
    assert election.vote is None and election.tracker is None


def test_newcomers_beyond_the_trackers_votes_unseat_it_at_once() -> None:
    # a claim two carried, and four members join at once with their votes still to come
    election = election_with(0, {})
    election.handle_timer(TIMEOUT, joined=True)
    election.observe(5.0, record(1, **voting_for(0, 1)), live=True)
    for i in (2, 3, 4):
        election.observe(10.0, record(i), live=True)
    assert election.tracker == Tracker(1, record(0).node_id)  # two votes of five, two of the three excused
    election.observe(10.0, record(5), live=True)
    assert election.tracker is None  # two of six, two of the four excused
