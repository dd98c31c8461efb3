"""SWIM membership driven by hand: explicit times, instant delivery, no clock."""

from __future__ import annotations

import math

import msgpack
import pytest
from instant_net import InstantNet, identity, record, rng

from meshd.mesh.membership import (
    SWIM_MESSAGES,
    Ack,
    Alive,
    Dead,
    Gossip,
    Membership,
    MemberState,
    Ping,
    PingReq,
    Suspect,
    SwimConfig,
    SwimMessage,
    Sync,
    SyncEntry,
)
from wire.decode import decode, decode_body
from wire.errors import ErrorCode, ProtocolError
from wire.message import encode

CONFIG = SwimConfig()


def member(i: int, now: float = 0.0, **fields: object) -> Membership:
    return Membership(identity(i), record(i, **fields), now, CONFIG, rng(i))


def mesh(n: int) -> tuple[InstantNet, list[Membership]]:
    """n nodes, all joined through node 0."""
    nodes = [member(i) for i in range(n)]
    net = InstantNet(*nodes)
    for node in nodes[1:]:
        node.join(0.0, [nodes[0].node_id])
    net.flush()
    return net, nodes


def states(node: Membership, others: list[Membership]) -> list[MemberState | None]:
    return [node.state(other.node_id) for other in others]


def test_join_through_a_seed_spreads_every_record() -> None:
    seed, a, b = member(0), member(1), member(2)
    net = InstantNet(seed, a, b)
    a.join(0.0, [seed.node_id])
    net.flush()
    assert a.joined
    b.join(0.0, [seed.node_id])
    net.flush()
    # b learnt a from the seed's reply; a learns b from gossip within a few gossip rounds.
    assert b.state(a.node_id) is MemberState.ALIVE
    net.run_until(1.0)
    for node in (seed, a, b):
        assert node.live_count() == 3
        assert {r.node_id for r in node.live_records()} == {seed.node_id, a.node_id, b.node_id}
    assert [event.kind for event in a.events()] == ["joined", "joined"]


def test_join_is_retried_until_a_seed_answers() -> None:
    seed, a = member(0), member(1)
    net = InstantNet(seed, a)
    net.down.add(seed.node_id)
    a.join(0.0, [seed.node_id])
    net.run_until(5.0)
    assert not a.joined
    net.down.clear()
    net.run_until(5.0 + CONFIG.join_retry_interval)
    assert a.joined and a.state(seed.node_id) is MemberState.ALIVE


def test_probes_are_acked_and_measure_rtt() -> None:
    net, nodes = mesh(4)
    net.run_until(20.0)
    assert all(node.live_count() == 4 for node in nodes)
    assert nodes[0].rtt(nodes[1].node_id) == 0.0  # instant delivery
    kinds = {type(message) for _, _, _, message in net.log}
    assert {Ping, Ack, Sync, Gossip} <= kinds
    assert PingReq not in kinds  # nobody missed an ack


def test_indirect_probe_keeps_a_node_reachable_only_through_others() -> None:
    net, nodes = mesh(5)
    a, b = nodes[1], nodes[2]
    net.blocked |= {(a.node_id, b.node_id), (b.node_id, a.node_id)}
    net.run_until(60.0)
    assert a.state(b.node_id) is MemberState.ALIVE
    assert b.refutations == 0  # never even suspected
    assert any(isinstance(message, PingReq) for _, _, _, message in net.log)


def test_a_crashed_node_is_suspected_then_declared_dead() -> None:
    net, nodes = mesh(5)
    net.run_until(10.0)
    crashed = nodes[3]
    net.down.add(crashed.node_id)
    crash_time = net.now
    observer = nodes[0]
    suspected_at = dead_at = None
    while dead_at is None:
        net.run_until(net.now + 0.1)
        state = observer.state(crashed.node_id)
        if state is MemberState.SUSPECT and suspected_at is None:
            suspected_at = net.now
        if state is MemberState.DEAD:
            dead_at = net.now
        assert net.now - crash_time < 60, "never declared dead"
    # Four live prober share the load: someone probes it within a few periods.
    assert suspected_at - crash_time <= 5 * CONFIG.probe_interval
    # The others confirm, so Lifeguard lets the timeout fall towards its minimum, 4 * max(1, log10 N)
    # periods, far below its maximum of six times that.
    assert 3.9 * CONFIG.probe_interval <= dead_at - suspected_at <= 8 * CONFIG.probe_interval
    assert all(node.state(crashed.node_id) is MemberState.DEAD for node in nodes if node is not crashed)
    assert all(node.live_count() == 4 for node in nodes if node is not crashed)


