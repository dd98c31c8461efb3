"""Authority that costs something (meshd.mesh.authority), sans-IO: whose votes count once the mesh has
placed anyone, whose witness receipts count in a proof, and how an exclusion ends.

Each rule is driven at explicit times: the election alone with hand-made records, and the duties of
a placed mesh on an instant network (tests/test_mesh_duty.py's)."""

from __future__ import annotations

import random

import pytest
from attackers import HijackingElection, VotingElection
from instant_net import identity, record, rng
from test_election import TIMEOUT, election_with, voting_for
from test_mesh_duty import MODEL, Mesh, duty

from meshd.mesh.authority import (
    EARNED_FOR,
    EXCLUSION_SECONDS,
    RENEW_AFTER,
    Exclusions,
    ProofAgainstSelf,
    placement_of,
)
from meshd.mesh.duty import MeshDuty
from meshd.mesh.election import Election, Tracker
from meshd.mesh.node import MeshNode
from meshd.mesh.proofs import InvalidProof
from meshd.mesh.records import ServedRange
from meshd.stage.receipts import SessionReceipts, Signer
from wire.identity import NodeIdentity
from wire.receipt import Proof, Receipt, row_hash
from wire.swim import Placement

TRACKER = 1
HONEST = (2, 3, 4)
SYBILS = range(10, 16)  # six free identities, each heard first-hand: twice the honest members
UNPLACED = 5  # an honest member no tracker placed (yet)


def placed(i: int, by: int = TRACKER, term: int = 1, **fields: object) -> dict[str, object]:
    """Record fields of member `i`, placed by `by` at `term` on layers [0, 4)."""
    return {"placement": Placement.create(identity(by), term, record(i).node_id, MODEL.digest, 0, 4), **fields}


def placed_mesh_election() -> Election:
    """Node 0's election in a mesh whose tracker (1, term 1) placed node 0 and members 2-4, all backing it."""
    others: dict[int, dict[str, object]] = {TRACKER: {"tracker_term": 1, **voting_for(TRACKER, 1)}}
    for i in HONEST:
        others[i] = placed(i, **voting_for(TRACKER, 1))
    election = election_with(0, others)
    election.observe(0.0, record(0, version=2, **placed(0)), live=True)
    assert election.tracker == Tracker(1, record(TRACKER).node_id)
    assert election.weighing
    return election


def bid(election: Election, now: float, term: int, members: range, version: int = 1, **fields: object) -> None:
    """Free identities, heard first-hand, claiming `term` for the first of them and voting for it."""
    leader = members[0]
    for i in members:
        claim = {"tracker_term": term} if i == leader else {}
        election.observe(now, record(i, version=version, **claim, **voting_for(leader, term), **fields), live=True)


def test_free_identities_outnumbering_the_placed_members_neither_unseat_the_tracker_nor_win_the_vacancy() -> None:
    election = placed_mesh_election()
    tracker = election.tracker
    bid(election, 1.0, 2, SYBILS)
    assert election.tracker == tracker
    # the tracker dies: only the placed members' votes carry its successor, never the sybils'
    election.observe(10.0, record(TRACKER, version=2), live=False)
    assert election.tracker is None
    bid(election, 10.0, 2, SYBILS, version=2)
    election.handle_timer(10.0 + 3 * TIMEOUT, joined=True)
    assert election.tracker is None or election.tracker.node_id not in {record(i).node_id for i in SYBILS}
    # a placed member's claim, backed by the placed members, is carried: a majority of four weighing
    claimant = record(2).node_id
    for i in HONEST:
        fields = placed(i, **voting_for(2, 2), **({"tracker_term": 2} if i == 2 else {}))
        election.observe(11.0, record(i, 3, **fields), live=True)
    assert election.tracker == Tracker(2, claimant)


