"""The stage's books against an attacking member: stolen sessions, forged upstreams, slot and KV hogs;
and the daemon's word on whom a stage may dial.

The attacker here is a node id in the books (sans-IO, no clock): it opens the
most sessions it can and keeps each one warm (a row a second, so none is ever
idle long enough for least-recently-used eviction), or holds most of the KV.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from meshd.daemon import MeshDaemon
from meshd.mesh.addresses import source_group
from meshd.stage.books import Phase, SessionBook, StageBooks, StageLimits
from wire.errors import ErrorCode, ProtocolError
from wire.stage import PeerRef

ATTACKER, BYSTANDER, OTHER = "attacker", "bystander", "other"


def books(**limits: Any) -> StageBooks[None]:
    return StageBooks(StageLimits(**({"max_sessions": 4, "max_session_tokens": 64, "max_total_tokens": 256,
                                      "ttl": 300.0, "evict_after": 2.0} | limits)))


def opened(b: StageBooks[None], name: str, owner: str, now: float, epoch: int = 0) -> SessionBook:
    book, _ = b.open(name, epoch, 1, 16, (), now, owner=owner)
    b.opened(book)
    b.set_prompt(book, 1)
    return book


def step(b: StageBooks[None], book: SessionBook, now: float, n: int = 1) -> None:
    """One row (or ``n``) of ``book`` queued and run at ``now``: the session is warm, not idle."""
    b.enqueue(book, book.next_pos, n, None, now)
    for work in b.next_batch():
        b.ran(work, now)


def test_an_open_of_a_held_session_id_by_another_node_is_refused_and_the_session_lives() -> None:
    b = books()
    honest = opened(b, "s", BYSTANDER, 0.0)
    with pytest.raises(ProtocolError) as err:
        b.open("s", 9, 1, 16, (), 1.0, owner=ATTACKER)
    assert err.value.code is ErrorCode.UNAUTHORIZED
    assert b.holds(honest) and honest.phase is Phase.PREFILL and honest.epoch == 0
    # its own opener may still re-open it at a higher epoch (failover)
    again, gone = b.open("s", 1, 1, 16, (), 2.0, owner=BYSTANDER)
    assert gone == [honest] and again.epoch == 1


def test_rows_come_only_from_the_named_upstream_or_else_from_the_opener() -> None:
    b = books()
    named, _ = b.open("a", 0, 1, 16, (), 0.0, owner=BYSTANDER, upstream=OTHER)
    b.check_upstream(named, OTHER)
    for sender in (ATTACKER, BYSTANDER):
        with pytest.raises(ProtocolError) as err:
            b.check_upstream(named, sender)
        assert err.value.code is ErrorCode.UNAUTHORIZED
    own, _ = b.open("b", 0, 1, 16, (), 0.0, owner=BYSTANDER)
    b.check_upstream(own, BYSTANDER)
    with pytest.raises(ProtocolError, match=r"^UNAUTHORIZED: session b takes its rows from another node$"):
        b.check_upstream(own, ATTACKER)


def test_four_warm_attacker_sessions_do_not_lock_bystanders_out_of_four_slots() -> None:
    b = books()
    hogs = [opened(b, f"hog{i}", ATTACKER, 0.0) for i in range(4)]
    now = 0.0
    for _ in range(5):
        now += 1.0
        for hog in hogs:
            step(b, hog, now)
    first, gone = b.open("by1", 0, 1, 16, (), now, owner=BYSTANDER)
    assert len(gone) == 1 and gone[0].owner == ATTACKER and gone[0].phase is Phase.FAILED
    assert gone[0].failure is not None and gone[0].failure.code is ErrorCode.CACHE_MISS
    assert "held the most" in gone[0].failure.message
    second, gone = b.open("by2", 0, 1, 16, (), now, owner=OTHER)
    assert [g.owner for g in gone] == [ATTACKER]
    # now the attacker holds 2 of 4: re-opening costs it its own turn, not a bystander's
    with pytest.raises(ProtocolError) as err:
        b.open("hog9", 0, 1, 16, (), now, owner=ATTACKER)
    assert err.value.code is ErrorCode.OVERLOADED
    assert b.holds(first) and b.holds(second)
    assert sorted(s.owner for s in b.sessions.values()) == [ATTACKER, ATTACKER, BYSTANDER, OTHER]


def test_a_node_alone_keeps_its_busy_sessions_and_is_told_it_is_overloaded() -> None:
    b = books()
    mine = [opened(b, f"m{i}", BYSTANDER, 0.0) for i in range(4)]
    for book in mine:
        step(b, book, 1.0)
    with pytest.raises(ProtocolError) as err:
        b.open("m9", 0, 1, 16, (), 1.5, owner=BYSTANDER)
    assert err.value.code is ErrorCode.OVERLOADED and err.value.retry_after_ms
    assert all(b.holds(book) for book in mine)


def test_the_kv_hog_loses_a_session_before_a_bystander_is_refused_tokens() -> None:
    b = books(max_total_tokens=128)
    hogs = [opened(b, f"hog{i}", ATTACKER, 0.0) for i in range(2)]
    for hog in hogs:
        step(b, hog, 1.0, n=60)
    bystander = opened(b, "by", BYSTANDER, 1.0)
    step(b, bystander, 1.5, n=8)
    gone = b.enqueue(bystander, bystander.next_pos, 8, None, 1.5)
    assert [g.owner for g in gone] == [ATTACKER]
    assert b.total_tokens <= 128 and b.holds(bystander)


def test_the_heaviest_nodes_session_goes_before_a_lighter_nodes_older_idle_one() -> None:
    b = books()
    light = opened(b, "l", BYSTANDER, 0.0)
    heavy = [opened(b, f"h{i}", ATTACKER, 1.0) for i in range(3)]
    step(b, heavy[0], 9.0)
    _, gone = b.open("o", 0, 1, 16, (), 20.0, owner=OTHER)
    assert gone == [heavy[1]] and b.holds(light)


def test_a_daemon_stage_dials_only_a_live_member_at_an_address_its_record_names() -> None:
    member = SimpleNamespace(node_id="m" * 40, addresses=["10.0.0.2:7000"], relay_addresses=[])
    daemon = SimpleNamespace(live_records=lambda: [member])
    MeshDaemon.may_dial(daemon, PeerRef(address="10.0.0.2:7000", node_id=member.node_id))  # type: ignore[arg-type]
    for ref, code in ((PeerRef(address="127.0.0.1:8080/admin", node_id=member.node_id), ErrorCode.UNAUTHORIZED),
                      (PeerRef(address="10.0.0.2:7000", node_id="x" * 40), ErrorCode.UNREACHABLE),
                      (PeerRef(address="10.0.0.2:7000"), ErrorCode.BAD_REQUEST)):
        with pytest.raises(ProtocolError) as err:
            MeshDaemon.may_dial(daemon, ref)  # type: ignore[arg-type]
        assert err.value.code is code


def opened_at(b: StageBooks[None], name: str, owner: str, source: str, now: float) -> SessionBook:
    book, _ = b.open(name, 0, 1, 16, (), now, owner=owner, source=source)
    b.opened(book)
    b.set_prompt(book, 1)
    return book


def test_many_identities_from_one_address_weigh_as_one_peer_and_a_bystander_elsewhere_gets_a_slot() -> None:
    b = books()
    sybils = [opened_at(b, f"s{i}", f"sybil{i}", "10.0.0.9", 0.0) for i in range(4)]
    for now in (0.5, 1.0, 1.5):  # each warm: none is idle long enough to go as least recently used
        for book in sybils:
            step(b, book, now)
    mine, gone = b.open("mine", 0, 1, 16, (), 1.6, owner=BYSTANDER, source="10.0.0.1")
    assert len(gone) == 1 and gone[0] in sybils and gone[0].failure is not None
    assert "its address held the most" in gone[0].failure.message
    # from the same address as the sybils a newcomer is one of them: nobody is evicted for it
    with pytest.raises(ProtocolError) as refused:
        b.open("more", 0, 1, 16, (), 1.7, owner=OTHER, source="10.0.0.9")
    assert refused.value.code is ErrorCode.OVERLOADED and mine.id in b.sessions


@pytest.mark.parametrize("same", ["node", "address"])
def test_a_peer_over_its_session_quota_is_refused_retryably_and_others_are_not(same: str) -> None:
    b = books(peer_sessions=2)
    peer = (lambda i: (ATTACKER, f"10.0.0.{i}")) if same == "node" else (lambda i: (f"id{i}", "10.0.0.9"))
    for i in range(2):
        opened_at(b, f"a{i}", *peer(i), now=0.0)
    with pytest.raises(ProtocolError) as refused:
        b.open("a2", 0, 1, 16, (), 0.0, owner=peer(2)[0], source=peer(2)[1])
    assert refused.value.code is ErrorCode.OVERLOADED and refused.value.retry_after_ms
    assert "holds 2 sessions on this stage, the most one peer may is 2" in refused.value.message
    opened_at(b, "b", BYSTANDER, "10.0.0.1", 0.0)
    # a re-open at a higher epoch replaces the peer's own session: within its quota
    again, _ = b.open("a0", 1, 1, 16, (), 0.1, owner=peer(0)[0], source=peer(0)[1])
    assert again.epoch == 1


def test_a_peer_over_its_kv_token_quota_is_refused_before_its_rows_are_queued() -> None:
    b = books(peer_tokens=8)
    first, second = opened_at(b, "a0", ATTACKER, "10.0.0.9", 0.0), opened_at(b, "a1", ATTACKER, "10.0.0.9", 0.0)
    step(b, first, 0.1, n=5)
    with pytest.raises(ProtocolError) as refused:
        b.enqueue(second, 0, 4, None, 0.2)
    assert refused.value.code is ErrorCode.OVERLOADED and "holds 5 KV tokens" in refused.value.message
    assert second.next_pos == 0 and not b.queued
    step(b, second, 0.3, n=3)
    bystander = opened_at(b, "b", BYSTANDER, "10.0.0.1", 0.4)
    step(b, bystander, 0.5, n=8)


def test_ipv6_sources_count_by_their_64_and_ipv4_by_address() -> None:
    assert source_group("2001:db8:1:2:aaaa::1") == source_group("2001:db8:1:2:ffff:1:2:3") == "2001:db8:1:2::/64"
    assert source_group("2001:db8:1:3::1") == "2001:db8:1:3::/64"
    assert source_group("::ffff:10.0.0.9") == source_group("10.0.0.9") == "10.0.0.9"
    assert source_group("10.0.0.8") != source_group("10.0.0.9")
    assert source_group("") == "" and source_group("relay.example") == "relay.example"


def test_sessions_from_many_addresses_of_one_ipv6_64_weigh_as_one_source() -> None:
    b = books()
    hogs = [opened_at(b, f"h{i}", f"id{i}", f"2001:db8:1:2::{i + 1:x}", 0.0) for i in range(4)]
    for now in (0.5, 1.0, 1.5):
        for book in hogs:
            step(b, book, now)
    # well within the tenure: only being the heaviest source costs them a session
    mine, gone = b.open("mine", 0, 1, 16, (), 1.6, owner=BYSTANDER, source="2001:db8:1:3::1")
    assert len(gone) == 1 and gone[0] in hogs and gone[0].failure is not None
    assert "its address held the most of them (4)" in gone[0].failure.message
    assert b.holds(mine) and mine.source == "2001:db8:1:3::/64"


def four_warm_sources(b: StageBooks[None], until: float) -> list[SessionBook]:
    """One session from each of 10.0.0.2..5, opened a second apart from 0 s, each fed a row
    every half second up to ``until``: never idle, and no source holds more than another."""
    hogs = [opened_at(b, f"h{i}", f"id{i}", f"10.0.0.{i + 2}", float(i)) for i in range(4)]
    now = 0.0
    while now < until:
        now += 0.5
        for book in hogs:
            step(b, book, now)
    return hogs


def test_four_sources_with_one_warm_session_each_give_up_the_oldest_hold_once_it_has_had_its_tenure() -> None:
    b = books(tenure=10.0)
    hogs = four_warm_sources(b, 9.5)
    # no hold is 10 s old yet: the claimant waits (a retryable refusal) and nobody is evicted
    with pytest.raises(ProtocolError) as refused:
        b.open("mine", 0, 1, 16, (), 9.5, owner=BYSTANDER, source="10.0.0.1")
    assert refused.value.code is ErrorCode.OVERLOADED and refused.value.retry_after_ms
    assert all(b.holds(h) for h in hogs)
    step(b, hogs[1], 10.5)
    mine, gone = b.open("mine", 0, 1, 16, (), 10.5, owner=BYSTANDER, source="10.0.0.1")
    # the session opened longest ago goes, though it is as warm as the others
    assert gone == [hogs[0]] and hogs[0].failure is not None
    assert hogs[0].failure.code is ErrorCode.CACHE_MISS
    assert "its address has held a slot here longest (10 s)" in hogs[0].failure.message
    assert b.holds(mine) and all(b.holds(h) for h in hogs[1:])


def test_four_sources_holding_fast_sessions_give_up_the_oldest_hold_too() -> None:
    # fast-path sessions run in the engine worker: their KV is reserved whole and they are never idle
    # here, so before they were never evicted, and four sources with one slow fast session each held
    # every slot for good
    b = books(tenure=10.0)
    hogs = [opened_at(b, f"h{i}", f"id{i}", f"10.0.0.{i + 2}", float(i)) for i in range(4)]
    for i, book in enumerate(hogs):
        assert b.reserve(book, 16, float(i)) == []
    for now in (5.0, 9.0, 10.5):
        for book in hogs:
            b.touch(book, now)
    with pytest.raises(ProtocolError) as refused:
        b.open("early", 0, 1, 16, (), 9.0, owner=BYSTANDER, source="10.0.0.1")
    assert refused.value.code is ErrorCode.OVERLOADED
    mine, gone = b.open("mine", 0, 1, 16, (), 10.5, owner=BYSTANDER, source="10.0.0.1")
    assert gone == [hogs[0]] and b.holds(mine) and all(b.holds(h) for h in hogs[1:])
    assert hogs[0].failure is not None and hogs[0].failure.code is ErrorCode.CACHE_MISS
    # the newcomer takes its slot, which the newcomer's opening clears whole (and the worker drops the
    # fast session on it with its KV)
    assert mine.slot == hogs[0].slot


def test_an_evicted_source_reopening_at_once_never_takes_the_newcomers_slot_and_the_next_newcomer_takes_the_next() -> None:
    b = books(tenure=10.0)
    hogs = four_warm_sources(b, 20.0)
    mine, gone = b.open("mine", 0, 1, 16, (), 20.0, owner=BYSTANDER, source="10.0.0.1")
    assert gone == [hogs[0]]
    # it has held a slot since 0 s: nobody here has held one longer, so it waits, however often it tries
    for now in (20.0, 20.1, 21.0):
        with pytest.raises(ProtocolError) as refused:
            b.open("again", 0, 1, 16, (), now, owner="id0", source="10.0.0.2")
        assert refused.value.code is ErrorCode.OVERLOADED
    # the next newcomer takes the next oldest hold, not the one just given
    other, gone = b.open("other", 0, 1, 16, (), 21.0, owner=OTHER, source="10.0.0.6")
    assert gone == [hogs[1]] and b.holds(mine) and b.holds(other)


def test_closing_and_reopening_does_not_make_a_source_new_again() -> None:
    b = books(tenure=10.0)
    hogs = four_warm_sources(b, 20.0)
    # the oldest holder closes and re-opens its session just before the claimant comes
    b.release(hogs[0])
    again = opened_at(b, "again", "id0", "10.0.0.2", 20.0)
    step(b, again, 20.0)
    _, gone = b.open("mine", 0, 1, 16, (), 20.1, owner=BYSTANDER, source="10.0.0.1")
    assert gone == [again] and again.since == 0.0
    # a source that let its slot go for longer than the tenure is new when it comes back
    b2 = books(tenure=10.0)
    first = opened_at(b2, "first", "id0", "10.0.0.2", 0.0)
    b2.release(first)
    assert opened_at(b2, "later", "id0", "10.0.0.2", 10.0).since == 10.0


def test_a_claimant_never_evicts_a_session_of_its_own_source_for_seniority() -> None:
    b = books(tenure=10.0)
    hogs = four_warm_sources(b, 20.0)
    with pytest.raises(ProtocolError) as refused:
        b.open("more", 0, 1, 16, (), 20.0, owner="id9", source="10.0.0.2")
    assert refused.value.code is ErrorCode.OVERLOADED and all(b.holds(h) for h in hogs)
