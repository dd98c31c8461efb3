"""DirectStream: writes from synchronous code keep the byte stream whole and in order."""

from __future__ import annotations

import socket

import trio
import trio.testing

from meshd.net.sockstream import DirectStream

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