def test_a_free_identity_older_and_better_reachable_than_anyone_gets_no_honest_vote_for_the_vacancy() -> None:
    election = placed_mesh_election()
    # around since long before the mesh, and public where the members are not: the best candidate by merit
    election.observe(-100.0, record(9, reachability="public"), live=True)
    election.observe(10.0, record(TRACKER, version=2), live=False)
    election.observe(10.0, record(9, version=2, reachability="public", tracker_term=2, **voting_for(9, 2)),
                     live=True)
    for t in (10.0 + TIMEOUT, 10.0 + 2 * TIMEOUT, 10.0 + 3 * TIMEOUT):
        election.handle_timer(t, joined=True)
        assert election.vote is None or election.vote.node_id != record(9).node_id
    # this node, placed, ran itself (a placed member's claim), and the free identity's carried nothing
    assert election.claim >= 2 and election.tracker is None


@pytest.mark.parametrize("seeded", [True, False])
def test_a_newcomer_follows_the_claim_its_seed_backs_where_free_identities_back_another(seeded: bool) -> None:
    # it heard from six sybils bidding for term 2 before any member of the mesh
    election = Election(record(0).node_id, 0.0)
    election.observe(0.0, record(0), live=True)
    if seeded:
        election.anchor(0.0, [record(TRACKER).node_id])
    bid(election, 0.0, 2, SYBILS)
    election.observe(0.0, record(TRACKER, tracker_term=1, **voting_for(TRACKER, 1)), live=True)
    for i in HONEST:
        election.observe(0.0, record(i, **placed(i, **voting_for(TRACKER, 1))), live=True)
    sybil = Tracker(2, record(SYBILS[0]).node_id)
    # the seed's claim, whose placements then weigh; without a seed, heads count (the bootstrap)
    assert election.tracker == (Tracker(1, record(TRACKER).node_id) if seeded else sybil)


@pytest.mark.parametrize("seed", [TRACKER, HONEST[0], UNPLACED],
                         ids=["seed is the tracker", "seed is placed", "seed is not placed"])
def test_a_newcomer_keeps_the_tracker_its_seed_backs_whichever_order_it_hears_members_first_hand(seed: int) -> None:
    # test_attacks_authority's flake: six free identities heard first-hand before any placed member
    # outnumbered the few heard from, and a head count dropped the tracker the seed backs
    tracker = Tracker(1, record(TRACKER).node_id)
    honest = {TRACKER: record(TRACKER, 2, tracker_term=1, **voting_for(TRACKER, 1)),
              UNPLACED: record(UNPLACED, 2, **voting_for(TRACKER, 1))}
    honest |= {i: record(i, 2, **placed(i, **voting_for(TRACKER, 1))) for i in HONEST}
    # what a Sync may hold of a member instead: its version from before it voted (or was placed)
    stale = {i: record(i) for i in (*HONEST, UNPLACED)}
    crowd = {i: record(i, **({"tracker_term": 2} if i == SYBILS[0] else {}), **voting_for(SYBILS[0], 2))
             for i in SYBILS}
    current = honest | crowd
    others = [i for i in current if i != seed]
    shuffled = random.Random(0)
    # After the join (the seed's record first-hand), in any order: the seed's Sync (None: every other
    # record, second-hand, some stale), and each other member's first word (its current record, or
    # first its word alone); the election's timers run between them. First the flake's order: the
    # Sync, then the free identities' probes before any member of the mesh speaks.
    orders: list[list[int | None]] = [[None, *crowd, *(i for i in others if i in honest)]]
    orders += [shuffled.sample([None, *others], len(others) + 1) for _ in range(80)]
    for events in orders:
        election = Election(record(0).node_id, 0.0)
        election.observe(0.0, record(0), live=True)
        election.observe(0.0, honest[seed], live=True)
        election.anchor(0.0, [record(seed).node_id])
        synced = {i: stale[i] if i in stale and shuffled.random() < 0.5 else current[i] for i in others}
        followed = False
        for step, i in enumerate(events, 1):
            now = step * TIMEOUT / 4
            if (due := election.next_timer()) is not None and due <= now:
                election.handle_timer(due, joined=True)
            if i is None:
                for j in others:
                    if record(j).node_id not in election._live:  # not heard first-hand yet
                        election.observe(now, synced[j], live=True, vouched=False)
            else:
                if shuffled.random() < 0.5:
                    election.vouch(now, record(i).node_id)
                election.observe(now, current[i], live=True)
            followed = followed or election.tracker is not None
            assert election.tracker == (tracker if followed else None), events[:step]
        assert followed and election.weighing
        assert not election._heard  # every member heard first-hand: nothing kept aside


