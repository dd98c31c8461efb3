"""Relay circuits in one process over loopback sockets: dialer <-> relay <-> target."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import trio

from meshd.net.link import LinkTimings
from meshd.net.peers import Peers, PeersConfig, open_peers
from meshd.net.stream import Stream
from meshd.relay.circuit import CircuitTransport, enable_circuits
from meshd.relay.reservations import RelayCandidate, ReservationKeeper
from meshd.relay.service import RelayService
from relay.limits import RelayLimits
from relay.protocol import HOP_PROTOCOL, Reserve, Reserved, circuit_address
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity

KEY = b"the mesh key"
CANARY = b"CANARY-7d1e-lighthouse-keeper"
ECHO = "test/echo"
# Keepalives slowed down so that they are not what carries a test.
CONFIG = PeersConfig(mesh_key=KEY, drain_timeout=0.1, timings=LinkTimings(keepalive_interval=300, dead_after=900))


async def echo_bytes(stream: Stream) -> None:
    while data := await stream.receive_some():
        await stream.send_all(data)


@dataclass
class Node:
    peers: Peers
    address: str
    scope: trio.CancelScope
    relay: RelayService | None = None
    held: list[str] = field(default_factory=list)
    keeper: ReservationKeeper | None = None

    def reserved_on(self, relay: str) -> bool:
        return self.keeper is not None and self.keeper.reserved_on(relay)

    @property
    def node_id(self) -> str:
        return self.peers.node_id


async def start_node(nursery: trio.Nursery, config: PeersConfig = CONFIG, limits: RelayLimits | None = None,
                     is_member: Callable[[str], bool] = lambda node: True, tap: list[bytes] | None = None) -> Node:
    async def run(task_status: trio.TaskStatus[Node]) -> None:
        with trio.CancelScope() as scope:
            async with open_peers(NodeIdentity.generate(), config) as peers:
                peers.handle(ECHO, echo_bytes)
                relay = None
                if limits is not None:
                    relay = RelayService(peers, limits, is_member, None if tap is None else tap.append)
                port = await peers.listen("127.0.0.1", 0)
                node = Node(peers, f"127.0.0.1:{port}", scope, relay)
                enable_circuits(peers, node.reserved_on)
                task_status.started(node)
                await trio.sleep_forever()

    node: Node = await nursery.start(run)
    return node


async def reserve(nursery: trio.Nursery, target: Node, relays: list[Node], want: int = 1) -> ReservationKeeper:
    """Starts keeping reservations for ``target`` on ``relays`` (a list the test may change)."""

    def on_change(addresses: list[str]) -> None:
        target.held[:] = addresses

    keeper = ReservationKeeper(target.peers, lambda: [RelayCandidate(r.node_id, r.address) for r in relays],
                               on_change, want=want)
    target.keeper = keeper
    nursery.start_soon(keeper.run)
    with trio.fail_after(10):
        while len(target.held) < min(want, len(relays)):
            await trio.sleep(0.02)
    return keeper


async def echo_through(peers: Peers, address: str, node_id: str, payload: bytes) -> bytes:
    stream = await peers.open_stream(address, ECHO, node_id=node_id)
    async with stream:
        await stream.send_all(payload)
        got = b""
        while len(got) < len(payload):
            got += await stream.receive_some()
        return got


async def test_a_circuit_runs_the_handshake_end_to_end_and_the_relay_sees_only_ciphertext() -> None:
    tap: list[bytes] = []
    async with trio.open_nursery() as nursery:
        relay = await start_node(nursery, limits=RelayLimits(), tap=tap)
        target = await start_node(nursery)
        dialer = await start_node(nursery)
        await reserve(nursery, target, [relay])
        assert target.held == [circuit_address(relay.address, target.node_id)]
        payload = CANARY * 200
        with trio.fail_after(10):
            assert await echo_through(dialer.peers, target.held[0], target.node_id, payload) == payload
        link = dialer.peers.link_to(target.node_id)
        assert link is not None and isinstance(link.transport, CircuitTransport)
        # The target authenticated the dialer the relay named, and the other way round.
        back = target.peers.link_to(dialer.node_id)
        assert back is not None and isinstance(back.transport, CircuitTransport)
        forwarded = b"".join(tap)
        assert relay.relay is not None and relay.relay.forwarded_bytes == len(forwarded) > len(payload)
        assert CANARY not in forwarded and CANARY[:12] not in forwarded
        nursery.cancel_scope.cancel()


async def test_a_circuit_over_its_byte_limit_ends_with_a_typed_error_and_another_carries_on() -> None:
    async with trio.open_nursery() as nursery:
        relay = await start_node(nursery, limits=RelayLimits(max_circuit_bytes=48 << 10))
        target = await start_node(nursery)
        greedy = await start_node(nursery)
        modest = await start_node(nursery)
        await reserve(nursery, target, [relay])
        address = target.held[0]
        with trio.fail_after(10):
            assert await echo_through(modest.peers, address, target.node_id, b"hello") == b"hello"
            assert await echo_through(greedy.peers, address, target.node_id, b"hello") == b"hello"
        greedy_link = greedy.peers.link_to(target.node_id)
        assert greedy_link is not None
        transport = greedy_link.transport
        assert isinstance(transport, CircuitTransport)
        with trio.fail_after(10), pytest.raises((ProtocolError, trio.BrokenResourceError)):
            await echo_through(greedy.peers, address, target.node_id, b"x" * (200 << 10))
        assert transport.error is not None and transport.error.code is ErrorCode.OVERLOADED
        assert "bytes" in transport.error.message
        with trio.fail_after(10):
            await greedy_link.wait_closed()
            for _ in range(5):
                assert await echo_through(modest.peers, address, target.node_id, CANARY) == CANARY
        modest_link = modest.peers.link_to(target.node_id)
        assert modest_link is not None and isinstance(modest_link.transport, CircuitTransport)
        nursery.cancel_scope.cancel()


async def test_without_the_mesh_key_a_node_cannot_reserve_and_a_non_member_is_refused() -> None:
    async with trio.open_nursery() as nursery:
        members: set[str] = set()
        relay = await start_node(nursery, limits=RelayLimits(), is_member=members.__contains__)
        stranger = await start_node(nursery, config=PeersConfig(mesh_key=b"another key", drain_timeout=0.1))
        with trio.fail_after(15), pytest.raises(ProtocolError) as refused:
            await stranger.peers.open_stream(relay.address, HOP_PROTOCOL)
        assert refused.value.code in (ErrorCode.UNAUTHORIZED, ErrorCode.UNREACHABLE)
        outsider = await start_node(nursery)
        stream = await outsider.peers.open_stream(relay.address, HOP_PROTOCOL)
        with trio.fail_after(10), pytest.raises(ProtocolError) as unauthorized:
            await stream.send_message(Reserve())
            await stream.receive_message()
        assert unauthorized.value.code is ErrorCode.UNAUTHORIZED
        assert relay.relay is not None and not relay.relay.state.reservations
        members.add(outsider.node_id)
        await reserve(nursery, outsider, [relay])
        assert list(relay.relay.state.reservations) == [outsider.node_id]
        nursery.cancel_scope.cancel()


async def test_a_node_moves_its_reservation_when_its_relay_is_lost() -> None:
    async with trio.open_nursery() as nursery:
        first = await start_node(nursery, limits=RelayLimits())
        second = await start_node(nursery, limits=RelayLimits())
        target = await start_node(nursery)
        dialer = await start_node(nursery)
        relays = sorted([first, second], key=lambda r: r.node_id)
        keeper = await reserve(nursery, target, relays, want=1)
        lost, spare = (first, second) if target.held[0].startswith(first.address) else (second, first)
        relays.remove(lost)
        keeper.candidates_changed()
        began = trio.current_time()
        lost.scope.cancel()
        with trio.fail_after(10):
            while target.held != [circuit_address(spare.address, target.node_id)]:
                await trio.sleep(0.02)
        print(f"reservation moved to the other relay in {trio.current_time() - began:.2f} s")
        with trio.fail_after(10):
            assert await echo_through(dialer.peers, target.held[0], target.node_id, CANARY) == CANARY
        nursery.cancel_scope.cancel()


async def test_a_reservation_is_renewed_before_it_runs_out_and_one_never_renewed_ends() -> None:
    async with trio.open_nursery() as nursery:
        relay = await start_node(nursery, limits=RelayLimits(reservation_seconds=2.0))
        assert relay.relay is not None
        state = relay.relay.state
        target = await start_node(nursery)
        dialer = await start_node(nursery)
        await reserve(nursery, target, [relay])
        seen = {state.reservations[target.node_id]}
        with trio.fail_after(10):
            while len(seen) < 3:  # two renewals (each 1 s after the last grant), within the 2 s lifetime
                await trio.sleep(0.02)
                assert target.node_id in state.reservations
                seen.add(state.reservations[target.node_id])
        assert target.held == [circuit_address(relay.address, target.node_id)]
        with trio.fail_after(10):
            assert await echo_through(dialer.peers, target.held[0], target.node_id, CANARY) == CANARY

        silent = await start_node(nursery)
        stream = await silent.peers.open_stream(relay.address, HOP_PROTOCOL)
        with trio.fail_after(10):
            await stream.send_message(Reserve())
            granted = await stream.receive_message()
            assert isinstance(granted, Reserved) and granted.lifetime_seconds == 2.0
            with pytest.raises(ProtocolError) as ran_out:
                await stream.receive_message()
        assert ran_out.value.code is ErrorCode.DEADLINE_EXCEEDED
        assert silent.node_id not in state.reservations
        nursery.cancel_scope.cancel()


async def test_a_sender_cancelled_while_its_record_crosses_the_relay_neither_repeats_nor_loses_it() -> None:
    # A circuit's record is handed to the relay's link before that link writes it; a sender
    # cancelled in that write (an asker cancelling, an RPC timing out while the relay stalls)
    # once had the circuit's link keep the record and send it again, and the far end then
    # failed the link with PAYLOAD_CORRUPT (a replayed nonce) instead of carrying on.
    async with trio.open_nursery() as nursery:
        relay = await start_node(nursery, limits=RelayLimits())
        target = await start_node(nursery)
        dialer = await start_node(nursery)
        await reserve(nursery, target, [relay])
        address = target.held[0]
        with trio.fail_after(10):
            assert await echo_through(dialer.peers, address, target.node_id, b"hello") == b"hello"
            stream = await dialer.peers.open_stream(address, ECHO, node_id=target.node_id)
            sent = b""
            for i in range(20):
                piece = b"piece %d;" % i
                with trio.CancelScope() as scope:
                    scope.cancel()
                    await stream.send_all(piece)
                sent += piece
            got = b""
            while len(got) < len(sent):
                got += await stream.receive_some()
        assert got == sent
        link = dialer.peers.link_to(target.node_id)
        back = target.peers.link_to(dialer.node_id)
        assert link is not None and not link.closed and isinstance(link.transport, CircuitTransport)
        assert back is not None and back.error is None
        nursery.cancel_scope.cancel()