def test_a_suspect_refutes_by_signing_a_newer_record() -> None:
    net, nodes = mesh(4)
    net.run_until(5.0)
    accused = nodes[2]
    version = accused.record.version
    # A false accusation reaches node 0, which gossips it; the accused hears and refutes.
    nodes[0].handle_message(
        net.now,
        nodes[1].node_id,
        Gossip(
            version=0, gossip=[Suspect(node=accused.node_id, incarnation=version, accuser=nodes[1].node_id)]
        ),
    )
    assert nodes[0].state(accused.node_id) is MemberState.SUSPECT
    net.run_until(net.now + 3.0)
    assert accused.record.version > version and accused.refutations == 1
    assert all(node.state(accused.node_id) is MemberState.ALIVE for node in nodes)
    assert all(node.record_of(accused.node_id).version == accused.record.version for node in nodes)


def test_lifeguard_suspicion_shrinks_with_independent_confirmations() -> None:
    def time_to_dead(confirmers: int) -> float:
        node = member(0)
        for i in range(1, 10):
            node.handle_message(0.0, f"peer{i}", Gossip(version=0, gossip=[Alive(record=record(i))]))
        target = record(1).node_id
        for accuser in range(2, 3 + confirmers):
            node.handle_message(
                0.0,
                "x",
                Gossip(
                    version=0,
                    # each signed by its accuser: relayed by "x", they count as independent accusers
                    gossip=[Suspect(node=target, incarnation=1, accuser=record(accuser).node_id).signed(
                        identity(accuser))],
                ),
            )
        t = 0.0
        while node.state(target) is not MemberState.DEAD:
            t = node.next_timer()
            node.handle_timer(t)
            # Every probe is answered, so this node adds no accusation of its own.
            for dest, message in node.messages_to_send():
                if isinstance(message, Ping):
                    node.handle_message(t, dest, Ack(seq=message.seq, version=1))
        return t

    n = 10
    minimum = CONFIG.suspicion_mult * max(1.0, math.log10(n)) * CONFIG.probe_interval
    assert time_to_dead(0) == pytest.approx(CONFIG.suspicion_max_mult * minimum)
    assert minimum < time_to_dead(1) < CONFIG.suspicion_max_mult * minimum
    assert time_to_dead(2) == pytest.approx(minimum)
    assert time_to_dead(5) == pytest.approx(minimum)


def test_graceful_leave_is_final_and_signed() -> None:
    net, nodes = mesh(4)
    net.run_until(5.0)
    leaver = nodes[1]
    leaver.leave(net.now)
    net.run_until(net.now + 2.0)
    for node in nodes:
        if node is not leaver:
            assert node.state(leaver.node_id) is MemberState.LEFT
            assert "left" in [event.kind for event in node.events()]
            assert node.live_count() == 3
    # Nobody probes it any more, and it stopped probing.
    sent_after = [(src, dest) for t, src, dest, _ in net.log if t > net.now - 1.0]
    assert all(leaver.node_id not in pair for pair in sent_after)


def test_forged_and_replayed_gossip_is_dropped() -> None:
    net, nodes = mesh(3)
    net.run_until(5.0)
    victim = nodes[2]
    observer = nodes[0]
    forged = victim.record.model_copy(update={"version": victim.record.version + 5, "memory_bytes": 1 << 45})
    observer.handle_message(net.now, nodes[1].node_id, Gossip(version=0, gossip=[Alive(record=forged)]))
    assert observer.record_of(victim.node_id).memory_bytes == victim.record.memory_bytes
    assert observer.record_stats.forged == 1
    # A crashed node is dead; replaying its last record does not bring a ghost back.
    old = victim.record
    net.down.add(victim.node_id)
    net.run_until(net.now + 40.0)
    assert observer.state(victim.node_id) is MemberState.DEAD
    observer.handle_message(net.now, nodes[1].node_id, Gossip(version=0, gossip=[Alive(record=old)]))
    assert observer.state(victim.node_id) is MemberState.DEAD


def test_a_node_that_missed_an_update_pulls_it_from_the_next_message() -> None:
    net, nodes = mesh(4)
    net.run_until(5.0)
    deaf = nodes[0]
    net.blocked = {(other.node_id, deaf.node_id) for other in nodes[1:]}
    nodes[2].update_record(net.now, load=0.5)
    net.run_until(net.now + 2.0)  # the update's retransmissions are spent meanwhile
    assert deaf.record_of(nodes[2].node_id).load == 0.0
    net.blocked.clear()
    net.run_until(net.now + 3.0)  # well before any push-pull
    for other in nodes[1:]:
        assert deaf.record_of(other.node_id).version == other.record.version
    assert any(
        isinstance(m, Sync) and src == deaf.node_id and len(m.entries) == 1 for _, src, _, m in net.log
    )


