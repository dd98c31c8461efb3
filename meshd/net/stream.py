"""A stream of a peer link (``meshd.net.link``): raw bytes, or length-prefixed messages.

Whatever ends a stream's use, a reset (ours or the peer's) or the loss of its
link, a ``Stream`` raises as a ``StreamBroken``, and using a stream after
closing it here raises ``StreamClosed``: both are ``ProtocolError``s (so one
``except ProtocolError`` covers every failure of an exchange) and also the
trio errors a ``trio.abc.HalfCloseableStream`` is specified to raise.

A stream knows its link as a ``StreamLink``, what it needs of one: the link
module makes streams, so this one cannot import it.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import trio

from meshd.net.transport import RecordTransport
from wire.codec import MessageDecoder
from wire.errors import ErrorCode, ProtocolError
from wire.limits import Limits, protocol_limits
from wire.link import SecureLink
from wire.message import Message, encode


class StreamLink(Protocol):
    """What a stream uses of its link (``meshd.net.link.Link``), and what its users read of it."""

    core: SecureLink
    transport: RecordTransport
    address: str
    path: str
    # where senders wait for the peer's credit
    credit: trio.lowlevel.ParkingLot

    @property
    def remote_node_id(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    @property
    def error(self) -> ProtocolError | None: ...

    @property
    def usable(self) -> bool: ...

    def open_stream(self, protocol: str) -> Stream: ...

    async def flush(self) -> None: ...

    async def flush_quietly(self) -> None: ...

    def write_nowait(self) -> None: ...

    def want_write(self) -> None: ...

    def consumed(self, stream_id: int, size: int) -> None: ...

    def forget_if_done(self, stream_id: int) -> None: ...


class StreamBroken(ProtocolError, trio.BrokenResourceError):
    """The stream cannot carry on: reset by either side, or its link lost
    (UNREACHABLE, retryable). ``code`` and ``message`` say why."""

    @classmethod
    def of(cls, error: ProtocolError) -> StreamBroken:
        if isinstance(error, StreamBroken):
            return error
        broken = cls(error.code, error.message, error.retry_after_ms)
        broken.__cause__ = error.__cause__
        return broken


class StreamClosed(ProtocolError, trio.ClosedResourceError):
    """This side closed the stream (or its sending half) and then used it (CANCELLED)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.CANCELLED, message)


