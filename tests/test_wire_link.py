"""The sans-IO link's timers, without trio: keepalive pings and dead-peer detection."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from wire.errors import ErrorCode
from wire.identity import NodeIdentity
from wire.link import SecureLink
from wire.mux_events import PongReceived

ALICE = NodeIdentity.from_private_bytes(b"a" * 32)
BOB = NodeIdentity.from_private_bytes(b"b" * 32)

INTERVAL = 1.0
DEAD_AFTER = 3.0


def linked() -> tuple[SecureLink, SecureLink]:
    """Two cores with the handshake (and SETTINGS) exchanged by hand."""
    a, b = SecureLink(ALICE, dialer=True), SecureLink(BOB, dialer=False)
    for _ in range(8):
        moved = 0
        for src, dst in ((a, b), (b, a)):
            for record in src.records_to_send():
                dst.receive_record(record)
                moved += 1
        if not moved:
            break
    assert a.established and b.established
    return a, b


def deliver(src: SecureLink, dst: SecureLink) -> list[object]:
    events: list[object] = []
    for record in src.records_to_send():
        events.extend(dst.receive_record(record))
    return events


def test_no_timer_until_started_then_a_ping_each_interval_whose_pong_comes_back() -> None:
    a, b = linked()
    assert a.next_timer() is None and a.handle_timer(1e9) is None
    a.start_keepalive(100.0, interval=INTERVAL, dead_after=DEAD_AFTER)
    assert a.next_timer() == 101.0
    assert a.handle_timer(100.5) is None and a.records_to_send() == []  # not due: nothing happens
    assert a.handle_timer(101.0) is None
    assert a.next_timer() == 102.0
    deliver(a, b)  # the PING; b answers it
    assert [type(e) for e in deliver(b, a)] == [PongReceived]


def test_a_silent_peer_is_dead_after_dead_after_and_not_before() -> None:
    a, _ = linked()
    a.start_keepalive(0.0, interval=INTERVAL, dead_after=DEAD_AFTER)
    for now in (1.0, 2.0):
        assert a.handle_timer(now) is None and a.error is None
    error = a.handle_timer(3.0)
    assert error is not None and error.code is ErrorCode.UNREACHABLE and error.retryable
    assert a.error is error and a.next_timer() is None


def test_any_record_from_the_peer_counts_as_a_sign_of_life() -> None:
    a, b = linked()
    a.start_keepalive(0.0, interval=INTERVAL, dead_after=DEAD_AFTER)
    for now in (1.0, 2.0, 3.0, 4.0, 5.0):
        b.mux.send_ping(now)  # b keeps talking, a never hears a pong of its own
        deliver(b, a)
        assert a.handle_timer(now) is None
    assert a.error is None and a.next_timer() == 6.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=30.0), max_size=20))
def test_death_is_declared_between_dead_after_and_dead_after_plus_two_ticks_of_the_last_record(
    arrivals: list[float],
) -> None:
    """Driven exactly at ``next_timer``, with the peer's records arriving at ``arrivals``."""
    a, b = linked()
    a.start_keepalive(0.0, interval=INTERVAL, dead_after=DEAD_AFTER)
    pending = sorted(arrivals)
    last_heard = 0.0
    for _ in range(100):  # 30 s of arrivals, then at most a few ticks to die
        deadline = a.next_timer()
        assert deadline is not None
        while pending and pending[0] < deadline:
            last_heard = pending.pop(0)
            b.mux.send_ping(last_heard)
            deliver(b, a)
        error = a.handle_timer(deadline)
        if error is not None:
            assert DEAD_AFTER <= deadline - last_heard < DEAD_AFTER + 2 * INTERVAL
            assert not pending or pending[0] >= deadline
            return
        assert deadline - last_heard < DEAD_AFTER + 2 * INTERVAL
    raise AssertionError("never declared dead")
