"""Hole punching over loopback sockets: two nodes linked through a relay's circuit go direct, and
peers that lie, stall or flood the punch protocol get nothing but a relayed link and typed errors.

(Loopback has no NAT: one end's SYN lands on the other's listener, a plain inbound link; the
simultaneous open through two MASQUERADE NATs runs in tests/test_punch_netns.py.)
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import trio
from test_relay_circuit import ECHO, echo_bytes, echo_through

from meshd.net import rpc
from meshd.net.link import LinkTimings
from meshd.net.peers import Peers, PeersConfig, open_peers
from meshd.net.stream import Stream
from meshd.relay.circuit import CircuitTransport, enable_circuits
from meshd.relay.punch import Puncher, dial_from
from meshd.relay.reservations import RelayCandidate, ReservationKeeper
from meshd.relay.service import RelayService
from relay.limits import RelayLimits
from relay.protocol import circuit_address
from relay.punch import PUNCH_PROTOCOL, PunchBudget, PunchConnect, PunchLimits, PunchSync, punch_target
from wire.decode import decode
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.message import encode

KEY = b"the mesh key"
CONFIG = PeersConfig(mesh_key=KEY, drain_timeout=0.2, dial_timeout=2.0,
                     timings=LinkTimings(keepalive_interval=300, dead_after=900))
QUICK = PunchLimits(step_timeout=1.0, connect_timeout=1.0)
# for a punch that is to succeed: a step that a loaded box held up for a second must not turn "punched" into
# "relayed" (a timeout that fires only on failure costs a success nothing; QUICK is for punches meant to fail)
ROOMY = PunchLimits(step_timeout=30.0, connect_timeout=30.0)


@dataclass
class Node:
    peers: Peers
    address: str
    relay: RelayService | None = None
    puncher: Puncher | None = None
    held: list[str] = field(default_factory=list)
    keeper: ReservationKeeper | None = None

    @property
    def node_id(self) -> str:
        return self.peers.node_id


async def start_node(nursery: trio.Nursery, *, relay: bool = False, punch: bool = True,
                     limits: PunchLimits = QUICK, members: Callable[[str], bool] = lambda node: True,
                     public: dict[str, str] | None = None) -> Node:
    async def run(task_status: trio.TaskStatus[Node]) -> None:
        async with open_peers(NodeIdentity.generate(), CONFIG) as peers:
            peers.handle(ECHO, echo_bytes)
            port = await peers.listen("127.0.0.1", 0)
            node = Node(peers, f"127.0.0.1:{port}", RelayService(peers, RelayLimits(), members) if relay else None)
            if punch:
                node.puncher = Puncher(peers, limits, {}.get if public is None else public.get)

            def reserved_on(relay_id: str) -> bool:
                return node.keeper is not None and node.keeper.reserved_on(relay_id)

            enable_circuits(peers, reserved_on, node.puncher.initiate if node.puncher is not None else None)
            task_status.started(node)
            await trio.sleep_forever()

    node: Node = await nursery.start(run)
    return node


async def reserve(nursery: trio.Nursery, target: Node, relay: Node) -> None:
    def on_change(addresses: list[str]) -> None:
        target.held[:] = addresses

    target.keeper = ReservationKeeper(target.peers, lambda: [RelayCandidate(relay.node_id, relay.address)],
                                      on_change, want=1)
    nursery.start_soon(target.keeper.run)
    with trio.fail_after(10):
        while not target.held:
            await trio.sleep(0.02)


# a bound on waiting (past ROOMY's steps), not a speed claim: the checks are on what happened
async def until(check: object, timeout: float = 60.0) -> None:
    with trio.fail_after(timeout):
        while not check():  # type: ignore[operator]
            await trio.sleep(0.02)


async def test_two_nodes_linked_through_a_relay_go_direct_and_the_relay_carries_nothing_more() -> None:
    async with trio.open_nursery() as nursery:
        relay = await start_node(nursery, relay=True, punch=False)
        target = await start_node(nursery, limits=ROOMY)
        dialer = await start_node(nursery, limits=ROOMY)
        await reserve(nursery, target, relay)
        assert target.held == [circuit_address(relay.address, target.node_id)]
        payload = b"x" * 200_000
        with trio.fail_after(10):
            assert await echo_through(dialer.peers, target.held[0], target.node_id, payload) == payload

        def direct() -> bool:
            link = dialer.peers.link_to(target.node_id)
            back = target.peers.link_to(dialer.node_id)
            done = target.puncher is not None and dialer.node_id in target.puncher.outcomes
            return done and link is not None and back is not None and "relayed" not in (link.path, back.path)

        await until(direct)
        assert target.puncher is not None and target.puncher.outcomes[dialer.node_id] == "punched"
        assert relay.relay is not None
        # the relayed link drains and closes once the direct one carries its streams: its last frames (208
        # bytes seen on a loaded CI run) are counted before the echo, not as the echo's
        await until(lambda: not relay.relay.state.circuits)  # type: ignore[union-attr]
        before = relay.relay.forwarded_bytes
        # The circuit's address still names the target; the link to that node is the direct one.
        with trio.fail_after(10):
            assert await echo_through(dialer.peers, target.held[0], target.node_id, payload) == payload
        assert relay.relay.forwarded_bytes == before and not relay.relay.state.circuits
        nursery.cancel_scope.cancel()


class NeverDials:
    """A fake punch responder: answers with the port of a socket that refuses, takes the sync, never dials."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.rounds = 0

    async def __call__(self, stream: Stream) -> None:
        self.rounds += 1
        await rpc.receive(stream, PunchConnect, "a punch", 2.0)
        await rpc.request(stream, PunchConnect(port=self.port), PunchSync, "a punch", 2.0)


