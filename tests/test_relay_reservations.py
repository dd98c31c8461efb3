"""The reservation policy without trio or clocks: whom to ask, when to renew, how long to back off."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from relay.reservations import RelayCandidate, Renew, ReservationPolicy, Reserve

R1, R2, R3 = (RelayCandidate(f"relay-{i}", f"10.0.0.{i}:7400") for i in (1, 2, 3))


def test_asks_the_first_candidates_up_to_want_and_each_once() -> None:
    policy = ReservationPolicy(want=2)
    assert policy.due(0.0) == [] and policy.next_timer() is None  # nobody to ask: no timer either
    policy.set_candidates([R1, R2, R3, R1])
    assert policy.due(0.0) == [Reserve(R1), Reserve(R2)]
    assert policy.due(0.0) == []  # handed out once, until reported on
    policy.reserved(R1.node_id, 1.0, lifetime=None)
    assert policy.held == [R1] and policy.next_timer() is None


def test_renews_halfway_through_the_lifetime_once_until_renewed() -> None:
    policy = ReservationPolicy(want=1)
    policy.set_candidates([R1])
    policy.due(0.0)
    policy.reserved(R1.node_id, 10.0, lifetime=60.0)
    assert policy.next_timer() == 40.0
    assert policy.due(39.9) == []
    assert policy.due(40.0) == [Renew(R1.node_id)]
    assert policy.due(41.0) == [] and policy.next_timer() is None  # waiting for the relay's answer
    policy.reserved(R1.node_id, 41.0, lifetime=60.0)
    assert policy.next_timer() == 71.0 and policy.held == [R1]


def test_a_relay_granting_a_tiny_lifetime_cannot_make_us_renew_in_a_loop() -> None:
    policy = ReservationPolicy(want=1, renew_min=1.0)
    policy.set_candidates([R1])
    policy.due(0.0)
    policy.reserved(R1.node_id, 5.0, lifetime=1e-9)
    assert policy.next_timer() == 6.0 and policy.due(5.5) == []


def test_failures_back_off_doubling_up_to_the_cap_or_as_the_relay_says() -> None:
    policy = ReservationPolicy(want=1, backoff=2.0, backoff_max=10.0)
    policy.set_candidates([R1])
    now = 0.0
    waits = []
    for _ in range(5):
        assert policy.due(now) == [Reserve(R1)]
        policy.failed(R1.node_id, now)
        deadline = policy.next_timer()
        assert deadline is not None
        assert policy.due(deadline - 0.01) == []
        waits.append(deadline - now)
        now = deadline
    assert waits == [2.0, 4.0, 8.0, 10.0, 10.0]
    policy.due(now)
    policy.failed(R1.node_id, now, retry_after=30.0)  # a relay's word counts, within the cap
    assert policy.next_timer() == now + 10.0
    policy.due(now + 10.0)
    policy.reserved(R1.node_id, now + 10.0, None)
    policy.lost(R1.node_id, now + 20.0)
    assert policy.next_timer() == now + 22.0  # success reset the back-off: a lost one waits the first


def test_a_lost_or_refused_relay_gives_way_to_the_next_candidate_at_once() -> None:
    policy = ReservationPolicy(want=1)
    policy.set_candidates([R1, R2])
    assert policy.due(0.0) == [Reserve(R1)]
    policy.reserved(R1.node_id, 0.0, None)
    policy.lost(R1.node_id, 5.0)
    assert policy.held == [] and policy.due(5.0) == [Reserve(R2)]
    policy.failed(R2.node_id, 6.0)
    assert policy.due(6.0) == []  # both back off; the earliest comes first
    assert policy.next_timer() == 7.0
    assert policy.due(7.0) == [Reserve(R1)]


def test_a_relay_that_left_the_candidates_stays_held_until_lost_and_is_not_asked_again() -> None:
    policy = ReservationPolicy(want=1)
    policy.set_candidates([R1])
    policy.due(0.0)
    policy.set_candidates([R2])  # R1 stopped being a candidate while we asked it
    policy.reserved(R1.node_id, 1.0, None)
    assert policy.held == [R1] and policy.due(1.0) == []
    policy.lost(R1.node_id, 2.0)
    assert policy.due(2.0) == [Reserve(R2)]
    with pytest.raises(KeyError):
        policy.reserved(R3.node_id, 3.0, None)  # never asked


def test_bad_settings_are_refused() -> None:
    for bad in ({"want": -1}, {"backoff": 0.0}, {"backoff": 5.0, "backoff_max": 1.0}, {"renew_after": 1.0}, {"renew_min": 0.0}):
        with pytest.raises(ValueError):
            ReservationPolicy(**bad)


RELAYS = [RelayCandidate(f"relay-{i}", f"10.0.1.{i}:7400") for i in range(5)]


class PolicyMachine(RuleBasedStateMachine):
    """Any order of events, the shell acting exactly as told: the policy never over-reserves,
    never hands out an action twice, and its timer is never in the past."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = ReservationPolicy(want=2, backoff=1.0, backoff_max=8.0)
        self.now = 0.0
        self.asked: set[str] = set()  # Reserve handed out, not yet reported
        self.renewing: set[str] = set()
        self.held: set[str] = set()

    def _run_due(self) -> None:
        for action in self.policy.due(self.now):
            if isinstance(action, Reserve):
                assert action.relay.node_id not in self.asked | self.held
                self.asked.add(action.relay.node_id)
            else:
                assert action.node_id in self.held and action.node_id not in self.renewing
                self.renewing.add(action.node_id)

    @rule(candidates=st.lists(st.sampled_from(RELAYS), max_size=5))
    def candidates(self, candidates: list[RelayCandidate]) -> None:
        self.policy.set_candidates(candidates)
        self._run_due()

    @rule(step=st.floats(min_value=0.0, max_value=20.0))
    def time_passes(self, step: float) -> None:
        deadline = self.policy.next_timer()
        self.now += step
        if deadline is not None and deadline <= self.now:
            self._run_due()

    @rule(data=st.data(), lifetime=st.one_of(st.none(), st.floats(min_value=0.1, max_value=100.0)))
    def a_relay_grants(self, data: st.DataObject, lifetime: float | None) -> None:
        pending = sorted(self.asked | self.renewing)
        if pending:
            node = data.draw(st.sampled_from(pending))
            self.asked.discard(node)
            self.renewing.discard(node)
            self.held.add(node)
            self.policy.reserved(node, self.now, lifetime)
            self._run_due()

    @rule(data=st.data(), retry=st.one_of(st.none(), st.floats(min_value=0.0, max_value=100.0)))
    def a_relay_refuses(self, data: st.DataObject, retry: float | None) -> None:
        if self.asked:
            node = data.draw(st.sampled_from(sorted(self.asked)))
            self.asked.discard(node)
            self.policy.failed(node, self.now, retry)
            self._run_due()

    @rule(data=st.data())
    def a_reservation_is_lost(self, data: st.DataObject) -> None:
        if self.held:
            node = data.draw(st.sampled_from(sorted(self.held)))
            self.held.discard(node)
            self.renewing.discard(node)
            self.policy.lost(node, self.now)
            self._run_due()

    @invariant()
    def never_more_than_want(self) -> None:
        assert len(self.held) + len(self.asked) <= self.policy.want
        assert {r.node_id for r in self.policy.held} == self.held

    @invariant()
    def the_timer_is_never_overdue(self) -> None:
        # The shell runs ``due`` at every timer and event, so nothing is left waiting in the past.
        deadline = self.policy.next_timer()
        assert deadline is None or deadline > self.now or self.policy.due(self.now) == []


TestPolicyMachine = PolicyMachine.TestCase
TestPolicyMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
