"""Attacks on gossip by one member (the attacker: a peer sending what meshd's own membership would
never send), against honest `Membership` machines on an instant network with explicit time."""

from __future__ import annotations

import math

from instant_net import InstantNet, identity, record, rng

from meshd.mesh.membership import Ack, Alive, Dead, Gossip, Membership, MemberState, Ping, Suspect, SwimConfig, Sync
from meshd.mesh.status import status_view
from wire.decode import decode
from wire.meshrpc import StatusReply
from wire.message import encode
from wire.swim import MAX_SERVED, ServedRange, SyncEntry

CONFIG = SwimConfig()


def member(i: int, now: float = 0.0) -> Membership:
    return Membership(identity(i), record(i), now, CONFIG, rng(i))


def test_one_member_sending_dead_every_50_ms_never_kills_a_healthy_member() -> None:
    nodes = [member(i) for i in range(6)]
    net = InstantNet(*nodes)
    for node in nodes[1:]:
        node.join(0.0, [nodes[0].node_id])
    net.run_until(5.0)
    victim, attacker, bystanders = nodes[0], nodes[5], nodes[1:5]
    dead_samples = 0
    for step in range(400):  # 20 s of accusations, each naming the victim's current incarnation
        now = net.now
        incarnation = victim.record.version
        for node in bystanders:
            # Signed by the attacker itself, and again unsigned naming each bystander as accuser.
            own = Dead(node=victim.node_id, incarnation=incarnation, accuser=attacker.node_id).signed(identity(5))
            framed = [Dead(node=victim.node_id, incarnation=incarnation, accuser=b.node_id) for b in bystanders]
            node.handle_message(now, attacker.node_id, Gossip(version=attacker.record.version, gossip=[own, *framed]))
        net.run_until(now + 0.05)
        if step % 5 == 0:
            dead_samples += sum(node.state(victim.node_id) is MemberState.DEAD for node in bystanders)
    assert dead_samples == 0
    assert victim.refutations > 0  # it heard of the suspicion and refuted it


def test_unsigned_accusations_naming_others_count_as_their_senders_alone() -> None:
    def time_to_dead(signed: bool) -> float:
        node = member(0)
        for i in range(1, 10):
            node.handle_message(0.0, record(i).node_id, Gossip(version=0, gossip=[Alive(record=record(i))]))
        target = record(1).node_id
        liar = record(2).node_id
        for accuser in range(3, 8):
            suspect = Suspect(node=target, incarnation=1, accuser=record(accuser).node_id)
            update = suspect.signed(identity(accuser)) if signed else suspect
            node.handle_message(0.0, liar, Gossip(version=0, gossip=[update]))
        t = 0.0
        for _ in range(10_000):
            if node.state(target) is MemberState.DEAD:
                return t
            t = node.next_timer() or t
            node.handle_timer(t)
            for dest, message in node.messages_to_send():
                if isinstance(message, Ping):  # every probe answered: no accusation of its own
                    node.handle_message(t, dest, Ack(seq=message.seq, version=1))
        raise AssertionError("never declared dead")

    minimum = CONFIG.suspicion_mult * max(1.0, math.log10(10)) * CONFIG.probe_interval
    # Five accusers one peer made up: one accusation, so Lifeguard's longest timeout.
    assert time_to_dead(signed=False) == CONFIG.suspicion_max_mult * minimum
    # The same five, each signed by its accuser: independent confirmations, the shortest.
    assert time_to_dead(signed=True) == minimum


def test_a_forged_accuser_signature_counts_as_the_sender() -> None:
    node = member(0)
    for i in range(1, 6):
        node.handle_message(0.0, record(i).node_id, Gossip(version=0, gossip=[Alive(record=record(i))]))
    target, liar = record(1).node_id, record(2).node_id
    forged = Suspect(node=target, incarnation=1, accuser=record(4).node_id).signed(identity(4))
    forged = forged.model_copy(update={"accuser": record(3).node_id})  # another accuser, same signature
    node.handle_message(0.0, liar, Gossip(version=0, gossip=[forged]))
    node.handle_message(0.0, liar, Gossip(version=0, gossip=[Suspect(node=target, incarnation=1, accuser=liar)]))
    assert node.state(target) is MemberState.SUSPECT
    assert node.suspicions.held[target].accusers == {liar}