async def test_a_peer_that_never_dials_leaves_the_link_relayed_after_bounded_tries(refusing_address: str) -> None:
    async with trio.open_nursery() as nursery:
        relay = await start_node(nursery, relay=True, punch=False)
        target = await start_node(nursery)
        dialer = await start_node(nursery, punch=False)
        liar = NeverDials(int(refusing_address.rsplit(":", 1)[1]))
        dialer.peers.handle(PUNCH_PROTOCOL, liar)
        await reserve(nursery, target, relay)
        with trio.fail_after(10):
            assert await echo_through(dialer.peers, target.held[0], target.node_id, b"hello") == b"hello"
        assert target.puncher is not None
        await until(lambda: dialer.node_id in target.puncher.outcomes)  # type: ignore[union-attr]
        outcome = target.puncher.outcomes[dialer.node_id]
        assert outcome != "punched" and "refused" in outcome.lower()
        assert liar.rounds == QUICK.tries
        link = dialer.peers.link_to(target.node_id)
        assert link is not None and link.path == "relayed"
        with trio.fail_after(10):
            assert await echo_through(dialer.peers, target.held[0], target.node_id, b"still") == b"still"
        nursery.cancel_scope.cancel()


class NeverDialsFirst:
    """A fake punch responder: fails the first attempt's rounds as ``NeverDials`` does, then lets the
    node's own puncher answer (a NAT slow to map, a load spike: a failure that passes)."""

    def __init__(self, never: NeverDials, puncher: Puncher) -> None:
        self.never = never
        self.puncher = puncher

    async def __call__(self, stream: Stream) -> None:
        if self.never.rounds < QUICK.tries:
            await self.never(stream)
        else:
            await self.puncher.respond(stream)


async def test_a_failed_punch_is_tried_again_later_while_the_relayed_link_lives(refusing_address: str) -> None:
    # the budget's window shorter than the wait, as PunchLimits' own are, so the retry has rounds
    retrying = PunchLimits(step_timeout=1.0, connect_timeout=1.0, window=0.2, retry_after=0.5)
    async with trio.open_nursery() as nursery:
        relay = await start_node(nursery, relay=True, punch=False)
        target = await start_node(nursery, limits=retrying)
        dialer = await start_node(nursery)
        assert dialer.puncher is not None
        liar = NeverDials(int(refusing_address.rsplit(":", 1)[1]))
        dialer.peers.handle(PUNCH_PROTOCOL, NeverDialsFirst(liar, dialer.puncher))
        await reserve(nursery, target, relay)
        with trio.fail_after(10):
            assert await echo_through(dialer.peers, target.held[0], target.node_id, b"hello") == b"hello"
        assert target.puncher is not None
        await until(lambda: dialer.node_id in target.puncher.outcomes)  # type: ignore[union-attr]
        assert target.puncher.outcomes[dialer.node_id] != "punched"
        await until(lambda: target.puncher.outcomes[dialer.node_id] == "punched")  # type: ignore[union-attr]
        assert liar.rounds == QUICK.tries
        link = dialer.peers.link_to(target.node_id)
        assert link is not None and link.path != "relayed"
        nursery.cancel_scope.cancel()


