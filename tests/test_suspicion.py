"""Accusations weighed by authority (issue 33, part 4), sans-IO: a Lifeguard confirmation counts by its
accuser's weight, so free identities cannot hurry an honest member's death, and members that served
(placed, with credit) confirm it faster than a head count would."""

from __future__ import annotations

import math

import pytest
from instant_net import identity, record, rng

from meshd.mesh.membership import Ack, Alive, Gossip, Membership, MemberState, Ping, Suspect, SwimConfig
from meshd.mesh.suspicion import Suspicion

CONFIG = SwimConfig()
N = 10
MINIMUM = CONFIG.suspicion_mult * max(1.0, math.log10(N)) * CONFIG.probe_interval
# members 2-4 weigh (placed; member 4 with credit: 1 + 2 extra votes), 5-9 are free identities
WEIGHTS = {record(i).node_id: w for i, w in ((2, 1), (3, 1), (4, 3))}


def time_to_dead(accusers: range) -> float:
    """When node 0 holds member 1 dead, with `accusers` accusing it at once, the first starting it."""
    node = Membership(identity(0), record(0), 0.0, CONFIG, rng(0), weigh=lambda node_id: WEIGHTS.get(node_id, 0))
    for i in range(1, N):
        node.handle_message(0.0, f"peer{i}", Gossip(version=0, gossip=[Alive(record=record(i))]))
    target = record(1).node_id
    for accuser in accusers:
        # each signed by its accuser: relayed by "x", they count as independent accusers
        node.handle_message(0.0, "x", Gossip(version=0, gossip=[
            Suspect(node=target, incarnation=1, accuser=record(accuser).node_id).signed(identity(accuser))]))
    t = 0.0
    while node.state(target) is not MemberState.DEAD:
        t = node.next_timer()
        node.handle_timer(t)
        for dest, message in node.messages_to_send():  # every probe answered: no accusation of its own
            if isinstance(message, Ping):
                node.handle_message(t, dest, Ack(seq=message.seq, version=1))
    return t


def test_free_identities_confirming_a_suspicion_do_not_hurry_it_and_members_that_weigh_do() -> None:
    whole = CONFIG.suspicion_max_mult * MINIMUM
    # a free identity may start a suspicion (a member nobody placed sees deaths too): it runs its whole course
    assert time_to_dead(range(5, 6)) == pytest.approx(whole)
    # five free identities confirming it count for nothing
    assert time_to_dead(range(5, 10)) == pytest.approx(whole)
    # one placed member confirming counts once (by heads it was once too), two bring it to the minimum
    assert MINIMUM < time_to_dead(range(5, 7)) == pytest.approx(time_to_dead(range(5, 6)))
    assert MINIMUM < time_to_dead(range(2, 4)) < whole
    assert time_to_dead(range(2, 5)) == pytest.approx(MINIMUM)
    # a member with credit weighs as several confirmations: alone it brings the suspicion to the minimum
    assert time_to_dead(range(5, 6)) > time_to_dead(range(4, 6)[::-1]) == pytest.approx(MINIMUM)


def test_a_confirmation_of_no_weight_is_not_kept_and_the_weight_confirmed_is_capped() -> None:
    suspicion = Suspicion(incarnation=1, start=0.0, min_timeout=4.0, max_timeout=24.0, expected=2, accusers={"a"})
    assert suspicion.deadline == 24.0
    assert not suspicion.confirm("free", 0) and "free" not in suspicion.accusers
    assert suspicion.confirm("b", 5) and suspicion.deadline == 4.0
    assert not suspicion.confirm("c", 1)  # confirmed enough already
