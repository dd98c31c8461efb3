"""Weight for authority (issue 33, part 4), sans-IO: votes and proof witnesses count by credit on top of
the placed-and-measured floor, so placed identities with no served work can neither outvote members
who served nor frame a stage that served more than they did."""

from __future__ import annotations

import pytest
from instant_net import record
from test_authority import HONEST, TRACKER, framing, placed, placed_duties, placed_mesh_election

from meshd.mesh.credit import ASKER_WINDOW_CAP, MAX_EXTRA_VOTES, extra_votes
from meshd.mesh.election import Election
from meshd.mesh.proofs import InvalidProof

# six identities the tracker placed (real volunteers, some memory each) but that served nobody yet
PLACED_SYBILS = range(10, 16)


def _attack(election: Election) -> None:
    """The p26 bid with placed identities: each heard first-hand, claiming term 2 for the first."""
    for i in PLACED_SYBILS:
        fields = placed(i, tracker_term=2) if i == PLACED_SYBILS[0] else placed(i)
        election.observe(1.0, record(i, version=2, **fields, vote_term=2, vote_for=record(PLACED_SYBILS[0]).node_id),
                         live=True)


def test_placed_identities_without_served_work_take_the_tracker_by_count_but_not_by_credit() -> None:
    # by count alone (the floor): six placed sybils against five weighing members carry their claim
    election = placed_mesh_election()
    _attack(election)
    assert election.tracker is not None and election.tracker.node_id == record(PLACED_SYBILS[0]).node_id

    # with the members' credit (each served a few askers' worth), the same bid is a minority
    election = placed_mesh_election()
    tracker = election.tracker
    members = [0, TRACKER, *HONEST]
    election.credit(0.5, {record(i).node_id: extra_votes(8 * ASKER_WINDOW_CAP) for i in members})
    assert election.tracker == tracker
    _attack(election)
    assert election.tracker == tracker


def test_extra_votes_grow_by_doublings_of_served_work_and_are_capped() -> None:
    assert extra_votes(0.0) == extra_votes(-5.0) == extra_votes(ASKER_WINDOW_CAP / 2) == 0
    assert extra_votes(ASKER_WINDOW_CAP) == 1 and extra_votes(2 * ASKER_WINDOW_CAP) == 2
    assert extra_votes(1e12) == MAX_EXTRA_VOTES
    # a mesh's own cap (a test mesh's --asker-window-cap) in the product's place
    cap = ASKER_WINDOW_CAP / 8
    assert extra_votes(cap / 2, cap) == 0 and extra_votes(cap, cap) == 1 and extra_votes(4 * cap, cap) == 3


def test_two_placed_witnesses_convict_a_stage_that_served_no_more_than_they_and_frame_none_that_served_more() -> None:
    mesh = placed_duties()
    victim, bystander, _, proven = framing(mesh)
    witnesses = [w.node_id for w in proven.witnesses]
    # the victim served: its credit earns it 2 extra votes (weight 3) against its accusers' 1 + 1
    bystander.credit_weights(mesh.net.now, {victim.node_id: extra_votes(2 * ASKER_WINDOW_CAP)})
    with pytest.raises(InvalidProof, match="witnesses weigh 2 against the culprit's 3"):
        bystander.accept_proof(mesh.net.now, proven)
    assert bystander.liars == {}
    # witnesses that served as much as it did (weight 2 each: 4 against 3) convict it
    bystander.credit_weights(mesh.net.now, {victim.node_id: 2, **dict.fromkeys(witnesses, 1)})
    assert bystander.accept_proof(mesh.net.now, proven) == victim.node_id