async def test_a_flood_of_punch_requests_gets_typed_refusals_and_the_node_serves_on() -> None:
    async with trio.open_nursery() as nursery:
        relay = await start_node(nursery, relay=True, punch=False)
        # the flooder holds the reservation (so the relay brings it circuits) but never punches itself
        flooder = await start_node(nursery, punch=False)
        victim = await start_node(nursery, limits=PunchLimits(step_timeout=5.0, per_peer=3))
        await reserve(nursery, flooder, relay)
        with trio.fail_after(10):
            assert await echo_through(victim.peers, flooder.held[0], flooder.node_id, b"hi") == b"hi"
        link = flooder.peers.link_to(victim.node_id)
        assert link is not None and link.path == "relayed"
        streams = [link.open_stream(PUNCH_PROTOCOL) for _ in range(12)]
        refusals: list[ProtocolError] = []
        waiting = []
        with trio.fail_after(10):
            # a refusal can come back before this side has sent on that stream: it breaks the send
            for stream in streams:
                try:
                    await stream.send_message(PunchConnect(port=1))
                except ProtocolError as exc:
                    refusals.append(exc)
                else:
                    waiting.append(stream)
            answered = 0
            for stream in waiting:
                try:
                    await stream.receive_message()
                except ProtocolError as exc:
                    refusals.append(exc)
                else:
                    answered += 1
        assert all(e.code is ErrorCode.OVERLOADED and "no more hole punches now" in e.message for e in refusals)
        refused = len(refusals)
        # the handlers run in whichever order: three rounds are taken, every other is refused
        assert (answered, refused) == (3, 9)
        assert victim.puncher is not None and victim.puncher.budget.running <= 3
        with trio.fail_after(10):
            assert await echo_through(victim.peers, flooder.held[0], flooder.node_id, b"on") == b"on"
        nursery.cancel_scope.cancel()


async def test_a_punch_runs_over_a_circuit_only() -> None:
    async with trio.open_nursery() as nursery:
        a = await start_node(nursery)
        b = await start_node(nursery)
        link = await a.peers.connect(b.address, node_id=b.node_id)
        stream = link.open_stream(PUNCH_PROTOCOL)
        with trio.fail_after(5), pytest.raises(ProtocolError) as caught:
            await rpc.request(stream, PunchConnect(port=1), PunchConnect, "a punch")
        assert caught.value.code is ErrorCode.BAD_REQUEST and "circuit only" in caught.value.message
        nursery.cancel_scope.cancel()


async def test_a_punched_connection_must_authenticate_the_expected_node() -> None:
    async with trio.open_nursery() as nursery:
        a = await start_node(nursery)
        impostor = await start_node(nursery)
        expected = NodeIdentity.generate().node_id
        host, port = impostor.address.rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        with trio.fail_after(5), pytest.raises(ProtocolError):
            await a.peers.adopt(stream, dialer=True, node_id=expected, path="punched")
        assert a.peers.link_to(impostor.node_id) is None
        nursery.cancel_scope.cancel()


def test_a_peer_names_a_port_never_a_host() -> None:
    assert decode(encode(PunchConnect(port=7100))) == PunchConnect(port=7100)
    with pytest.raises(ProtocolError) as caught:
        decode(encode({"type": "punch_connect", "port": 7100, "host": "10.9.9.9"}))
    assert caught.value.code is ErrorCode.BAD_REQUEST
    assert punch_target("203.0.113.7", 7100) == ("203.0.113.7", 7100)
    for host in ("", "0.0.0.0", "::", "224.0.0.1", "255.255.255.255", "relay.example", "circuit from x"):
        assert punch_target(host, 7100) is None


def test_the_budget_bounds_rounds_per_peer_and_in_flight() -> None:
    budget = PunchBudget(PunchLimits(per_peer=2, window=60.0, in_flight=3))
    assert budget.take("a", 0.0) is None and budget.take("a", 1.0) is None
    assert budget.take("a", 2.0) is not None
    budget.done()
    budget.done()
    assert budget.take("a", 61.0) is None
    assert budget.take("b", 61.0) is None and budget.take("c", 61.0) is None
    assert budget.take("d", 61.0) is not None  # three in flight


