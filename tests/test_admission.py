"""Admission bookkeeping: what strangers may hold before they authenticate (no trio)."""

from __future__ import annotations

import resource

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.net.admission import Admission, AdmissionConfig, Ticket, fd_budget, raise_fd_limit

CONFIG = AdmissionConfig(max_preauth=4, max_preauth_per_source=2, max_links=3)


def test_a_source_over_its_cap_displaces_its_own_oldest() -> None:
    admission = Admission(CONFIG, max_inbound=100)
    first, _ = admission.admit("10.0.0.1", 0.0)
    second, _ = admission.admit("10.0.0.1", 0.0)
    third, evicted = admission.admit("10.0.0.1", 0.0)
    assert third is not None and evicted == [first]
    assert first is not None and first.evicted and second is not None and not second.evicted
    assert admission.preauth == 2


def test_a_full_node_displaces_the_oldest_of_the_heaviest_source() -> None:
    admission = Admission(CONFIG, max_inbound=100)
    a1, _ = admission.admit("a", 0.0)
    b1, _ = admission.admit("b", 0.0)
    a2, _ = admission.admit("a", 0.0)
    c1, _ = admission.admit("c", 0.0)
    newcomer, evicted = admission.admit("d", 0.0)
    assert newcomer is not None and evicted == [a1]
    assert admission.preauth == 4


def test_authenticated_links_leave_the_pending_set_and_are_never_displaced() -> None:
    admission = Admission(CONFIG, max_inbound=3)
    honest, _ = admission.admit("h", 0.0)
    assert honest is not None and admission.authenticated(honest)
    for n in range(10):
        ticket, evicted = admission.admit(f"s{n}", 0.0)
        assert honest not in evicted
        assert admission.inbound <= 3
        del ticket
    assert admission.authenticated(honest) is False  # only once
    admission.release(honest, 0.0)
    admission.release(honest, 0.0)
    assert admission.inbound == 2


def test_links_at_their_cap_refuse_newcomers_and_late_handshakes() -> None:
    admission = Admission(CONFIG, max_inbound=10)
    tickets = [admission.admit(f"s{n}", 0.0)[0] for n in range(4)]
    assert all(t is not None for t in tickets)
    assert [admission.authenticated(t) for t in tickets if t is not None] == [True, True, True, False]
    assert admission.inbound == 3


def test_a_displaced_connection_cannot_authenticate() -> None:
    admission = Admission(CONFIG, max_inbound=100)
    first, _ = admission.admit("x", 0.0)
    admission.admit("x", 0.0)
    admission.admit("x", 0.0)
    assert first is not None and not admission.authenticated(first)


def test_the_fd_budget_keeps_a_reserve_for_everything_else() -> None:
    config = AdmissionConfig()
    assert fd_budget(1024, config) == 1024 - 128
    assert fd_budget(1 << 16, config) == config.max_links + config.max_preauth
    assert fd_budget(100, config) == 1


def test_raise_fd_limit_lifts_the_soft_limit_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        raised = raise_fd_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == raised
        assert raised == (hard if hard != resource.RLIM_INFINITY else 1 << 20) or raised == 1 << 20
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("bad", [{"max_preauth": 0}, {"preauth_timeout": 0}, {"fd_reserve": -1}])
def test_nonsense_admission_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AdmissionConfig(**bad)  # type: ignore[arg-type]


def test_a_source_whose_connections_keep_failing_is_refused_for_a_while() -> None:
    config = AdmissionConfig(source_rate=2.0, source_burst=4)
    admission = Admission(config, max_inbound=100)
    admitted = []
    for _ in range(10):
        ticket, _ = admission.admit("x", 0.0)
        admitted.append(ticket is not None)
        if ticket is not None:
            admission.release(ticket, 0.0)  # never authenticated
    assert admitted == [True] * 4 + [False] * 6
    assert admission.admit("y", 0.0)[0] is not None  # other sources are not affected
    assert admission.admit("x", 0.4)[0] is None
    ticket, _ = admission.admit("x", 0.5)  # one token back after half a second
    assert ticket is not None
    admission.release(ticket, 0.5)
    assert admission.admit("x", 0.5)[0] is None


def test_a_source_whose_connections_authenticate_is_never_throttled() -> None:
    admission = Admission(AdmissionConfig(source_rate=1.0, source_burst=2), max_inbound=100)
    for _ in range(50):
        ticket, _ = admission.admit("cli", 0.0)
        assert ticket is not None and admission.authenticated(ticket)
        admission.release(ticket, 0.0)


def test_the_rate_books_stay_bounded() -> None:
    admission = Admission(AdmissionConfig(), max_inbound=1 << 30)
    for n in range(20_000):
        ticket, _ = admission.admit(f"10.{n >> 16}.{(n >> 8) & 255}.{n & 255}", n / 1000)
        if ticket is not None:
            admission.release(ticket, n / 1000)
    assert len(admission._buckets) <= 4096


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "auth", "release"]), st.integers(0, 5)), max_size=60))
def test_caps_hold_under_any_sequence(ops: list[tuple[str, int]]) -> None:
    admission = Admission(CONFIG, max_inbound=5)
    live: list[Ticket] = []
    for op, n in ops:
        if op == "admit":
            ticket, evicted = admission.admit(f"s{n % 3}", 0.0)
            if ticket is not None:
                live.append(ticket)
            assert all(t.evicted and not t.authenticated for t in evicted)
        elif live:
            ticket = live[n % len(live)]
            if op == "auth":
                admission.authenticated(ticket)
            else:
                admission.release(ticket, 0.0)
                live.remove(ticket)
        assert admission.preauth <= CONFIG.max_preauth
        assert admission.inbound <= 5
        assert admission.preauth == sum(1 for t in live if not t.evicted and not t.authenticated)
        assert admission.inbound - admission.preauth == sum(1 for t in live if t.authenticated)
