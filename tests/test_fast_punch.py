"""Fast-path connections punched over a link (meshd.net.fastpunch), on loopback sockets: a stage known
only by a relay's circuit address gets its fast-path connection over the direct or punched link that
reaches it, and peers that flood or misuse the protocol get typed errors and nothing else.

(Loopback has no NAT: the answering end's SYN lands on the asking end's listener; the simultaneous
open through two MASQUERADE NATs runs in tests/test_punch_netns.py.)
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from meshd.net.fastconn import accepted
from meshd.net.fastpunch import RELAYED_HOP, FastPunchAnswer, connect_fast, fast_reaches
from meshd.net.link import Link, LinkTimings
from meshd.net.peers import Peers, PeersConfig, open_peers
from meshd.net.stream import Stream
from meshd.stage.fast import FastDoor
from relay.protocol import circuit_address
from relay.punch import FAST_PUNCH_PROTOCOL, FastPunch, FastPunchLimits, PunchLimits
from wire.errors import ErrorCode, ProtocolError
from wire.fastlink import TOKEN_BYTES
from wire.identity import NodeIdentity
from wire.message import ErrorMessage

CONFIG = PeersConfig(mesh_key=b"the mesh key", drain_timeout=0.2, dial_timeout=2.0,
                     timings=LinkTimings(keepalive_interval=300, dead_after=900))


@asynccontextmanager
async def linked() -> AsyncIterator[tuple[Peers, Peers, FastDoor, Link]]:
    """Two nodes, the second with a fast door, and the first's direct link to it."""
    async with open_peers(NodeIdentity.generate(), CONFIG) as a, open_peers(NodeIdentity.generate(), CONFIG) as b:
        door = FastDoor()
        b.handle_fast(door.accept)
        port = await b.listen("127.0.0.1", 0)
        link = await a.connect(f"127.0.0.1:{port}")
        yield a, b, door, link


def behind_a_relay(node: str) -> str:
    """The node's address as a stage behind a NAT has it: a relay's circuit (the relay is never dialed)."""
    return circuit_address("127.0.0.1:9", node)


async def test_a_stage_known_by_a_circuit_gets_its_fast_path_connection_over_the_direct_link() -> None:
    async with linked() as (_, b, door, link):
        token = secrets.token_bytes(TOKEN_BYTES)
        expected = door.expect(token)
        with trio.fail_after(10):
            conn = await connect_fast(behind_a_relay(b.node_id), link, token, 5.0)
            async with conn:
                await accepted(conn, "b", 5.0)
                await expected.arrived.wait()
                assert expected.sock is not None
                await conn.send_all(b"rows")
                got = await trio.to_thread.run_sync(expected.sock.recv, 4)
        assert got == b"rows"
        door.forget(token)


async def test_a_connection_with_a_token_nobody_expects_is_not_taken() -> None:
    async with linked() as (_, b, door, link):
        with trio.fail_after(20):
            conn = await connect_fast(behind_a_relay(b.node_id), link, secrets.token_bytes(TOKEN_BYTES), 5.0)
            async with conn:
                # the door waits for the token until the pre-auth deadline, then the connection is closed
                assert await conn.receive_some(16) == b""


async def test_over_a_relayed_link_no_fast_path_connection_is_punched() -> None:
    async with linked() as (_, b, _door, link):
        address = behind_a_relay(b.node_id)
        assert fast_reaches(address, link) and fast_reaches("127.0.0.1:7", None)
        assert not fast_reaches(address, None)
        link.path = "relayed"
        assert not fast_reaches(address, link)
        with pytest.raises(ProtocolError) as raised:
            await connect_fast(address, link, secrets.token_bytes(TOKEN_BYTES), 5.0)
        assert raised.value.code is ErrorCode.BAD_REQUEST and raised.value.message.startswith(RELAYED_HOP)
        assert "only a relay's circuit reaches" in raised.value.message
        # and the answering end refuses what comes over a relayed link (a peer that lies about the path)
        link.path = "direct"
        [theirs] = b.links
        theirs.path = "relayed"
        stream = link.open_stream(FAST_PUNCH_PROTOCOL)
        async with stream:
            await stream.send_message(FastPunch(port=9))
            with pytest.raises(ProtocolError) as raised:
                await stream.receive_message()
        assert raised.value.code is ErrorCode.BAD_REQUEST and "direct or punched link only" in raised.value.message
    assert RELAYED_HOP.startswith("the fast path takes direct or punched hops")