async def test_a_dialer_that_does_not_punch_costs_one_round_and_stays_relayed() -> None:
    async with trio.open_nursery() as nursery:
        relay = await start_node(nursery, relay=True, punch=False)
        target = await start_node(nursery)
        asker = await start_node(nursery, punch=False)  # as `meshd ask`: circuits, no punch handler
        await reserve(nursery, target, relay)
        with trio.fail_after(10):
            assert await echo_through(asker.peers, target.held[0], target.node_id, b"hello") == b"hello"
        assert target.puncher is not None
        await until(lambda: asker.node_id in target.puncher.outcomes)  # type: ignore[union-attr]
        assert "does not punch" in target.puncher.outcomes[asker.node_id]
        assert "NOT_FOUND" in target.puncher.outcomes[asker.node_id]
        assert target.puncher.budget.running == 0
        link = asker.peers.link_to(target.node_id)
        assert link is not None and link.path == "relayed"
        nursery.cancel_scope.cancel()


async def test_a_dialer_that_is_no_member_learns_no_public_host_and_no_punch_runs() -> None:
    strangers: set[str] = set()
    async with trio.open_nursery() as nursery:
        relay = await start_node(nursery, relay=True, punch=False, members=lambda node: node not in strangers)
        target = await start_node(nursery)
        asker = await start_node(nursery)
        strangers.add(asker.node_id)
        await reserve(nursery, target, relay)
        with trio.fail_after(10):
            assert await echo_through(asker.peers, target.held[0], target.node_id, b"hello") == b"hello"
        link, back = asker.peers.link_to(target.node_id), target.peers.link_to(asker.node_id)
        assert link is not None and back is not None
        assert isinstance(link.transport, CircuitTransport) and isinstance(back.transport, CircuitTransport)
        assert link.transport.observed == back.transport.observed == ""
        await trio.sleep(0.5)
        assert target.puncher is not None and asker.node_id not in target.puncher.outcomes
        assert target.puncher.budget.running == 0 and link.path == "relayed"
        nursery.cancel_scope.cancel()


async def test_a_peer_whose_record_says_public_is_dialed_back_there() -> None:
    public: dict[str, str] = {}
    async with trio.open_nursery() as nursery:
        relay = await start_node(nursery, relay=True, punch=False)
        target = await start_node(nursery, public=public, limits=ROOMY)
        dialer = await start_node(nursery, punch=False)  # needs no punch handler: it is just dialed
        public[dialer.node_id] = dialer.address
        await reserve(nursery, target, relay)
        with trio.fail_after(10):
            assert await echo_through(dialer.peers, target.held[0], target.node_id, b"hello") == b"hello"
        assert target.puncher is not None
        await until(lambda: dialer.node_id in target.puncher.outcomes)  # type: ignore[union-attr]
        assert target.puncher.outcomes[dialer.node_id] == "direct"
        link, back = dialer.peers.link_to(target.node_id), target.peers.link_to(dialer.node_id)
        assert link is not None and back is not None and link.path == back.path == "direct"
        assert not link.dialer and back.dialer
        assert relay.relay is not None
        before = relay.relay.forwarded_bytes
        with trio.fail_after(10):
            assert await echo_through(dialer.peers, target.held[0], target.node_id, b"again") == b"again"
        assert relay.relay.forwarded_bytes == before
        nursery.cancel_scope.cancel()


async def test_a_listening_port_stays_its_own_for_other_listeners_and_takes_the_punch_s_dial() -> None:
    async with open_peers(NodeIdentity.generate(), CONFIG) as a, open_peers(NodeIdentity.generate(), CONFIG) as b:
        port = await a.listen("127.0.0.1", 0)
        # SO_REUSEPORT is set once the listener is bound: a second daemon on the port still fails
        with pytest.raises(OSError) as caught:
            await b.listen("127.0.0.1", port)
        assert caught.value.errno == errno.EADDRINUSE
        other = await b.listen("127.0.0.1", 0)
        # while a punch's dialing socket shares it, and the connection leaves from that very port
        connection = await dial_from(("127.0.0.1", port), ("127.0.0.1", other), 2.0)
        assert connection.socket.getsockname()[1] == port
        await connection.aclose()
