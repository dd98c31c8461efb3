"""A peer link in trio: a ``wire.link.SecureLink`` driven over a record transport.

Arriving records are processed by a reader task, or, when the transport can
push them (``WebSocketTransport.deliver_to``), by the transport's own task;
either way data lands in the streams' buffers without blocking, or, for a
stream with a message hook (``Stream.set_message_hook``), is decoded and handed
to the hook right there. Senders frame, encrypt and write in their own task,
or from synchronous code (``Stream.send_nowait``: written at once when the
transport can, ``Link.write_nowait``), so the hot path has no hand-off; a
writer task flushes what arrivals produce (window updates, pongs, resets) and
what could not be written at once; a timer task sleeps until the core's
``next_timer`` and runs its keepalive.

Whatever ends a stream's use, a reset (ours or the peer's) or the loss of its
link, a ``Stream`` raises as a ``StreamBroken``, and using a stream after
closing it here raises ``StreamClosed``: both are ``ProtocolError``s (so one
``except ProtocolError`` covers every failure of an exchange) and also the
trio errors a ``trio.abc.HalfCloseableStream`` is specified to raise.

A record, once encrypted, must reach the wire exactly once, in order, or the
link is unusable (its nonce is spent). Large writes are therefore shielded
from the caller's cancellation, and closing the link cancels them instead. A
small record is written unshielded (a shield costs more than the write): a
cancellation can interrupt it only before its first byte, and then the record
stays queued for the writer task.
"""

from __future__ import annotations

import logging
import operator
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass

import trio

from meshd.net.transport import RecordTransport
from wire.codec import DEFAULT_LIMITS, Limits, Message, MessageDecoder, encode, protocol_limits
from wire.errors import ErrorCode, ProtocolError
from wire.link import SecureLink
from wire.mux import (
    CreditAvailable,
    DataReceived,
    GoAwayReceived,
    PongReceived,
    StreamEnded,
    StreamOpened,
    StreamReset,
)

log = logging.getLogger(__name__)

# Records up to this size are written without a cancellation shield.
_UNSHIELDED_RECORD = 16 << 10


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


@dataclass(frozen=True, slots=True)
class LinkTimings:
    handshake_timeout: float = 10.0
    keepalive_interval: float = 5.0
    dead_after: float = 20.0
    close_timeout: float = 2.0


class Stream(trio.abc.HalfCloseableStream):
    """One bidirectional stream of a link: raw bytes, or length-prefixed messages.

    ``aclose`` ends our side (FIN); if the peer is still sending, the stream is
    reset with CANCELLED, because nobody will read the rest. A reset from the
    peer voids unread data unless the peer had already ended its side.
    """

    def __init__(self, link: Link, stream_id: int, protocol: str, limits: Limits) -> None:
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
            await link._flush()
            return
        view = memoryview(data)
        offset = 0
        try:
            while offset < size:
                capacity = mux.send_capacity(stream_id)
                if capacity == 0:
                    await link._credit.park()
                    self._check_sendable()
                    continue
                take = min(capacity, size - offset)
                mux.send_data(stream_id, view[offset : offset + take])
                offset += take
                # Write each window's worth before taking more: nothing beyond
                # the peer's credit ever waits here.
                await link._flush()
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
        if link._error is not None or not data or len(data) > mux.send_capacity(self.stream_id):
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
                await self.link._credit.park()
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
            self.link._forget_if_done(self.stream_id)
            await self.link._flush()
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
        self.link._consumed(self.stream_id, len(chunk))
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
            self.link._forget_if_done(self.stream_id)
            self.link._want_write()
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
            self.link._forget_if_done(self.stream_id)
        self._closed = True
        self._send_closed = True
        self._drop_unread()
        self._wake_reader()
        self.link._credit.unpark_all()
        await self.link._flush_quietly()

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
        self.link._consumed(self.stream_id, len(data))
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
        self.link._credit.unpark_all()

    def _drop_unread(self) -> None:
        dropped = sum(len(chunk) for chunk in self._chunks)
        self._chunks.clear()
        if dropped:
            self.link._consumed(self.stream_id, dropped)