class Stream(trio.abc.HalfCloseableStream):
    """One bidirectional stream of a link: raw bytes, or length-prefixed messages.

    ``aclose`` ends our side (FIN); if the peer is still sending, the stream is
    reset with CANCELLED, because nobody will read the rest. A reset from the
    peer voids unread data unless the peer had already ended its side.
    """

    def __init__(self, link: StreamLink, stream_id: int, protocol: str, limits: Limits) -> None:
        self.link = link
        self.stream_id = stream_id
        self.protocol = protocol
        self._chunks: deque[bytes | memoryview] = deque()
        self._eof = False
        self._error: ProtocolError | None = None
        self._closed = False
        self._send_closed = False
        # The one task reading (reads are exclusive), parked until data comes:
        # a bare reschedule costs a fraction of a ParkingLot's on every message.
        self._parked: trio.lowlevel.Task | None = None
        # Each protocol's caps (SWIM, mesh RPC, relay small; the stage protocol large), within the link's.
        self._decoder = MessageDecoder(protocol_limits(protocol, limits))
        # Consumed bytes the decoder holds in an unfinished message, as the mux knows it.
        self._held = 0
        self.messages_received = 0
        self._sending = False
        self._receiving = False
        # ``set_message_hook``: the hook, whether the reader waits for a message (only then may the
        # hook take one), and what the hook left the reader (a message, or an exception to raise)
        self._hook: Callable[[Message], bool] | None = None
        self._waiting_message = False
        self._early: Message | ProtocolError | _HookFailed | None = None

    @property
    def remote_node_id(self) -> str:
        return self.link.remote_node_id

    # ----- sending

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this stream")
        self._sending = True
        try:
            if not data:
                self._check_sendable()
                await trio.lowlevel.checkpoint()
                return
            await self._send(data)
        finally:
            self._sending = False

    async def _send(self, data: bytes | bytearray | memoryview) -> None:
        link = self.link
        mux = link.core.mux
        stream_id = self.stream_id
        self._check_sendable()
        size = len(data)
        if size <= mux.send_capacity(stream_id):
            # The usual case: the whole message fits in the credit.
            mux.send_data(stream_id, data)
            await link.flush()
            return
        view = memoryview(data)
        offset = 0
        try:
            while offset < size:
                capacity = mux.send_capacity(stream_id)
                if capacity == 0:
                    await link.credit.park()
                    self._check_sendable()
                    continue
                take = min(capacity, size - offset)
                mux.send_data(stream_id, view[offset : offset + take])
                offset += take
                # Write each window's worth before taking more: nothing beyond
                # the peer's credit ever waits here.
                await link.flush()
        except BaseException:
            if 0 < offset < size and not self._closed:
                # Half a write would leave the peer's decoder out of step.
                self.reset(ProtocolError(ErrorCode.CANCELLED, "a write was interrupted midway"))
            raise

    def send_nowait(self, data: bytes | bytearray | memoryview) -> bool:
        """Sends ``data`` whole from synchronous code; False, with nothing sent, if it cannot.

        It cannot while another task sends on this stream, when the peer's
        credit does not cover all of it, or once the stream is closed or
        broken: the caller then sends with ``send_all``, which waits or
        raises. Sent here, it is encrypted and written at once when the link
        is idle (``Link.write_nowait``), else queued for the link's writer
        task, in order with everything else. A stage hands each decode
        step's output on this way, without a task switch.
        """
        if self._sending or self._closed or self._send_closed or self._error is not None:
            return False
        link = self.link
        mux = link.core.mux
        if link.error is not None or not data or len(data) > mux.send_capacity(self.stream_id):
            return False
        mux.send_data(self.stream_id, data)
        link.write_nowait()
        return True

    def _check_sendable(self) -> None:
        # Closing here is checked first: after ``aclose`` every use is ClosedResourceError.
        if self._closed or self._send_closed:
            raise StreamClosed("this stream's sending side is closed")
        if self._error is not None:
            raise self._error

    async def wait_send_all_might_not_block(self) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this stream")
        self._sending = True
        try:
            self._check_sendable()
            if self.link.core.mux.send_capacity(self.stream_id):
                await trio.lowlevel.checkpoint()
                return
            while not self.link.core.mux.send_capacity(self.stream_id):
                await self.link.credit.park()
                self._check_sendable()
        finally:
            self._sending = False

    async def send_eof(self) -> None:
        """End our side (FIN). Idempotent; on a broken stream there is nothing left to end."""
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this stream")
        if self._closed:
            raise StreamClosed("this stream is closed")
        if self._send_closed or self._error is not None:
            await trio.lowlevel.checkpoint()
            return
        self._sending = True
        try:
            self._send_closed = True
            self.link.core.mux.end_stream(self.stream_id)
            self.link.forget_if_done(self.stream_id)
            await self.link.flush()
        finally:
            self._sending = False

    async def send_message(self, message: Message) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this stream")
        self._sending = True
        try:
            await self._send(encode(message))
        finally:
            self._sending = False

    # ----- receiving

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if max_bytes is not None:
            max_bytes = operator.index(max_bytes)
            if max_bytes < 1:
                raise ValueError("max_bytes must be at least 1")
        if self._receiving:
            raise trio.BusyResourceError("another task is receiving on this stream")
        self._receiving = True
        try:
            if self._chunks:
                # Data is waiting, but a trio stream is a checkpoint all the same.
                await trio.lowlevel.checkpoint()
            chunk = await self._next_chunk(max_bytes)
            assert chunk is not None, "only a message reader has a hook"
            return bytes(chunk)
        finally:
            self._receiving = False

    async def _next_chunk(self, max_bytes: int | None = None) -> bytes | memoryview | None:
        """The next chunk; b"" at the end; None once the message hook leaves the reader something."""
        chunks = self._chunks
        # What the hook left came before any chunk queued since (they arrived after it woke the
        # reader, before the reader ran): the reader takes it first, so messages keep their order.
        while self._early is None and not chunks:
            if self._closed:
                raise StreamClosed("this stream is closed")
            if self._eof:
                await trio.lowlevel.checkpoint()
                return b""
            if self._error is not None:
                raise self._error
            self._parked = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort_wait)
        if self._early is not None:
            return None
        chunk = chunks.popleft()
        if max_bytes is not None and len(chunk) > max_bytes:
            chunks.appendleft(chunk[max_bytes:])
            chunk = chunk[:max_bytes]
        self.link.consumed(self.stream_id, len(chunk))
        return chunk

    async def receive_message(self) -> Message:
        """The next message; ``trio.EndOfChannel`` when the peer ended the stream cleanly.

        A malformed message resets the stream with the decoding error, which is
        raised here; other streams of the link are unaffected.
        """
        if self._receiving:
            raise trio.BusyResourceError("another task is receiving on this stream")
        self._receiving = True
        decoder = self._decoder
        try:
            message = decoder.next_message()
            while message is None:
                self._waiting_message = True
                try:
                    chunk = await self._next_chunk()
                finally:
                    self._waiting_message = False
                if chunk is None:
                    early, self._early = self._early, None
                    if isinstance(early, _HookFailed):
                        # the hook's own error (not this stream's): raised as it came, no reset
                        raise early
                    if isinstance(early, ProtocolError):
                        raise early
                    assert early is not None
                    return early
                if not chunk:
                    if decoder.buffered:
                        raise ProtocolError(ErrorCode.BAD_REQUEST, "stream ended inside a message")
                    raise trio.EndOfChannel
                message = decoder.decode_whole(chunk)
                if decoder.buffered or self._held:
                    self._held = decoder.buffered
                    self.link.core.mux.set_held(self.stream_id, self._held)
            self.messages_received += 1
            return message
        except _HookFailed as failed:
            raise failed.error from None
        except ProtocolError as exc:
            if exc is not self._error:
                self.reset(exc)
            raise
        finally:
            self._receiving = False

    def set_message_hook(self, hook: Callable[[Message], bool] | None) -> None:
        """Has ``hook`` see each message as it arrives, while ``receive_message`` waits for one.

        Called from the link's record processing (no task switch): True if it
        took the message; False leaves it to ``receive_message``, which
        returns it. An exception the hook raises comes out of
        ``receive_message`` as it is, without resetting the stream (it is
        the hook's, not the stream's). Messages arriving while the reader is
        busy wait for it as usual, so every message is seen in order.
        """
        self._hook = hook

    async def messages(self) -> AsyncIterator[Message]:
        """Each message until the peer ends the stream: ``async for m in stream.messages()``.

        (Iterating the stream itself yields raw byte chunks, as for any trio stream.)
        """
        while True:
            try:
                yield await self.receive_message()
            except trio.EndOfChannel:
                return

    # ----- closing

    def reset(self, error: ProtocolError) -> None:
        """Abort the stream both ways and tell the peer ``error``."""
        if self._error is None:
            self.link.core.mux.reset_stream(self.stream_id, error)
            self.link.forget_if_done(self.stream_id)
            self.link.want_write()
        self._fail(error, keep_data=False)

    async def aclose(self) -> None:
        """End the stream here; every later use raises ``StreamClosed``. Always
        takes effect, even when cancelled (then FIN or RESET go out with the
        link's next write)."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        mux = self.link.core.mux
        if self._error is None and mux.is_open(self.stream_id):
            if not self._send_closed:
                mux.end_stream(self.stream_id)
            if not self._eof:
                mux.reset_stream(
                    self.stream_id,
                    ProtocolError(ErrorCode.CANCELLED, "the reader closed the stream"),
                )
            self.link.forget_if_done(self.stream_id)
        self._closed = True
        self._send_closed = True
        self._drop_unread()
        self._wake_reader()
        self.link.credit.unpark_all()
        await self.link.flush_quietly()

    # ----- called by the link

    def _on_data(self, data: memoryview) -> None:
        if self._hook is not None and self._waiting_message and self._parked is not None and not self._chunks:
            self._hooked(data, self._hook)
            return
        self._chunks.append(data)
        self._wake_reader()

    def _hooked(self, data: memoryview, hook: Callable[[Message], bool]) -> None:
        """Decodes ``data`` as the parked reader would, and offers each whole message to ``hook``
        until it leaves one to the reader."""
        decoder = self._decoder
        self.link.consumed(self.stream_id, len(data))
        try:
            message = decoder.decode_whole(data)
            while message is not None:
                self.messages_received += 1
                try:
                    if not hook(message):
                        self._early = message
                        break
                except Exception as exc:
                    # never into the link's record processing: the reader raises it
                    self._early = _HookFailed(exc)
                    break
                message = decoder.next_message()
        except ProtocolError as exc:
            # the reader raises it, and resets the stream, as if it had decoded it
            self._early = exc
        if decoder.buffered or self._held:
            self._held = decoder.buffered
            self.link.core.mux.set_held(self.stream_id, self._held)
        if self._early is not None:
            self._wake_reader()

    def _abort_wait(self, raise_cancel: object) -> trio.lowlevel.Abort:
        self._parked = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _wake_reader(self) -> None:
        reader = self._parked
        if reader is not None:
            self._parked = None
            trio.lowlevel.reschedule(reader)

    def _on_eof(self) -> None:
        self._eof = True
        self._wake_reader()

    def _fail(self, error: ProtocolError, keep_data: bool) -> None:
        if self._error is None:
            self._error = StreamBroken.of(error)
        if not (keep_data and self._eof):
            self._eof = False
            self._drop_unread()
        self._wake_reader()
        self.link.credit.unpark_all()

    def _drop_unread(self) -> None:
        dropped = sum(len(chunk) for chunk in self._chunks)
        self._chunks.clear()
        if dropped:
            self.link.consumed(self.stream_id, dropped)


class _HookFailed(Exception):
    """What a message hook raised, on its way to the reader."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error