@pytest.mark.parametrize("trial", range(12))
def test_a_newcomer_joining_a_placed_mesh_while_free_identities_bid_never_drops_its_tracker(trial: int) -> None:
    # test_attacks_authority's mesh, sans-IO: a seed that serves nothing is the tracker of two placed
    # volunteers, and six free identities bid for term 2; the trial's keys (hence probe orders) decide
    # which members probe the newcomer first (free identities first, in some: the flake)
    newcomer, sybils = 100 + trial, range(20 + 10 * trial, 26 + 10 * trial)
    seed = duty(0, volunteer=None)
    mesh = Mesh(seed, duty(1), duty(2))
    mesh.run_until(10.0)
    assert mesh.tracker is seed
    tracker = seed.node.tracker
    assert tracker is not None
    now = mesh.net.now
    crowd = [MeshNode(identity(i), record(i, reachability="public"), now, rng=rng(i)) for i in sybils]
    claim = Tracker(tracker.term + 1, crowd[0].node_id)
    for sybil in crowd:
        sybil.election = HijackingElection(sybil, lambda _: claim.term, now) if sybil is crowd[0] \
            else VotingElection(sybil, lambda: claim, now)
        sybil.election.observe(now, sybil.record, live=True)
        sybil.update_record(now)
        mesh.net.add(sybil)
        sybil.join(now, [seed.node_id])
    mesh.run_until(now + 10.0)
    assert all(d.node.tracker == tracker for d in mesh.duties.values())
    late = MeshNode(identity(newcomer), record(newcomer, reachability="public"), mesh.net.now, rng=rng(newcomer))
    mesh.net.add(late)
    late.join(mesh.net.now, [seed.node_id])
    followed = False
    for _ in range(200):
        mesh.run_until(mesh.net.now + 0.05)
        followed = followed or late.tracker is not None
        assert late.tracker == (tracker if followed else None), mesh.net.now
    assert followed


def test_a_fresh_mesh_with_no_placement_counts_every_member_heard_first_hand() -> None:
    # the bootstrap: before any placement the old count stands (a majority of live members)
    election = election_with(0, {1: {"tracker_term": 1, **voting_for(1, 1)}, 2: voting_for(1, 1), 3: {}})
    assert not election.weighing
    assert election.tracker == Tracker(1, record(1).node_id)


@pytest.mark.parametrize("forged", ["unfollowed tracker", "another term", "another member", "bad signature"])
def test_a_placement_the_followed_tracker_did_not_sign_for_that_member_weighs_nothing(forged: str) -> None:
    election = placed_mesh_election()
    tracker = election.tracker
    placements = {
        "unfollowed tracker": Placement.create(identity(10), 1, record(11).node_id, MODEL.digest, 0, 4),
        "another term": Placement.create(identity(TRACKER), 2, record(11).node_id, MODEL.digest, 0, 4),
        "another member": Placement.create(identity(TRACKER), 1, record(2).node_id, MODEL.digest, 0, 4),
        "bad signature": Placement.create(identity(TRACKER), 1, record(11).node_id, MODEL.digest, 0, 4).model_copy(
            update={"end": 8}),
    }
    assert placement_of(record(11, placement=placements[forged]), election.followed) is None
    bid(election, 1.0, 2, SYBILS, placement=placements[forged])
    assert election.tracker == tracker


def test_a_placed_member_gone_and_back_re_placed_elsewhere_keeps_its_weight_for_a_while() -> None:
    # A partition: member 2 is gone from this side, and comes back placed by the other side's tracker.
    election = placed_mesh_election()
    election.observe(5.0, record(2, version=2, **placed(2)), live=False)
    other_side = placed(2, by=7, term=2, **voting_for(TRACKER, 1))
    election.observe(60.0, record(2, version=3, **other_side), live=True)
    assert election._electorate() == 5  # 0, 1 (the tracker), 2 (earned), 3 and 4
    # long after: a placement no tracker followed here signed earns nothing any more
    election.observe(70.0, record(2, version=4), live=False)
    election.observe(70.0 + EARNED_FOR, record(2, version=5, **other_side), live=True)
    assert election._electorate() == 4


