"""The reservation keeper on a fake clock: it acts at the policy's timers, never on a poll."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from memory_transport import memory_transport_pair

from meshd.net.link import LinkTimings
from meshd.net.peers import Peers, PeersConfig, open_peers
from meshd.relay.reservations import RelayCandidate, ReservationKeeper
from meshd.relay.service import RelayService
from relay.limits import RelayLimits
from relay.protocol import circuit_address
from wire.identity import NodeIdentity

RELAY = NodeIdentity.from_private_bytes(b"r" * 32)
TARGET = NodeIdentity.from_private_bytes(b"t" * 32)
RELAY_ADDRESS = "memory:relay"
CONFIG = PeersConfig(drain_timeout=0.1, timings=LinkTimings(keepalive_interval=300, dead_after=900))


@asynccontextmanager
async def relay_and_target(
    limits: RelayLimits, is_member: Callable[[str], bool] = lambda node: True
) -> AsyncIterator[tuple[RelayService, Peers]]:
    """A relay and a node linked over an in-memory pipe (the keeper reuses the link by node id)."""
    a_end, b_end = memory_transport_pair()
    async with open_peers(RELAY, CONFIG) as relay_peers, open_peers(TARGET, CONFIG) as target:
        service = RelayService(relay_peers, limits, is_member)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(relay_peers.attach, b_end, dialer=False))
            await target.attach(a_end, dialer=True, node_id=RELAY.node_id)
        yield service, target


def recording_reserve(service: RelayService) -> list[float]:
    """The times at which the relay grants (or renews) a reservation."""
    times: list[float] = []
    reserve = service.state.reserve

    def record(node: str, now: float, host: str = "") -> int:
        times.append(now)
        return reserve(node, now, host)

    service.state.reserve = record  # type: ignore[method-assign]
    return times


async def test_the_keeper_renews_halfway_through_each_lifetime(autojump_clock: trio.abc.Clock) -> None:
    async with relay_and_target(RelayLimits(reservation_seconds=60.0)) as (service, target):
        granted = recording_reserve(service)
        published: list[list[str]] = []
        keeper = ReservationKeeper(target, lambda: [RelayCandidate(RELAY.node_id, RELAY_ADDRESS)],
                                   published.append, want=1)
        async with trio.open_nursery() as nursery:
            start = trio.current_time()
            nursery.start_soon(keeper.run)
            await trio.sleep(301.0)
            nursery.cancel_scope.cancel()
        assert [t - start for t in granted] == pytest.approx([30.0 * i for i in range(11)])
        assert published == [[circuit_address(RELAY_ADDRESS, TARGET.node_id)]]  # never dropped meanwhile
        assert list(service.state.reservations) == [TARGET.node_id]


async def test_a_refused_reserver_backs_off_doubling_up_to_the_cap(autojump_clock: trio.abc.Clock) -> None:
    asked: list[float] = []

    def refuse(node: str) -> bool:
        asked.append(trio.current_time())
        return False

    async with relay_and_target(RelayLimits(), refuse) as (_, target):
        keeper = ReservationKeeper(target, lambda: [RelayCandidate(RELAY.node_id, RELAY_ADDRESS)],
                                   lambda held: None, want=1)
        async with trio.open_nursery() as nursery:
            start = trio.current_time()
            nursery.start_soon(keeper.run)
            await trio.sleep(200.0)
            # News of the candidates wakes the keeper, but a relay backing off is not asked sooner.
            keeper.candidates_changed()
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        assert [t - start for t in asked] == pytest.approx([0.0, 2.0, 6.0, 14.0, 30.0, 62.0, 122.0, 182.0])