class _HookFailed(Exception):
    """What a message hook raised, on its way to the reader."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


StreamCallback = Callable[[Stream], None]


class Link:
    """A live, authenticated link to one peer, carrying many streams."""

    def __init__(
        self,
        core: SecureLink,
        transport: RecordTransport,
        *,
        timings: LinkTimings = LinkTimings(),
        limits: Limits = DEFAULT_LIMITS,
        on_stream: StreamCallback | None = None,
        on_goaway: Callable[[Link], None] | None = None,
    ) -> None:
        self.core = core
        self.transport = transport
        self.timings = timings
        self.limits = limits
        self.address = transport.remote_address
        self._on_stream = on_stream
        self._on_goaway = on_goaway
        self._streams: dict[int, Stream] = {}
        self._outbox: deque[bytes] = deque()
        self._sending = False
        self._send_scope: trio.CancelScope | None = None
        self._credit = trio.lowlevel.ParkingLot()
        self._write_wanted = trio.Event()
        self._stream_gone = trio.lowlevel.ParkingLot()
        self._error: ProtocolError | None = None
        self._closed = trio.Event()
        self._run_scope: trio.CancelScope | None = None
        self._rtt: float | None = None
        self._goodbye: ProtocolError | None = None
        self.going_away = False
        # How the link's bytes go: "direct" (a TCP connection one end dialed), "punched" (a TCP
        # connection both ends opened at once through their NATs) or "relayed" (a relay's circuit).
        self.path = "direct"
        # a transport that can write a record from synchronous code (WebSocketTransport over TCP)
        self._send_nowait: Callable[[bytes], bool] | None = getattr(transport, "send_record_nowait", None)
        self._drain: Callable[[], Awaitable[None]] | None = getattr(transport, "drain", None)
        self._write_pending: Callable[[], bool] | None = getattr(transport, "write_pending", None)

    # ----- introspection

    @property
    def dialer(self) -> bool:
        return self.core.dialer

    @property
    def remote_node_id(self) -> str:
        node_id = self.core.remote_node_id
        assert node_id is not None, "the handshake has not finished"
        return node_id

    @property
    def rtt(self) -> float | None:
        """Round-trip time of the last keepalive ping, in seconds."""
        return self._rtt

    @property
    def closed(self) -> bool:
        return self._closed.is_set() or self._error is not None

    @property
    def error(self) -> ProtocolError | None:
        return self._error

    @property
    def usable(self) -> bool:
        return not self.closed and not self.going_away and self.core.mux.accepting_streams

    async def wait_closed(self) -> None:
        await self._closed.wait()

    # ----- lifecycle

    async def handshake(self) -> None:
        """Run the secure-channel handshake; raise ``ProtocolError`` if it fails."""
        try:
            with trio.fail_after(self.timings.handshake_timeout):
                await self._send_handshake_records()
                while not self.core.established:
                    try:
                        record = await self.transport.receive_record()
                    except (trio.EndOfChannel, trio.BrokenResourceError):
                        raise ProtocolError(
                            ErrorCode.UNREACHABLE,
                            f"{self.address} closed the connection during the handshake",
                        ) from None
                    try:
                        self.core.receive_record(record)
                    finally:
                        await self._send_handshake_records()
        except trio.TooSlowError:
            raise ProtocolError(
                ErrorCode.DEADLINE_EXCEEDED, f"handshake with {self.address} timed out"
            ) from None

    async def _send_handshake_records(self) -> None:
        try:
            for record in self.core.records_to_send():
                await self.transport.send_record(record)
        except trio.BrokenResourceError:
            if self.core.error is None:
                raise ProtocolError(
                    ErrorCode.UNREACHABLE, f"{self.address} closed the connection"
                ) from None

    async def run(self) -> None:
        """Serve the link until it closes; never raises but for cancellation."""
        try:
            if self._error is not None:
                return
            async with trio.open_nursery() as nursery:
                self._run_scope = nursery.cancel_scope
                deliver_to = getattr(self.transport, "deliver_to", None)
                backlog = None if deliver_to is None else deliver_to(self._take, self._hung_up)
                if backlog is None:
                    nursery.start_soon(self._reader)
                else:
                    for record in backlog:
                        await self._deliver(record)
                nursery.start_soon(self._writer)
                nursery.start_soon(self._timers)
        finally:
            error = self._error or ProtocolError(ErrorCode.UNREACHABLE, "link closed")
            self._terminate(error)
            with trio.move_on_after(self.timings.close_timeout) as scope:
                scope.shield = True
                try:
                    await self.transport.aclose()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            self._closed.set()

    async def aclose(self, error: ProtocolError | None = None, grace: float = 0.0) -> None:
        """Close gracefully: refuse new streams, let open ones finish for up to
        ``grace`` seconds, then reset the rest with ``error`` and hang up."""
        error = error or ProtocolError(ErrorCode.UNREACHABLE, "link closed")
        if not self.closed:
            self.going_away = True
            self.core.mux.goaway(error)
            with trio.move_on_after(grace):
                await self._flush_quietly()
                while self.core.mux.stream_count and not self.closed:
                    await self._stream_gone.park()
            for stream_id in list(self._streams):
                self._streams[stream_id].reset(error)
            with trio.move_on_after(self.timings.close_timeout):
                await self._flush_quietly()
            self._close(error)
        await self._closed.wait()

    def _close(self, error: ProtocolError) -> None:
        if self._error is None:
            self._error = StreamBroken.of(error)
        self._terminate(self._error)
        if self._run_scope is not None:
            self._run_scope.cancel()

    def _terminate(self, error: ProtocolError) -> None:
        if self._send_scope is not None:
            self._send_scope.cancel()
        for stream in list(self._streams.values()):
            stream._fail(error, keep_data=True)
        self._streams.clear()
        self._credit.unpark_all()
        self._stream_gone.unpark_all()

    # ----- streams

    def open_stream(self, protocol: str) -> Stream:
        """A new stream to the peer's handler for ``protocol``; usable at once."""
        if self._error is not None:
            raise self._error
        if self.going_away:
            raise StreamBroken(ErrorCode.UNREACHABLE, "link is closing")
        stream_id = self.core.mux.open_stream(protocol)
        stream = Stream(self, stream_id, protocol, self.limits)
        self._streams[stream_id] = stream
        self._want_write()
        return stream

    def _forget_if_done(self, stream_id: int) -> None:
        if not self.core.mux.is_open(stream_id):
            self._streams.pop(stream_id, None)
            self._stream_gone.unpark_all()

    def _consumed(self, stream_id: int, size: int) -> None:
        mux = self.core.mux
        mux.consumed(stream_id, size)
        if mux.has_output:
            self._want_write()

    # ----- io

    def _want_write(self) -> None:
        self._write_wanted.set()

    def write_nowait(self) -> None:
        """Encrypts what the core has queued and writes it now, if the link is idle; else the
        writer task writes it, after what is already queued.

        Records the transport cannot write at once go to the outbox, in order, for the writer
        task (and so does everything after them until it has written them).
        """
        if self._sending or self._outbox or self._send_nowait is None or self._error is not None:
            self._want_write()
            return
        send = self._send_nowait
        records = self.core.records_to_send()
        for i, record in enumerate(records):
            if not send(record):
                self._outbox.extend(records[i:])
                self._want_write()
                return
        if self._write_pending is not None and self._write_pending():
            # the socket kept the end of the last record back: the writer task finishes it
            self._want_write()

    async def _flush(self) -> None:
        """Encrypt what the core has queued and write it, in order.

        Whoever is already writing drains the outbox, including records queued
        meanwhile by others, so concurrent senders keep one order on the wire.
        """
        if self._error is not None:
            raise self._error
        outbox = self._outbox
        outbox.extend(self.core.records_to_send())
        if self._sending or not outbox:
            await trio.lowlevel.checkpoint()
            return
        self._sending = True
        send = self.transport.send_record
        try:
            if len(outbox) == 1 and len(outbox[0]) <= _UNSHIELDED_RECORD:
                # One small record: a shield would cost more than the write.
                # A cancellation that interrupts it strikes before any byte
                # is written (a small write to a writable socket does not
                # block), so the record stays queued for the writer task and
                # the nonce sequence holds.
                try:
                    await send(outbox[0])
                except trio.Cancelled:
                    self._want_write()
                    raise
                outbox.popleft()
            if outbox:
                # Several records, or more queued by others meanwhile.
                with trio.CancelScope(shield=True) as scope:
                    self._send_scope = scope
                    while outbox:
                        await send(outbox.popleft())
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._close(ProtocolError(ErrorCode.UNREACHABLE, f"connection to {self.address} lost"))
        finally:
            self._sending = False
            self._send_scope = None
        if self._error is not None:
            raise self._error

    async def _flush_quietly(self) -> None:
        try:
            await self._flush()
        except ProtocolError:
            # A dead link raises before any checkpoint; callers still expect one.
            await trio.lowlevel.checkpoint()

    async def _writer(self) -> None:
        drain = self._drain
        while True:
            await self._write_wanted.wait()
            self._write_wanted = trio.Event()
            await self._flush_quietly()
            if drain is not None and not self._sending:
                try:
                    await drain()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self._close(ProtocolError(ErrorCode.UNREACHABLE, f"connection to {self.address} lost"))

    async def _timers(self) -> None:
        """Sleep until the core's next timer, run it, send what it queued."""
        core = self.core
        timings = self.timings
        core.start_keepalive(
            trio.current_time(), interval=timings.keepalive_interval, dead_after=timings.dead_after
        )
        while (deadline := core.next_timer()) is not None:
            await trio.sleep_until(deadline)
            error = core.handle_timer(trio.current_time())
            if error is not None:
                self._close(ProtocolError(error.code, f"{self.address}: {error.message}"))
                return
            self._want_write()

    async def _reader(self) -> None:
        receive = self.transport.receive_record
        while self._error is None:
            try:
                record = await receive()
            except (trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError):
                self._hung_up()
                return
            await self._deliver(record)

    def _hung_up(self) -> None:
        if self._goodbye is not None:
            # The peer said why before hanging up (its GOAWAY): pass that on.
            self._close(
                ProtocolError(self._goodbye.code, f"peer closed the link: {self._goodbye.message}")
            )
        else:
            self._close(ProtocolError(ErrorCode.UNREACHABLE, f"{self.address} hung up"))

    async def _deliver(self, record: bytes) -> None:
        ending = self._take(record)
        if ending is not None:
            await ending

    def _take(self, record: bytes) -> Coroutine[object, object, None] | None:
        """Process one record, from our reader or the transport's (``deliver_to``).

        Synchronous, so the transport's task awaits nothing per record; only
        a record that ends the link returns the coroutine that says why and
        closes it.
        """
        if self._error is not None:
            return None
        try:
            error = self._on_record(record)
        except Exception:
            # The transport's task may be running this; never let a bug here
            # escape into it.
            log.exception("link %s: failed to process a record", self.address)
            error = ProtocolError(ErrorCode.INTERNAL, "failed to process a record")
        return None if error is None else self._end(error)

    async def _end(self, error: ProtocolError) -> None:
        log.warning("link %s failed: %s", self.address, error)
        # Tell the peer why (a GOAWAY, if the channel still works).
        with trio.move_on_after(self.timings.close_timeout):
            await self._flush_quietly()
        self._close(error)

    def _on_record(self, record: bytes) -> ProtocolError | None:
        """Process one arriving record; the error that must end the link, if any."""
        try:
            events = self.core.receive_record(record)
        except ProtocolError as exc:
            return exc
        streams = self._streams
        # forget ended streams only after a reset in the same record has reached them
        ended: list[int] = []
        for event in events:
            if isinstance(event, DataReceived):
                stream = streams.get(event.stream_id)
                if stream is not None:
                    stream._on_data(event.data)
                else:
                    self.core.mux.consumed(event.stream_id, len(event.data))
            elif isinstance(event, CreditAvailable):
                self._credit.unpark_all()
            elif isinstance(event, StreamEnded):
                stream = streams.get(event.stream_id)
                if stream is not None:
                    stream._on_eof()
                ended.append(event.stream_id)
            elif isinstance(event, StreamOpened):
                self._accept_stream(event.stream_id, event.protocol)
            elif isinstance(event, StreamReset):
                stream = streams.get(event.stream_id)
                if stream is not None:
                    stream._fail(event.error, keep_data=True)
                self._forget_if_done(event.stream_id)
            elif isinstance(event, GoAwayReceived):
                self.going_away = True
                self._goodbye = event.error
                if self._on_goaway is not None:
                    self._on_goaway(self)
            elif isinstance(event, PongReceived):
                self._rtt = trio.current_time() - event.sent_at
        for stream_id in ended:
            self._forget_if_done(stream_id)
        if self.core.mux.has_output:
            self._want_write()
        return None

    def _accept_stream(self, stream_id: int, protocol: str) -> None:
        stream = Stream(self, stream_id, protocol, self.limits)
        self._streams[stream_id] = stream
        if self._on_stream is None:
            stream.reset(ProtocolError(ErrorCode.NOT_FOUND, "this peer serves no streams"))
            return
        self._on_stream(stream)