def test_accusations_naming_a_version_never_published_are_ignored() -> None:
    net, nodes = mesh(3)
    net.run_until(5.0)
    target, observer = nodes[2], nodes[0]
    version = target.record.version
    # Unsigned accusations at a made-up version would force a refutation above it: dropped.
    inflated = Suspect(node=target.node_id, incarnation=version + 10**9, accuser=nodes[1].node_id)
    target.handle_message(net.now, nodes[1].node_id, Gossip(version=0, gossip=[inflated]))
    observer.handle_message(net.now, nodes[1].node_id, Gossip(version=0, gossip=[inflated]))
    assert target.record.version == version and target.refutations == 0
    assert observer.state(target.node_id) is MemberState.ALIVE
    stale = Dead(node=target.node_id, incarnation=version - 1, accuser=nodes[1].node_id)
    observer.handle_message(net.now, nodes[1].node_id, Gossip(version=0, gossip=[stale]))
    assert observer.state(target.node_id) is MemberState.ALIVE


def test_members_lists_the_mesh_for_status_and_no_departed_member() -> None:
    net, nodes = mesh(4)
    net.run_until(5.0)
    listed = {info.node_id: info for info in nodes[0].members()}
    assert listed[nodes[2].node_id].record == nodes[2].record and listed[nodes[1].node_id].rtt == 0.0
    net.down.add(nodes[2].node_id)
    nodes[3].leave(net.now)
    # listed until this node holds it dead (or gone), and not a moment after
    while nodes[0].state(nodes[2].node_id) is not MemberState.DEAD:
        assert nodes[2].node_id in {info.node_id for info in nodes[0].members()}
        net.run_until(net.now + 0.1)
    listed = {info.node_id: info for info in nodes[0].members()}
    assert nodes[0].state(nodes[3].node_id) is MemberState.LEFT
    assert set(listed) == {nodes[0].node_id, nodes[1].node_id}
    assert all(info.state is MemberState.ALIVE for info in listed.values())


def test_the_table_forgets_a_dead_member_within_its_bound_and_a_sync_does_not_bring_it_back() -> None:
    config = CONFIG
    net, nodes = mesh(3)
    net.run_until(5.0)
    net.down.add(nodes[2].node_id)
    while nodes[0].state(nodes[2].node_id) is not MemberState.DEAD:
        net.run_until(net.now + 0.5)
    died = net.now
    net.run_until(died + config.reap_after + config.push_pull_interval + 1.0)
    assert nodes[0].state(nodes[2].node_id) is None and nodes[1].state(nodes[2].node_id) is None
    # one member's Sync naming it dead (its last record) brings it back to neither table
    nodes[0].handle_message(net.now, nodes[1].node_id, Sync(reply=False, entries=[
        SyncEntry(record=nodes[2].record, state="dead")]))
    assert nodes[0].state(nodes[2].node_id) is None


def test_a_node_restarting_with_an_old_version_supersedes_its_previous_life() -> None:
    net, nodes = mesh(3)
    net.run_until(5.0)
    old = nodes[2]
    old.update_record(net.now, load=0.5)
    old_version = old.update_record(net.now, load=0.7).version
    net.run_until(net.now + 2.0)
    assert nodes[0].record_of(old.node_id).version == old_version
    del net.nodes[old.node_id]
    reborn = Membership(identity(2), record(2, version=1), net.now, CONFIG, rng(99))
    net.add(reborn)
    reborn.join(net.now, [nodes[0].node_id])
    net.run_until(net.now + 5.0)
    assert reborn.record.version > old_version
    assert all(node.state(reborn.node_id) is MemberState.ALIVE for node in nodes[:2])


def test_dead_members_are_retried_so_a_partition_heals() -> None:
    net, nodes = mesh(6)
    net.run_until(5.0)
    left, right = nodes[:3], nodes[3:]
    net.blocked = {(a.node_id, b.node_id) for a in left for b in right} | {
        (b.node_id, a.node_id) for a in left for b in right
    }
    net.run_until(60.0)
    assert states(left[0], right) == [MemberState.DEAD] * 3
    net.blocked.clear()
    net.run_until(60.0 + 2 * CONFIG.reconnect_interval)
    assert all(node.live_count() == 6 for node in nodes)


