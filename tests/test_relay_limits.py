"""The relay's books without clocks: reservations, circuits per peer, bytes, time, idleness."""

from __future__ import annotations

import pytest

from relay.limits import RelayLimits, RelayState
from relay.protocol import circuit_address, is_circuit_address, parse_circuit_address
from wire.errors import ErrorCode, ProtocolError


def test_reservations_are_bounded_and_a_node_re_reserving_replaces_its_old_one() -> None:
    state = RelayState(RelayLimits(max_reservations=2, retry_after_ms=1500))
    first = state.reserve("a", 0.0)
    state.reserve("b", 0.0)
    with pytest.raises(ProtocolError) as refused:
        state.reserve("c", 0.0)
    assert refused.value.code is ErrorCode.OVERLOADED and refused.value.retry_after_ms == 1500
    newer = state.reserve("a", 0.0)  # a node already holding one may renew even when full
    state.release("a", first)  # the old reservation ending must not take the new one with it
    assert state.reservations["a"] == newer
    state.release("a", newer)
    state.reserve("c", 0.0)


def test_circuits_need_a_reservation_and_are_bounded_per_peer_at_either_end() -> None:
    state = RelayState(RelayLimits(max_circuits_per_peer=2))
    with pytest.raises(ProtocolError) as missing:
        state.open_circuit("d", "t", 0.0)
    assert missing.value.code is ErrorCode.NOT_FOUND
    state.reserve("t", 0.0)
    state.reserve("u", 0.0)
    one = state.open_circuit("d1", "t", 0.0)
    state.open_circuit("d2", "t", 0.0)
    with pytest.raises(ProtocolError) as target_full:
        state.open_circuit("d3", "t", 0.0)
    assert target_full.value.code is ErrorCode.OVERLOADED and target_full.value.retry_after_ms
    state.open_circuit("d1", "u", 0.0)
    with pytest.raises(ProtocolError) as source_full:
        state.open_circuit("d1", "u", 0.0)
    assert source_full.value.code is ErrorCode.OVERLOADED
    state.close_circuit(one.id)
    state.open_circuit("d3", "t", 0.0)


def test_byte_quota_is_checked_before_forwarding_and_per_circuit() -> None:
    state = RelayState(RelayLimits(max_circuit_bytes=100))
    state.reserve("t", 0.0)
    a = state.open_circuit("d1", "t", 0.0)
    b = state.open_circuit("d2", "t", 0.0)
    state.forwarded(a.id, 60, 1.0)
    state.forwarded(a.id, 40, 2.0)
    with pytest.raises(ProtocolError) as over:
        state.forwarded(a.id, 1, 3.0)
    assert over.value.code is ErrorCode.OVERLOADED and "100 bytes" in over.value.message
    assert state.circuits[a.id].bytes == 100
    state.forwarded(b.id, 100, 3.0)  # the other circuit has its own quota


def test_time_and_idle_limits_report_the_next_timer() -> None:
    state = RelayState(RelayLimits(max_circuit_seconds=60.0, idle_timeout=10.0))
    assert state.next_timer() is None
    reservation = state.reserve("t", 0.0)
    c = state.open_circuit("d", "t", 100.0)
    assert state.next_timer() == 110.0
    assert state.expired(c.id, 109.9) is None
    state.forwarded(c.id, 1, 109.0)
    assert state.deadline(c.id) == 119.0 and state.expired(c.id, 110.0) is None
    idle = state.expired(c.id, 119.0)
    assert idle is not None and idle.code is ErrorCode.DEADLINE_EXCEEDED and "idle" in idle.message
    for t in range(110, 160, 5):
        state.forwarded(c.id, 1, float(t))
    assert state.next_timer() == 160.0
    late = state.expired(c.id, 160.0)
    assert late is not None and "60 s" in late.message
    state.close_circuit(c.id)
    assert state.expired(c.id, 1e9) is None and state.next_timer() == state.reservation_deadline(reservation)
    state.release("t", reservation)
    assert state.next_timer() is None


def test_a_reservation_runs_out_unless_renewed_and_then_takes_no_circuits() -> None:
    state = RelayState(RelayLimits(reservation_seconds=30.0))
    first = state.reserve("t", 100.0)
    assert state.reservation_deadline(first) == 130.0 == state.next_timer()
    state.open_circuit("d", "t", 129.0)
    renewed = state.reserve("t", 120.0)  # a renewal replaces the reservation, with a new lifetime
    assert state.reservation_deadline(first) == float("-inf")  # the old one's holder knows it is over
    assert state.reservation_deadline(renewed) == 150.0
    state.open_circuit("d", "t", 149.0)
    assert not state.holds_reservation("t", 150.0)
    with pytest.raises(ProtocolError) as ran_out:
        state.open_circuit("d2", "t", 150.0)
    assert ran_out.value.code is ErrorCode.NOT_FOUND
    state.release("t", first)  # a stale release leaves the renewed reservation alone
    assert state.reservations == {"t": renewed}
    state.release("t", renewed)
    assert state.reservations == {} and state.expiry == {}


def test_circuit_addresses_round_trip() -> None:
    address = circuit_address("10.0.0.1:7400", "ab" * 16)
    assert is_circuit_address(address) and not is_circuit_address("10.0.0.1:7400")
    assert parse_circuit_address(address) == ("10.0.0.1:7400", "ab" * 16)
    for bad in ("10.0.0.1:7400", "/p2p-circuit/x", "h:1/p2p-circuit/", "h:1/p2p-circuit/a/p2p-circuit/b"):
        with pytest.raises(ValueError):
            parse_circuit_address(bad)
