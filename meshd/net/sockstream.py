"""A TCP stream for the links' WebSocket that costs no scheduling round per read or write, and can
be written to without awaiting.

trio's ``SocketStream`` yields to the scheduler after every send and receive
that succeeds at once (``_try_sync``), and tries a receive before waiting
for the socket: on a decode step, a round through the event loop and a
failed syscall per record, both ways, at every hop. Here a read waits for
the socket first (once through epoll, so a peer that floods still lets
other tasks run) and then reads; a write writes, and waits only for a full
socket buffer.

``send_nowait`` writes from synchronous code (the stage's scheduler, the
moment the engine returns a step's rows). What the kernel does not take is
kept, and goes out before anything written after it: by the next
``send_all``, or by ``drain``, which the link's writer task runs. A write cut
short by a cancellation keeps its unwritten rest the same way, so the byte
stream never loses the middle of a frame, and returns as done: a caller that
makes again a write that raised (a link does, ``meshd.net.link``) would
otherwise put the frame on the wire twice.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

import trio


class DirectStream(trio.abc.HalfCloseableStream):
    """Wraps a connected ``trio.SocketStream`` (which keeps its options and closes the socket)."""

    def __init__(self, stream: trio.SocketStream, sock: socket.socket) -> None:
        self.stream = stream
        self._sock = sock
        self._pending = b""
        self._busy = False

    @classmethod
    def wrap(cls, stream: trio.abc.Stream) -> trio.abc.Stream:
        """``stream`` as a DirectStream when it is a plain TCP socket stream; as it is otherwise."""
        sock = getattr(getattr(stream, "socket", None), "_sock", None)
        if type(stream) is trio.SocketStream and isinstance(sock, socket.socket):
            return cls(stream, sock)
        return stream

    @property
    def pending(self) -> bool:
        """Whether bytes taken by ``send_nowait`` still wait for the socket."""
        return bool(self._pending)

    def send_nowait(self, data: bytes) -> bool:
        """Writes ``data`` now, keeping what the kernel does not take for the next write or
        ``drain``; False, with nothing written, while another write is in progress or waits,
        or if the socket takes nothing (the caller then sends it the awaiting way)."""
        if self._busy or self._pending:
            return False
        try:
            sent = self._sock.send(data)
        except OSError:
            # full (BlockingIOError) or broken: the awaiting way waits, or says so
            return False
        if sent < len(data):
            self._pending = data[sent:]
        return True

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._busy:
            raise trio.BusyResourceError("another task is writing to this stream")
        self._busy = True
        try:
            while self._pending:
                # the rest of a frame already begun on the wire: kept until it is all written
                self._pending = self._pending[await self._write_some(self._pending):]
            view = memoryview(data)
            written = 0
            try:
                while written < len(view):
                    written += await self._write_some(view[written:])
            except trio.Cancelled:
                if not written:
                    # a write not begun is the caller's to make again
                    raise
                # begun: it is done (the cancellation comes at the caller's next checkpoint)
            finally:
                if 0 < written < len(view):
                    # cut short midway: the rest goes out first next time, so the frame stays whole
                    self._pending = bytes(view[written:])
        finally:
            self._busy = False

    async def drain(self) -> None:
        """Writes what ``send_nowait`` left, if anything (and if nobody else is writing: they will)."""
        if self._pending and not self._busy:
            await self.send_all(b"")

    async def _write_some(self, data: bytes | memoryview) -> int:
        sock = self._sock
        while True:
            try:
                return sock.send(data)
            except BlockingIOError:
                await self._wait(trio.lowlevel.wait_writable)
            except OSError as exc:
                raise trio.BrokenResourceError(f"socket write failed: {exc}") from exc

    async def wait_send_all_might_not_block(self) -> None:
        await self._wait(trio.lowlevel.wait_writable)

    async def _wait(self, wait: Callable[[socket.socket], Awaitable[None]]) -> None:
        # a closed socket has no fd to wait on (trio would keep the wait registered under -1)
        if self._sock.fileno() == -1:
            raise trio.ClosedResourceError("the socket is closed")
        await wait(self._sock)

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        sock = self._sock
        while True:
            # a read is a scheduling point: wait for the socket first (the usual case: nothing
            # is there yet), so that data arriving back to back cannot starve other tasks
            await self._wait(trio.lowlevel.wait_readable)
            try:
                return sock.recv(max_bytes or 65536)
            except BlockingIOError:
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(f"socket read failed: {exc}") from exc

    async def aclose(self) -> None:
        self._pending = b""
        await self.stream.aclose()