def test_messages_round_trip_through_the_wire_codec() -> None:
    rec = record(1)
    messages = [
        Ping(seq=1, version=1, gossip=[Alive(record=rec)]),
        Ack(seq=1, version=1, gossip=[Suspect(node=rec.node_id, incarnation=1, accuser="b" * 40)]),
        PingReq(
            seq=2,
            target=rec.node_id,
            version=1,
            gossip=[Dead(node=rec.node_id, incarnation=1, accuser="c" * 40)],
        ),
        Gossip(version=0, gossip=[]),
        Sync(reply=True, entries=[SyncEntry(record=rec, state="alive")]),
    ]
    for message in messages:
        received = decode(encode(message))
        assert received == message
        assert type(received) is type(message)
        assert isinstance(received, SWIM_MESSAGES)
    assert decode(encode(messages[0])).gossip[0].record.verify()


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "swim.ping", "v": 1},
        {"type": "swim.ping", "v": 2, "seq": 1, "version": 1},
        {"type": "swim.ping", "v": 1, "seq": -1, "version": 1},
        {
            "type": "swim.gossip",
            "v": 1,
            "version": 1,
            "gossip": [{"kind": "alive", "record": {"node_id": "x"}}],
        },
        {"type": "swim.gossip", "v": 1, "version": 1, "gossip": [{"kind": "rumour"}]},
        {"type": "swim.sync", "v": 1, "reply": True, "entries": [{"record": 1, "state": "alive"}]},
    ],
)
def test_malformed_messages_are_typed_errors(bad: dict) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_body(msgpack.packb(bad, use_bin_type=True))
    assert caught.value.code is ErrorCode.BAD_REQUEST


def test_the_next_timer_is_the_only_time_anything_happens() -> None:
    node = member(0)
    other = member(1)
    node.handle_message(0.0, other.node_id, Gossip(version=0, gossip=[Alive(record=other.record)]))
    node.messages_to_send()
    deadline = node.next_timer()
    node.handle_timer(deadline - 1e-6)
    assert node.messages_to_send() == []
    node.handle_timer(deadline)
    assert node.next_timer() > deadline



class Planted:
    """A planted member's address, as a fake: it takes every message and never answers."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.received: list[tuple[str, SwimMessage]] = []

    def handle_message(self, now: float, src: str, message: SwimMessage) -> None:
        self.received.append((src, message))

    def pings_from(self, src: str) -> int:
        return sum(1 for sender, message in self.received if sender == src and isinstance(message, Ping))

    def handle_timer(self, now: float) -> None:
        pass

    def next_timer(self) -> float | None:
        return None

    def messages_to_send(self) -> list[tuple[str, SwimMessage]]:
        return []


def test_members_known_second_hand_are_pinged_to_confirm_them_and_planted_ones_never_are() -> None:
    net, nodes = mesh(3)
    net.run_until(10.0)
    node = nodes[0]
    assert all(node.first_hand(other.node_id) for other in nodes[1:])
    # A real member (answering, but talking to nobody of its own accord) and a hundred planted records
    # reach `node` in one Sync from another member: all live, none heard from first-hand.
    quiet = member(50)
    planted = [record(1000 + i) for i in range(100)]
    holes = [Planted(r.node_id) for r in planted]
    for driven in [quiet, *holes]:
        net.add(driven)
    entries = [SyncEntry(record=r, state="alive") for r in [quiet.record, *planted]]
    node.handle_message(net.now, nodes[1].node_id, Sync(reply=False, entries=entries))
    ids = [r.node_id for r in planted]
    assert all(node.state(i) is MemberState.ALIVE and not node.first_hand(i) for i in [quiet.node_id, *ids])
    net.run_until(net.now + CONFIG.probe_interval)
    # The first probe period's confirmations reached it (it came first), and a bounded few others:
    # `confirmations` and a probe at each of the (at most two) ticks in that second.
    assert node.first_hand(quiet.node_id)
    assert sum(hole.pings_from(node.node_id) for hole in holes) <= 2 * (CONFIG.confirmations + 1)
    net.run_until(net.now + math.ceil(len(planted) / CONFIG.confirmations) * CONFIG.probe_interval)
    # Every planted member was asked; none answered, so none is first-hand (and none votes).
    assert all(hole.pings_from(node.node_id) for hole in holes)
    assert not any(node.first_hand(i) for i in ids)