def test_a_successor_whose_own_placements_weigh_once_it_is_followed_is_looked_at_again_by_the_new_weights() -> None:
    # test_attacks_authority's crash in CI: following a newly carried tracker weighs every member again,
    # and the members it placed itself, yet to vote for it, left it half the weight with no newcomer
    # whose grace to wait out: the election took the oldest one's from an empty dict (StopIteration)
    successor, later = HONEST[0], range(5, 9)
    election = placed_mesh_election()
    by_successor = {i: Placement.create(identity(successor), 2, record(i).node_id, MODEL.digest, 4, 8) for i in later}
    for i in later:
        election.observe(0.0, record(i, placement=by_successor[i]), live=True)
    # news past every newcomer's grace: the followed tracker's count forgets them all
    moved = Placement.create(identity(TRACKER), 1, record(4).node_id, MODEL.digest, 4, 8)
    election.observe(2 * TIMEOUT, record(4, 2, placement=moved, **voting_for(TRACKER, 1)), live=True)
    election.observe(3 * TIMEOUT, record(TRACKER, version=2), live=False)
    carried = Tracker(2, record(successor).node_id)
    seen = []
    for i in HONEST:
        fields = placed(i, **voting_for(successor, 2), **({"tracker_term": 2} if i == successor else {}))
        election.observe(3 * TIMEOUT, record(i, 3, **fields), live=True)
        seen.append((election.tracker, election._electorate()))
    # carried by three of the four that weighed, then four of eight once its own placements weigh
    assert seen == [(None, 4), (carried, 8), (None, 8)]
    for i in later:
        election.observe(3 * TIMEOUT + 1.0, record(i, 2, placement=by_successor[i], **voting_for(successor, 2)),
                         live=True)
    assert election.tracker == carried


# ----- proofs


def placed_duties() -> Mesh:
    mesh = Mesh(*[duty(i) for i in range(6)])
    mesh.run_until(10.0)
    return mesh


def receipt(layers: tuple[int, int], out: bytes, signer: Signer) -> Receipt:
    return SessionReceipts(signer, f"s{signer.node_id[:4]}", 0, MODEL.digest, *layers).sign(
        0, 3, row_hash(b"in"), row_hash(out))


def framing(mesh: Mesh) -> tuple[MeshDuty, MeshDuty, Proof, Proof]:
    """A placed range's nodes: the victim and a bystander on it, a proof framing the victim (two free
    identities as witnesses), and a true proof against it (two placed witnesses)."""
    ranges = mesh.tracker.assignments[MODEL.digest].ranges()
    by_id = {d.node_id: d for d in mesh.duties.values()}
    layers = max(set(ranges.values()), key=lambda r: sum(1 for v in ranges.values() if v == r))
    on_range = [by_id[n] for n, r in ranges.items() if r == layers and not by_id[n].is_tracker]
    victim, *others = on_range
    assert len(others) >= 2, ranges
    signers = {d.node_id: Signer(identity(i)) for i, d in enumerate(mesh.duties.values())}
    genuine = receipt(layers, b"truth", signers[victim.node_id])
    sybils = [receipt(layers, b"lie", Signer(NodeIdentity.generate())) for _ in range(2)]
    placed_witnesses = [receipt(layers, b"lie", signers[d.node_id]) for d in others[:2]]
    return victim, others[0], Proof(kind="divergence", culprit=genuine, witnesses=sybils), \
        Proof(kind="divergence", culprit=genuine, witnesses=placed_witnesses)


