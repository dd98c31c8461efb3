"""Attacks on the tracker election by one member: meshd's own node with a patched election (the
attacker), among honest nodes on an instant network with explicit time."""

from __future__ import annotations

from collections.abc import Callable

from attackers import HijackingElection
from instant_net import InstantNet, identity, record, rng

from meshd.mesh.election import ElectionConfig, Tracker
from meshd.mesh.membership import SwimConfig, Sync, SyncEntry
from meshd.mesh.node import MeshNode

TIMEOUT = ElectionConfig().election_timeout
LAST_TERM = 2**63 - 1


def honest(i: int, now: float = 0.0) -> MeshNode:
    return MeshNode(identity(i), record(i, reachability="public"), now, SwimConfig(), ElectionConfig(), rng(i))


def attacker(i: int, term_of: Callable[[MeshNode], int], now: float = 0.0, **fields: object) -> MeshNode:
    node = MeshNode(identity(i), record(i, reachability="public", **fields), now, SwimConfig(), ElectionConfig(),
                    rng(i))
    node.election = HijackingElection(node, term_of, now)
    node.election.observe(now, node.record, live=True)
    return node


def mesh(nodes: list[MeshNode]) -> InstantNet:
    net = InstantNet(*nodes)
    for node in nodes[1:]:
        node.join(0.0, [nodes[0].node_id])
    return net


def followed(nodes: list[MeshNode]) -> set[Tracker | None]:
    return {node.tracker for node in nodes}


def run_until_one_tracker(net: InstantNet, nodes: list[MeshNode], among: list[MeshNode], limit: float) -> Tracker:
    """Until every node of `nodes` follows one tracker from `among`; fails after `limit` seconds."""
    start = net.now
    ids = {node.node_id for node in among}
    while True:
        trackers = followed(nodes)
        (tracker,) = trackers if len(trackers) == 1 else (None,)
        if tracker is not None and tracker.node_id in ids:
            return tracker
        assert net.now - start < limit, f"no tracker after {limit} s: {trackers}"
        net.run_until(net.now + 0.1)


def test_a_claim_of_the_last_term_is_ignored_and_elections_go_on_after_the_attacker_leaves() -> None:
    good = [honest(i) for i in range(5)]
    bad = attacker(9, lambda node: LAST_TERM)
    net = mesh([*good, bad])
    tracker = run_until_one_tracker(net, good, good, limit=20.0)
    assert tracker.term < 10
    assert bad.record.tracker_term == LAST_TERM  # it kept claiming all along
    net.run_until(net.now + 10.0)
    assert followed(good) == {tracker}
    # The attacker and the tracker go: the survivors elect one of themselves, at the next term.
    net.down.update({bad.node_id, tracker.node_id})
    survivors = [node for node in good if node.node_id != tracker.node_id]
    successor = run_until_one_tracker(net, survivors, survivors, limit=30.0)
    assert successor.term == tracker.term + 1


def test_a_member_bumping_its_term_does_not_unseat_a_live_tracker() -> None:
    good = [honest(i) for i in range(5)]
    net = mesh(good)
    tracker = run_until_one_tracker(net, good, good, limit=20.0)
    # Joins, then claims one above whatever it claimed last at every step (each claim believable).
    bad = attacker(9, lambda node: node.record.tracker_term + 1, now=net.now)
    net.add(bad)
    bad.join(net.now, [good[0].node_id])
    net.run_until(net.now + 20.0)
    assert bad.record.tracker_term > tracker.term + 5
    assert followed(good) == {tracker}
    assert all(node.record.vote_term == tracker.term for node in good)


def test_a_newcomer_with_a_made_up_uptime_rushing_to_claim_loses_to_the_elders() -> None:
    good = [honest(i) for i in range(4)]
    net = mesh(good)
    tracker = run_until_one_tracker(net, good, good, limit=20.0)
    net.run_until(net.now + 30.0)
    # It says it started at the epoch, and claims the moment no tracker is carried.
    rushed: list[int] = []

    def rush(node: MeshNode) -> int:
        if node.election.tracker is not None:
            return 0
        rushed.append(node.election.highest_term + 1)
        return rushed[-1]

    bad = attacker(9, rush, now=net.now, started_at=0.0)
    net.add(bad)
    bad.join(net.now, [good[0].node_id])
    net.run_until(net.now + 5.0)
    assert bad.tracker == tracker
    net.down.add(tracker.node_id)
    elders = [node for node in good if node.node_id != tracker.node_id]
    successor = run_until_one_tracker(net, elders, elders, limit=30.0)
    assert rushed and max(rushed) > tracker.term  # it did rush its claims
    assert successor.node_id != bad.node_id
    net.run_until(net.now + 10.0)
    assert followed(elders) == {successor}


def test_planted_members_voting_for_the_attacker_neither_elect_it_nor_stall_the_election() -> None:
    good = [honest(i) for i in range(4)]
    net = mesh(good)
    tracker = run_until_one_tracker(net, good, good, limit=20.0)
    bad = attacker(9, lambda node: node.election.highest_term + 1, now=net.now)
    net.add(bad)
    bad.join(net.now, [good[0].node_id])
    net.run_until(net.now + 2.0)
    # A thousand members nobody ever hears from, each validly signed, each voting for the attacker's
    # claim: counted, they would be a majority of every view, and none of them votes for the tracker.
    term = bad.record.tracker_term
    planted = [record(1000 + i, vote_term=term, vote_for=bad.node_id) for i in range(1000)]
    for node in good:
        node.handle_message(net.now, bad.node_id, Sync(reply=False, entries=[
            SyncEntry(record=r, state="alive") for r in planted]))
    assert all(node.membership.live_count() > 1000 for node in good)
    for _ in range(20):
        net.run_until(net.now + 0.5)
        assert followed(good) == {tracker}
        assert all(node.record.vote_term == tracker.term for node in good)
