"""Record transports: what carries a link's records, boundaries intact, in order.

A link needs only ``send_record``, ``receive_record`` and ``aclose``, so it can
run over a WebSocket (the normal case), any trio byte stream (a relay
circuit, a socket) or an in-memory pipe (tests, simulations).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Protocol

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from meshd.net import wsmask
from wire.noise import MAX_RECORD, RecordReader

wsmask.install()

# Records are at most 64 KiB, so one WebSocket message never needs more than
# that; the cap leaves room and bounds what a hostile peer can make us buffer.
WS_MAX_MESSAGE = 1 << 20
# trio-websocket reads 4 KiB at a time by default, which splits every
# activation into many reads; read up to what a socket delivers at once.
WS_RECEIVE_BUFFER = 64 << 10


class RecordTransport(Protocol):
    """Ordered, reliable delivery of records of at most 65536 bytes."""

    remote_address: str

    async def send_record(self, record: bytes) -> None:
        """Raises ``trio.BrokenResourceError`` once the transport is gone.

        If cancelled, the record must not have been partly written (nothing,
        or all of it), or the link breaks: trio's channels and socket streams
        behave so for writes that fit the socket's buffer.
        """

    async def receive_record(self) -> bytes:
        """Raises ``trio.EndOfChannel`` once the transport is closed."""

    async def aclose(self) -> None: ...


RecordTaker = Callable[[bytes], Coroutine[object, object, None] | None]


class WebSocketTransport:
    """One binary WebSocket message per record."""

    def __init__(self, ws: WebSocketConnection, remote_address: str) -> None:
        self._ws = ws
        self.remote_address = remote_address

    async def send_record(self, record: bytes) -> None:
        try:
            await self._ws.send_message(record if type(record) is bytes else bytes(record))
        except ConnectionClosed as exc:
            raise trio.BrokenResourceError(f"websocket closed: {exc.reason}") from None

    async def receive_record(self) -> bytes:
        try:
            message = await self._ws.get_message()
        except ConnectionClosed:
            raise trio.EndOfChannel from None
        if isinstance(message, str):
            # Not ours to decode; the channel will refuse it as a record.
            return b""
        return message

    async def aclose(self) -> None:
        await self._ws.aclose()

    def deliver_to(self, on_record: RecordTaker, on_close: Callable[[], None]) -> list[bytes] | None:
        """Have trio-websocket's own reader task hand records to ``on_record``.

        A link otherwise needs a reader task of its own between trio-websocket's
        queue and the streams: one more task switch per record, a tenth of a
        decode step's round trip. This swaps that queue's sending end for a
        sink that calls ``on_record`` directly. It relies on trio-websocket
        internals (``_send_channel``, ``_recv_channel``), so it checks them and
        returns None if they are not as expected; the caller then reads with
        ``receive_record`` as usual. Otherwise it returns the records already
        queued, to be processed first, in order.

        ``on_record`` processes a record at once and returns None, or, when
        the record ends the link, a coroutine to await before reading on.
        """
        ws = self._ws
        queue = getattr(ws, "_recv_channel", None)
        if not isinstance(getattr(ws, "_send_channel", None), trio.MemorySendChannel):
            return None
        if not isinstance(queue, trio.MemoryReceiveChannel):
            return None
        backlog = []
        while True:
            try:
                message = queue.receive_nowait()
            except trio.WouldBlock:
                break
            except (trio.EndOfChannel, trio.ClosedResourceError):
                on_close()
                break
            backlog.append(message if isinstance(message, bytes) else b"")
        ws._send_channel = _RecordSink(on_record, on_close)  # type: ignore[assignment]
        return backlog


class _RecordSink:
    """Stands in for trio-websocket's message queue; see ``deliver_to``."""

    def __init__(self, on_record: RecordTaker, on_close: Callable[[], None]) -> None:
        self._on_record = on_record
        self._on_close = on_close

    async def send(self, message: bytes | str) -> None:
        ending = self._on_record(message if isinstance(message, bytes) else b"")
        if ending is not None:
            await ending

    async def aclose(self) -> None:
        self._on_close()

    async def __aenter__(self) -> _RecordSink:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class StreamTransport:
    """Records framed by a 2-byte length on a trio byte stream."""

    def __init__(self, stream: trio.abc.Stream, remote_address: str) -> None:
        self._stream = stream
        self._reader = RecordReader()
        self._ready: list[bytes] = []
        self.remote_address = remote_address

    async def send_record(self, record: bytes) -> None:
        await self._stream.send_all(RecordReader.frame(record))

    async def receive_record(self) -> bytes:
        while not self._ready:
            data = await self._stream.receive_some(MAX_RECORD + 2)
            if not data:
                raise trio.EndOfChannel
            self._ready = self._reader.feed(data)
        return self._ready.pop(0)

    async def aclose(self) -> None:
        await self._stream.aclose()
