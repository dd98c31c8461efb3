"""DirectStream: writes from synchronous code keep the byte stream whole and in order."""

from __future__ import annotations

import socket

import trio
import trio.testing

from meshd.net.link import LinkTimings
from meshd.net.peers import PeersConfig, open_peers
from meshd.net.sockstream import DirectStream
from meshd.net.stream import Stream
from meshd.net.transport import WebSocketTransport
from wire.identity import NodeIdentity

BLOB = bytes(range(256)) * 4096  # 1 MiB: more than a socket pair's buffers hold


def direct_pair() -> tuple[DirectStream, trio.SocketStream]:
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
    mine = DirectStream.wrap(trio.SocketStream(trio.socket.from_stdlib_socket(a)))
    assert isinstance(mine, DirectStream)
    return mine, trio.SocketStream(trio.socket.from_stdlib_socket(b))


async def read_exactly(stream: trio.SocketStream, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        chunk = await stream.receive_some(n - len(got))
        assert chunk
        got += chunk
    return bytes(got)


async def test_what_send_nowait_leaves_goes_out_before_anything_written_after_it() -> None:
    mine, theirs = direct_pair()
    with trio.fail_after(10):
        assert mine.send_nowait(b"head")
        assert mine.send_nowait(BLOB)
        # the socket took part of it: the rest waits, and nothing may jump it
        assert mine.pending
        assert not mine.send_nowait(b"x")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mine.send_all, b"tail")
            assert await read_exactly(theirs, 4 + len(BLOB) + 4) == b"head" + BLOB + b"tail"
        assert not mine.pending
        assert mine.send_nowait(b"again")
        assert await read_exactly(theirs, 5) == b"again"
        await mine.aclose()
        assert not mine.send_nowait(b"closed")


async def cancelled_once_blocked(stream: DirectStream, data: bytes) -> None:
    """``stream.send_all(data)``, cancelled once it waits for the socket."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.send_all, data)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()


async def test_a_write_cancelled_midway_keeps_its_rest_and_one_not_begun_is_dropped() -> None:
    mine, theirs = direct_pair()
    with trio.fail_after(10):
        await cancelled_once_blocked(mine, BLOB)
        assert mine.pending
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mine.drain)
            assert await read_exactly(theirs, len(BLOB)) == BLOB
        assert not mine.pending
        # a write the socket takes nothing of, cancelled: nothing of it is left to go out later
        filler = 0
        while True:
            try:
                filler += mine._sock.send(b"f" * 65536)
            except BlockingIOError:
                break
        await cancelled_once_blocked(mine, b"never")
        assert not mine.pending
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mine.send_all, b"end")
            assert await read_exactly(theirs, filler + 3) == b"f" * filler + b"end"


async def test_a_link_whose_sender_is_cancelled_midway_through_a_record_sends_it_once() -> None:
    # A peer that stops reading (SIGSTOPped, say) fills the socket, and the kernel takes part of a
    # record. A sender cancelled then once had its link send the whole record again after the rest,
    # and the peer failed the link with PAYLOAD_CORRUPT (a replayed nonce) when it read again.
    config = PeersConfig(mesh_key=b"key", timings=LinkTimings(keepalive_interval=300, dead_after=900))
    record = b"r" * (12 << 10)  # under the link's unshielded size
    paused = False
    resumed = trio.Event()
    received = bytearray()

    async def sink(stream: Stream) -> None:
        while data := await stream.receive_some():
            received.extend(data)

    async def forward(src: trio.SocketStream, dst: trio.SocketStream, gated: bool) -> None:
        while data := await src.receive_some(4096):
            if gated and paused:
                await resumed.wait()
            await dst.send_all(data)

    async with trio.open_nursery() as nursery, open_peers(NodeIdentity.generate(), config) as alice, \
            open_peers(NodeIdentity.generate(), config) as bob:
        bob.handle("test/sink", sink)
        bob_port = await bob.listen("127.0.0.1", 0)
        # Alice links to Bob through this proxy, whose way to Bob stalls while ``paused``; its tiny
        # receive buffer closes Alice's window within a record or two
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        listener.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 10)

        async def proxy() -> None:
            near = await listener.accept()
            far = await trio.open_tcp_stream("127.0.0.1", bob_port)
            nursery.start_soon(forward, near, far, True)
            nursery.start_soon(forward, far, near, False)

        nursery.start_soon(proxy)
        with trio.fail_after(20):
            link = await alice.connect(f"127.0.0.1:{listener.socket.getsockname()[1]}", node_id=bob.node_id)
            assert isinstance(link.transport, WebSocketTransport)
            direct = link.transport._direct
            assert direct is not None
            stream = link.open_stream("test/sink")
            await stream.send_all(b"start")
            # the link idle, so that the sender below writes its records itself
            await trio.testing.wait_all_tasks_blocked()
            paused = True

            async def send() -> None:
                while True:
                    await stream.send_all(record)

            async with trio.open_nursery() as sending:
                sending.start_soon(send)
                await trio.testing.wait_all_tasks_blocked()
                sending.cancel_scope.cancel()
            assert direct.pending, "the socket took the whole record: nothing was cut short"
            resumed.set()
            await stream.send_all(b"end")
            back = bob.link_to(alice.node_id)
            assert back is not None
            while not received.endswith(b"end") and back.error is None:
                await trio.sleep(0.01)
        assert back.error is None and not link.closed
        body = received[len(b"start"):-len(b"end")]
        assert received.startswith(b"start") and len(body) % len(record) == 0 and body == b"r" * len(body)
        nursery.cancel_scope.cancel()
