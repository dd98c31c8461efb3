"""The relay's books against an attacker with free identities: reservations are bounded per address.

One attacker at one address makes fresh node ids (records planted by a Sync
make each look like a member) and reserves with every one; it fills only its
address's share, and members elsewhere still reserve.
"""

from __future__ import annotations

import pytest

from relay.limits import RelayLimits, RelayState
from wire.errors import ErrorCode, ProtocolError


def test_fresh_identities_from_one_address_fill_only_that_addresss_share() -> None:
    state = RelayState(RelayLimits(max_reservations=8, max_reservations_per_address=2))
    state.reserve("sybil-0", 0.0, "203.0.113.9")
    state.reserve("sybil-1", 0.0, "203.0.113.9")
    for i in range(2, 10):
        with pytest.raises(ProtocolError) as err:
            state.reserve(f"sybil-{i}", 0.0, "203.0.113.9")
        assert err.value.code is ErrorCode.OVERLOADED and "from one address" in err.value.message
    for i in range(6):
        state.reserve(f"member-{i}", 0.0, f"198.51.100.{i}")
    assert len(state.reservations) == 8


def test_a_renewal_does_not_count_against_its_own_address_and_a_release_frees_the_share() -> None:
    state = RelayState(RelayLimits(max_reservations_per_address=1))
    first = state.reserve("a", 0.0, "192.0.2.1")
    renewed = state.reserve("a", 1.0, "192.0.2.1")
    assert renewed != first and state.holds_reservation("a", 1.0)
    with pytest.raises(ProtocolError, match=r"^OVERLOADED: this relay holds its maximum of 1 reservations from one address$"):
        state.reserve("b", 1.0, "192.0.2.1")
    state.release("a", renewed)
    state.reserve("b", 2.0, "192.0.2.1")
    assert list(state.reservations) == ["b"]
