"""Attacking members against relay circuits, in one process over loopback sockets.

The attacker is meshd's own peer code used as a relay the target never reserved
on: it opens STOP streams (circuit ends) to the target, first over a plain link,
then over a circuit link the honest relay carries (a circuit inside a circuit),
and asks the honest relay for a reservation through a circuit. Each is refused,
typed, and the honest circuit keeps carrying bytes.
"""

from __future__ import annotations

import pytest
import trio
from test_relay_circuit import CANARY, Node, echo_through, reserve, start_node

from meshd.net import rpc
from meshd.net.stream import Stream
from relay.limits import RelayLimits
from relay.protocol import HOP_PROTOCOL, STOP_PROTOCOL, Accepted, Incoming, Reserve, Reserved
from wire.errors import ErrorCode, ProtocolError

pytestmark = pytest.mark.slow


async def refused(stream: Stream, first: Incoming | Reserve, reply: type[Accepted] | type[Reserved]) -> ProtocolError:
    with trio.fail_after(10), pytest.raises(ProtocolError) as err:
        async with stream:
            await rpc.request(stream, first, reply, "an attacker's request")
    return err.value


async def honest_circuit_works(dialer: Node, target: Node) -> None:
    with trio.fail_after(10):
        assert await echo_through(dialer.peers, target.held[0], target.node_id, CANARY) == CANARY


async def test_a_node_takes_circuit_ends_only_from_a_relay_it_holds_a_reservation_on() -> None:
    async with trio.open_nursery() as nursery:
        relay = await start_node(nursery, limits=RelayLimits())
        rogue = await start_node(nursery, limits=RelayLimits())
        target, dialer = await start_node(nursery), await start_node(nursery)
        await reserve(nursery, target, [relay])
        await honest_circuit_works(dialer, target)
        stop = await rogue.peers.open_stream(target.address, STOP_PROTOCOL)
        err = await refused(stop, Incoming(source=rogue.node_id), Accepted)
        assert err.code is ErrorCode.UNAUTHORIZED, err
        await honest_circuit_works(dialer, target)
        nursery.cancel_scope.cancel()


async def test_no_circuit_runs_inside_a_circuit() -> None:
    async with trio.open_nursery() as nursery:
        relay = await start_node(nursery, limits=RelayLimits())
        target, attacker = await start_node(nursery), await start_node(nursery)
        # the target is itself a relay the attacker reaches only through the honest relay
        target_relay = await start_node(nursery, limits=RelayLimits())
        await reserve(nursery, target, [relay])
        await reserve(nursery, target_relay, [relay])
        await honest_circuit_works(attacker, target)
        # a circuit end brought over a circuit link, even by the node's own reserved relay's circuit
        inner = await attacker.peers.open_stream(None, STOP_PROTOCOL, node_id=target.node_id)
        err = await refused(inner, Incoming(source=attacker.node_id), Accepted)
        assert err.code is ErrorCode.BAD_REQUEST and "inside a circuit" in err.message
        # a reservation (or a dial) asked of a relay over a circuit link
        with trio.fail_after(10):
            await echo_through(attacker.peers, target_relay.held[0], target_relay.node_id, CANARY)
        hop = await attacker.peers.open_stream(None, HOP_PROTOCOL, node_id=target_relay.node_id)
        err = await refused(hop, Reserve(), Reserved)
        assert err.code is ErrorCode.BAD_REQUEST and "inside a circuit" in err.message
        assert target_relay.relay is not None and attacker.node_id not in target_relay.relay.state.reservations
        await honest_circuit_works(attacker, target)
        nursery.cancel_scope.cancel()