def test_witnesses_whose_own_records_claim_the_range_frame_nobody_and_the_culprit_refuses_a_proof() -> None:
    mesh = placed_duties()
    victim, bystander, framed, proven = framing(mesh)
    ranges = mesh.tracker.assignments[MODEL.digest].ranges()
    start, end = ranges[victim.node_id]
    # every duty's record carries the tracker's signed placement of its range
    for d in mesh.duties.values():
        p = d.node.record.placement
        assert p is not None and (p.node_id, p.start, p.end) == (d.node_id, *ranges[d.node_id])
    # the sybils' records say they serve the range (as a liar's may): nobody counts that
    for witness in framed.witnesses:
        assert witness.layer_begin == start
    sybil_records = [record(100 + i, served=[ServedRange(model=MODEL.digest, start=start, end=end)])
                     for i in range(2)]
    for d in (bystander, victim, mesh.tracker):
        for r in sybil_records:
            d.node.election.observe(mesh.net.now, r, live=True)
        with pytest.raises(InvalidProof):
            d.accept_proof(mesh.net.now, framed)
        assert d.liars == {}
    # a proof against itself, however good, the victim never takes
    with pytest.raises(ProofAgainstSelf):
        victim.accept_proof(mesh.net.now, proven)
    assert victim.liars == {}
    # a proof whose witnesses the tracker placed holds at the bystander, by their records' placements
    electorate = bystander.node.election._electorate()
    assert bystander.accept_proof(mesh.net.now, proven) == victim.node_id
    # and the culprit's vote counts there no more, though its record still carries its placement
    assert victim.node.record.placement is not None
    assert bystander.node.election._electorate() == electorate - 1
    bystander.handle_timer(mesh.net.now + EXCLUSION_SECONDS)
    assert bystander.liars == {} and bystander.node.election._electorate() == electorate


@pytest.mark.slow
def test_an_exclusion_expires_after_its_hour_unless_a_new_proof_renews_it_and_a_replay_excludes_no_more() -> None:
    mesh = placed_duties()
    victim, bystander, _, proven = framing(mesh)
    tracker = mesh.tracker
    now = mesh.net.now
    assert tracker.accept_proof(now, proven) == victim.node_id
    mesh.run_until(now + 5.0)
    assert victim.node_id not in tracker.assignments[MODEL.digest].ranges()
    assert tracker.next_timer() is not None and tracker.next_timer() <= now + EXCLUSION_SECONDS  # type: ignore[operator]
    # an hour on, the exclusion ends and the tracker places the member again
    tracker.handle_timer(now + EXCLUSION_SECONDS)
    assert tracker.liars == {}
    mesh.run_until(now + EXCLUSION_SECONDS + 5.0)
    assert victim.node_id in tracker.assignments[MODEL.digest].ranges()
    # the same proof again is no new lie
    with pytest.raises(InvalidProof, match="run out"):
        tracker.accept_proof(mesh.net.now, proven)


def test_exclusions_renew_only_by_another_proof_and_at_most_once_per_half_life() -> None:
    signer = Signer(NodeIdentity.generate())
    lies = [Proof(kind="equivocation", culprit=receipt((0, 4), b"a%d" % i, signer),
                  witnesses=[receipt((0, 4), b"b%d" % i, signer)]) for i in range(3)]
    held = Exclusions(most=1)
    assert held.add(0.0, signer.node_id, lies[0])
    assert not held.add(1.0, signer.node_id, lies[0])  # known
    assert not held.add(2.0, signer.node_id, lies[1])  # another lie, too soon to pass on again
    assert held.add(RENEW_AFTER, signer.node_id, lies[1])  # renewed: news
    assert held.until(signer.node_id) == RENEW_AFTER + EXCLUSION_SECONDS
    with pytest.raises(Exclusions.Full):
        held.add(0.0, "another", lies[2])
    assert held.expire(RENEW_AFTER + EXCLUSION_SECONDS - 1) == []
    assert held.expire(RENEW_AFTER + EXCLUSION_SECONDS) == [signer.node_id]
    assert signer.node_id not in held and held.next_timer() is None
    with pytest.raises(InvalidProof):
        held.add(RENEW_AFTER + EXCLUSION_SECONDS, signer.node_id, lies[1])
    assert held.add(RENEW_AFTER + EXCLUSION_SECONDS, signer.node_id, lies[2])
