"""Record transports: what carries a link's records, boundaries intact, in order.

A link needs only ``send_record``, ``receive_record`` and ``aclose``, so it can
run over a WebSocket (the normal case), any trio byte stream (a relay
circuit, a socket) or an in-memory pipe (tests, simulations).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Protocol, TypeVar

import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, WebSocketConnection
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState

from meshd.net import wsmask
from meshd.net.sockstream import DirectStream
from wire.noise import MAX_RECORD, RecordReader

wsmask.install()

# One WebSocket message carries one record, at most 64 KiB; trio-websocket
# buffers a message whole before handing it on, so this bounds what a peer can
# make a connection hold.
WS_MAX_MESSAGE = MAX_RECORD + 1
# Until the Noise handshake ends only handshake records (under 600 bytes) are
# due: a stranger can make an unauthenticated connection hold no more than this.
WS_PREAUTH_MAX_MESSAGE = 4 << 10
# trio-websocket reads 4 KiB at a time by default, which splits every
# activation into many reads; read up to what a socket delivers at once.
WS_RECEIVE_BUFFER = 64 << 10
WS_MESSAGE_QUEUE = 4

T = TypeVar("T")


class UpgradeFailed(Exception):
    """The peer refused the WebSocket upgrade or hung up before it."""


class RecordTransport(Protocol):
    """Ordered, reliable delivery of records of at most 65536 bytes."""

    remote_address: str

    async def send_record(self, record: bytes) -> None:
        """Raises ``trio.BrokenResourceError`` once the transport is gone.

        It raises ``trio.Cancelled`` only if none of the record was written:
        the link then writes it again (``Link.flush``), so a record begun must
        be finished (before anything written after it) and reported sent, or it
        reaches the peer twice and the link fails (a spent nonce).
        ``DirectStream`` and ``CircuitTransport`` behave so.
        """

    async def receive_record(self) -> bytes:
        """Raises ``trio.EndOfChannel`` once the transport is closed."""

    async def aclose(self) -> None: ...


RecordTaker = Callable[[bytes], Coroutine[object, object, None] | None]


async def client_websocket(
    nursery: trio.Nursery, stream: trio.abc.Stream, host: str, resource: str
) -> WebSocketConnection:
    """Upgrade a connection we dialed; the reader task runs in ``nursery``.

    With the small pre-authentication message cap (see ``WebSocketTransport.
    authenticated``). Raises ``UpgradeFailed`` as soon as the peer refuses or
    hangs up; it does not time out by itself.
    """
    ws = WebSocketConnection(
        DirectStream.wrap(stream),
        WSConnection(ConnectionType.CLIENT),
        host=host,
        path=resource,
        message_queue_size=WS_MESSAGE_QUEUE,
        max_message_size=WS_PREAUTH_MAX_MESSAGE,
        receive_buffer_size=WS_RECEIVE_BUFFER,
    )
    await _until_open(nursery, ws, ws._open_handshake.wait)
    return ws


async def server_websocket(nursery: trio.Nursery, stream: trio.abc.Stream) -> WebSocketConnection:
    """Accept the upgrade of a connection a peer dialed; see ``client_websocket``."""
    ws = WebSocketConnection(
        DirectStream.wrap(stream),
        WSConnection(ConnectionType.SERVER),
        message_queue_size=WS_MESSAGE_QUEUE,
        max_message_size=WS_PREAUTH_MAX_MESSAGE,
        receive_buffer_size=WS_RECEIVE_BUFFER,
    )
    request = await _until_open(nursery, ws, ws._get_request)
    return await request.accept()


async def _until_open(
    nursery: trio.Nursery, ws: WebSocketConnection, opened: Callable[[], Awaitable[T]]
) -> T:
    """Run ``ws``'s reader task in ``nursery``; wait for ``opened`` or the reader's end.

    trio-websocket's own wrappers wait for the upgrade forever when the peer
    hangs up first, and let a refusal escape from the reader task into the
    nursery; here both end the wait with ``UpgradeFailed``.
    """
    ended = trio.Event()
    refusal: list[str] = []

    async def read() -> None:
        try:
            await ws._reader_task()
        except ConnectionRejected as exc:
            refusal.append(f"refused the WebSocket upgrade (HTTP {exc.status_code})")
        finally:
            ended.set()

    nursery.start_soon(read)
    result: list[T] = []
    async with trio.open_nursery() as race:

        async def wait_opened() -> None:
            result.append(await opened())
            race.cancel_scope.cancel()

        async def wait_ended() -> None:
            await ended.wait()
            race.cancel_scope.cancel()

        race.start_soon(wait_opened)
        race.start_soon(wait_ended)
    if not result:
        raise UpgradeFailed(refusal[0] if refusal else "closed the connection before the WebSocket upgrade")
    return result[0]


class WebSocketTransport:
    """One binary WebSocket message per record."""

    def __init__(
        self,
        ws: WebSocketConnection,
        remote_address: str,
        established: Callable[[], bool] | None = None,
    ) -> None:
        self._ws = ws
        self.remote_address = remote_address
        self._established = established
        stream = ws._stream
        self._direct = stream if isinstance(stream, DirectStream) else None

    def authenticated(self) -> None:
        """Lift the message cap from the pre-authentication size to a whole record's.

        Before the handshake ends, a stranger may make us hold only a few KiB.
        """
        self._established = None
        self._ws._max_message_size = WS_MAX_MESSAGE

    async def send_record(self, record: bytes) -> None:
        # The responder's last handshake record (CONFIRM) is the first it
        # sends once ``established`` holds; the peer sends whole records only
        # after that, so the cap goes up just before it.
        if self._established is not None and self._established():
            self.authenticated()
        try:
            await self._ws.send_message(record if type(record) is bytes else bytes(record))
        except ConnectionClosed as exc:
            raise trio.BrokenResourceError(f"websocket closed: {exc.reason}") from None

    def send_record_nowait(self, record: bytes) -> bool:
        """Writes ``record`` as one message now, from synchronous code, past trio-websocket
        (which would take a lock, a task switch and wsproto's framing); False, with nothing
        written, when it cannot: the caller then sends it with ``send_record``. What the
        socket does not take at once waits for ``drain``, before any later write."""
        direct = self._direct
        ws = self._ws
        if direct is None or self._established is not None or ws._wsproto.state is not ConnectionState.OPEN:
            return False
        return direct.send_nowait(wsmask.binary_frame(record, masked=not ws.is_server))

    def write_pending(self) -> bool:
        """Whether ``send_record_nowait`` left the end of a record for ``drain``."""
        return self._direct is not None and self._direct.pending

    async def drain(self) -> None:
        """Writes what ``send_record_nowait`` left for later, if anything."""
        if self._direct is not None and self._direct.pending:
            async with self._ws._stream_lock:
                await self._direct.drain()

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