def test_syncs_planting_thousands_of_members_are_capped_per_sender_and_in_all() -> None:
    config = SwimConfig(max_members=300, introductions=100, introductions_per_second=1.0)
    node = Membership(identity(0), record(0), 0.0, config, rng(0))
    fakes = [record(1000 + i) for i in range(400)]
    planter_a, planter_b = record(1).node_id, record(2).node_id

    def sync(batch: list, state: str) -> Sync:
        return Sync(reply=False, entries=[SyncEntry(record=r, state=state) for r in batch])

    node.handle_message(0.0, planter_a, sync(fakes[:200], "alive"))
    assert node.live_count() == 1 + 100  # its burst of introductions, then nothing
    node.handle_message(0.0, planter_a, sync(fakes[200:300], "alive"))
    assert node.live_count() == 101
    node.handle_message(0.0, planter_b, sync(fakes[100:400], "dead"))  # dead ones are capped too

    def table() -> int:  # members the table holds, the dead (which status does not list) included
        return sum(node.state(fake.node_id) is not None for fake in fakes)

    assert table() <= 200
    # The table never passes its cap, however many senders plant.
    for sender in range(3, 8):
        node.handle_message(1000.0 * sender, record(sender).node_id, sync(fakes, "alive"))
    assert table() <= config.max_members
    # A member introducing itself is always heard, even from a sender that spent its budget.
    node.handle_message(1000.0 * 7, record(7).node_id, Gossip(version=0, gossip=[Alive(record=record(7))]))


def test_a_record_with_every_served_range_it_may_hold_shows_in_status_whole() -> None:
    wide = record(1, served=[ServedRange(model=f"sha256:{i}", start=0, end=1) for i in range(MAX_SERVED)])
    node = member(0)
    node.handle_message(0.0, wide.node_id, Gossip(version=0, gossip=[Alive(record=wide)]))
    reply = status_view(node.node_id, node.members(), node.live_records(), None)
    shown = next(m for m in reply.members if m.node_id == wide.node_id)
    assert len(shown.served) == MAX_SERVED
    again = decode(encode(reply))
    assert isinstance(again, StatusReply) and again == reply


def spammed(seconds: float, to_victim: bool = True) -> tuple[InstantNet, list[Membership], int]:
    """Six members; the last (the attacker) sends a `Dead` of the first (the victim) signed by itself,
    naming the victim's current incarnation, every 50 ms for `seconds` to each bystander (and to the
    victim itself); the victim's refutations meanwhile."""
    nodes = [member(i) for i in range(6)]
    net = InstantNet(*nodes)
    for node in nodes[1:]:
        node.join(0.0, [nodes[0].node_id])
    net.run_until(5.0)
    for node in nodes:
        node.events()
    victim, attacker = nodes[0], nodes[5]
    refuted = victim.refutations
    end = net.now + seconds
    while net.now < end:
        dead = Dead(node=victim.node_id, incarnation=victim.record.version, accuser=attacker.node_id).signed(identity(5))
        for node in nodes[:5] if to_victim else nodes[1:5]:
            node.handle_message(net.now, attacker.node_id, Gossip(version=attacker.record.version, gossip=[dead]))
        net.run_until(net.now + 0.05)
    return net, nodes, victim.refutations - refuted


def test_a_stream_of_signed_accusations_re_signs_the_victim_and_makes_it_suspect_a_bounded_number_of_times() -> None:
    seconds = 20.0
    _, nodes, refutations = spammed(seconds)
    victim, bystanders = nodes[0], nodes[1:5]
    # 400 accusations: the victim's record is re-signed at most once a refute interval
    assert 0 < refutations <= seconds / CONFIG.refute_interval + 1
    for node in bystanders:
        suspected = [e for e in node.events() if e.node_id == victim.node_id and e.kind == "suspect"]
        # each believed the attacker its burst of accusations, then one each shortest suspicion
        assert 0 < len(suspected) <= CONFIG.accusations + seconds / (CONFIG.suspicion_mult * CONFIG.probe_interval)
        assert node.state(victim.node_id) is not MemberState.DEAD


def test_an_accuser_over_its_count_leaves_others_accusations_counting_and_refutations_in_time() -> None:
    # the attacker sends its accusations of the victim only to the bystanders, and spends its count there
    net, nodes, _ = spammed(10.0, to_victim=False)
    victim, bystanders, attacker = nodes[0], nodes[1:5], nodes[5]
    watcher = bystanders[0]
    assert watcher.state(victim.node_id) is MemberState.ALIVE
    over = Dead(node=victim.node_id, incarnation=victim.record.version, accuser=attacker.node_id).signed(identity(5))
    watcher.handle_message(net.now, attacker.node_id, Gossip(version=0, gossip=[over]))
    assert watcher.state(victim.node_id) is MemberState.ALIVE  # dropped: nothing to refute
    # another accuser's word still counts ...
    honest = bystanders[1]
    accusation = Suspect(node=victim.node_id, incarnation=victim.record.version,
                         accuser=honest.node_id).signed(identity(2))
    version = victim.record.version
    watcher.handle_message(net.now, honest.node_id, Gossip(version=honest.record.version, gossip=[accusation]))
    assert watcher.state(victim.node_id) is MemberState.SUSPECT
    # ... and the victim, told of it by gossip, refutes within a refute interval: long before the
    # suspicion's shortest timeout
    net.run_until(net.now + CONFIG.refute_interval + 0.5)
    assert victim.record.version > version and watcher.state(victim.node_id) is MemberState.ALIVE