async def test_a_flood_of_fast_punches_gets_at_most_the_per_peer_rounds_at_once() -> None:
    limits = FastPunchLimits(per_peer=3, in_flight=8)
    async with linked() as (_, b, door, link):
        b.handle(FAST_PUNCH_PROTOCOL, FastPunchAnswer(door.accept, 2.0, PunchLimits(connect_timeout=2.0), limits))
        # a port that takes connections and says nothing: each answered round connects there and holds
        # its connection for the first bytes, until the pre-auth deadline
        silent = trio.socket.socket()
        await silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        replies: list[object] = []

        async def one() -> None:
            stream = link.open_stream(FAST_PUNCH_PROTOCOL)
            async with stream:
                await stream.send_message(FastPunch(port=port))
                try:
                    replies.append(await stream.receive_message())
                except ProtocolError as exc:
                    replies.append(exc)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for _ in range(10):
                    nursery.start_soon(one)
        answered = [r for r in replies if isinstance(r, FastPunch)]
        refused = [r for r in replies if isinstance(r, ProtocolError) and r.code is ErrorCode.OVERLOADED]
        assert len(answered) == 3 and len(refused) == 7, replies
        # the table of rounds in flight empties as they end
        with trio.fail_after(10):
            answer = b._handlers[FAST_PUNCH_PROTOCOL][0]
            assert isinstance(answer, FastPunchAnswer)
            while answer.running:
                await trio.sleep(0.05)
        silent.close()


async def test_an_answer_that_is_no_fast_punch_fails_the_rounds_with_the_asker_told_to_go_without() -> None:
    async with linked() as (_, b, _door, link):
        async def wrong(stream: object) -> None:
            assert isinstance(stream, Stream)
            await stream.receive_message()
            await stream.send_message(ErrorMessage(code=ErrorCode.BAD_REQUEST, message="no"))

        b.handle(FAST_PUNCH_PROTOCOL, wrong)
        address = behind_a_relay(b.node_id)
        assert fast_reaches(address, link)
        with trio.fail_after(20), pytest.raises(ProtocolError) as raised:
            await connect_fast(address, link, secrets.token_bytes(TOKEN_BYTES), 5.0)
        # and the link's next sessions are refused the fast path at their open, not tried again
        assert not fast_reaches(address, link)
        assert raised.value.code is ErrorCode.BAD_REQUEST and raised.value.message.startswith(RELAYED_HOP)
        assert "no fast punch answered" in raised.value.message



async def test_a_punch_given_up_on_after_a_failed_round_is_remembered_and_the_next_session_goes_without() -> None:
    """Rounds that each wait out their connect timeout (here the peer names a port and never dials: a NAT that
    drops every SYN) can outlast an asker's stall bound (the soak's is 8 s; three rounds took 9). The session,
    and its rounds, were then cancelled before they ran out, so nothing remembered the failure: each later
    session stalled the same way, its asker routing around healthy stages until no route was left."""
    async with linked() as (_, b, _door, link):
        address = behind_a_relay(b.node_id)
        limits = PunchLimits(connect_timeout=0.5)
        token = secrets.token_bytes(TOKEN_BYTES)
        closed = trio.socket.socket()
        await closed.bind(("127.0.0.1", 0))
        nobody = closed.getsockname()[1]
        closed.close()
        rounds: list[Stream] = []
        second = trio.Event()

        async def never_dials(stream: Stream) -> None:
            rounds.append(stream)
            if len(rounds) == 2:  # the first round failed: another began
                second.set()
            await stream.receive_message()
            await stream.send_message(FastPunch(port=nobody))

        b.handle(FAST_PUNCH_PROTOCOL, never_dials)
        # given up on before any round ended: no evidence, and the next session punches afresh
        with trio.move_on_after(0):
            await connect_fast(address, link, token, 30.0, limits)
        assert fast_reaches(address, link)
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                async def give_up() -> None:
                    await second.wait()
                    nursery.cancel_scope.cancel()  # the asker's stall bound: the session ends, its rounds too

                nursery.start_soon(give_up)
                await connect_fast(address, link, token, 30.0, limits)
        assert second.is_set()
        # the link's next sessions are refused the fast path at their open (RELAYED_HOP: the asker goes on on
        # the daemons' path), rather than each stalling in the same rounds
        assert not fast_reaches(address, link)


async def test_a_round_whose_syn_was_refused_and_whose_peer_came_from_elsewhere_ends_at_once() -> None:
    """Behind such a proxy a round cannot meet: our SYN is refused and the peer's lands on our listener from
    a host the link does not name. Each round ends there, not at its connect timeout, so the rounds end (and
    the asker is told to go without) within an asker's stall bound rather than past it."""
    async with linked() as (_, b, _door, link):
        address = behind_a_relay(b.node_id)
        link.address = link.address.replace("127.0.0.1", "127.0.0.2")
        # connect timeouts no hang guard below outlasts: the rounds end on what they saw, not on these
        with trio.fail_after(30), pytest.raises(ProtocolError) as raised:
            await connect_fast(address, link, secrets.token_bytes(TOKEN_BYTES), 600.0,
                               PunchLimits(connect_timeout=600.0))
        assert raised.value.code is ErrorCode.BAD_REQUEST and raised.value.message.startswith(RELAYED_HOP)
        message = raised.value.message
        assert "Connection refused" in message and "refused 127.0.0.1:" in message and "not the peer" in message
        assert "within" not in message, message
        assert not fast_reaches(address, link)
