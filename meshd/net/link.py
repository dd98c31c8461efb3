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

Its streams (``meshd.net.stream``) raise ``StreamBroken`` for whatever ends
their use and ``StreamClosed`` for a use after closing.

A record, once encrypted, must reach the wire exactly once, in order, or the
link is unusable (its nonce is spent). Large writes are therefore shielded
from the caller's cancellation, and closing the link cancels them instead. A
small record is written unshielded (a shield costs more than the write): a
cancellation can interrupt it only before its first byte, and then the record
stays queued for the writer task.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass

import trio

from meshd.net.stream import Stream, StreamBroken
from meshd.net.transport import RecordTransport
from wire.errors import ErrorCode, ProtocolError
from wire.limits import DEFAULT_LIMITS, Limits
from wire.link import SecureLink
from wire.mux_events import CreditAvailable, DataReceived, GoAwayReceived, PongReceived, StreamEnded, StreamOpened, StreamReset

log = logging.getLogger(__name__)

# Records up to this size are written without a cancellation shield.
_UNSHIELDED_RECORD = 16 << 10


@dataclass(frozen=True, slots=True)
class LinkTimings:
    handshake_timeout: float = 10.0
    keepalive_interval: float = 5.0
    dead_after: float = 20.0
    close_timeout: float = 2.0


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
        self.credit = trio.lowlevel.ParkingLot()
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
                await self.flush_quietly()
                while self.core.mux.stream_count and not self.closed:
                    await self._stream_gone.park()
            for stream_id in list(self._streams):
                self._streams[stream_id].reset(error)
            with trio.move_on_after(self.timings.close_timeout):
                await self.flush_quietly()
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
        self.credit.unpark_all()
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
        self.want_write()
        return stream

    def forget_if_done(self, stream_id: int) -> None:
        if not self.core.mux.is_open(stream_id):
            self._streams.pop(stream_id, None)
            self._stream_gone.unpark_all()

    def consumed(self, stream_id: int, size: int) -> None:
        mux = self.core.mux
        mux.consumed(stream_id, size)
        if mux.has_output:
            self.want_write()

    # ----- io

    def want_write(self) -> None:
        self._write_wanted.set()

    def write_nowait(self) -> None:
        """Encrypts what the core has queued and writes it now, if the link is idle; else the
        writer task writes it, after what is already queued.

        Records the transport cannot write at once go to the outbox, in order, for the writer
        task (and so does everything after them until it has written them).
        """
        if self._sending or self._outbox or self._send_nowait is None or self._error is not None:
            self.want_write()
            return
        send = self._send_nowait
        records = self.core.records_to_send()
        for i, record in enumerate(records):
            if not send(record):
                self._outbox.extend(records[i:])
                self.want_write()
                return
        if self._write_pending is not None and self._write_pending():
            # the socket kept the end of the last record back: the writer task finishes it
            self.want_write()

    async def flush(self) -> None:
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
                # A transport raises Cancelled only before any of it is
                # written (``RecordTransport.send_record``), so the record
                # stays queued for the writer task and the nonce sequence holds.
                try:
                    await send(outbox[0])
                except trio.Cancelled:
                    self.want_write()
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
        if self._write_pending is not None and self._write_pending():
            # a write cut short kept the end of a record back (DirectStream): the writer task finishes it
            self.want_write()
        if self._error is not None:
            raise self._error

    async def flush_quietly(self) -> None:
        try:
            await self.flush()
        except ProtocolError:
            # A dead link raises before any checkpoint; callers still expect one.
            await trio.lowlevel.checkpoint()

    async def _writer(self) -> None:
        drain = self._drain
        while True:
            await self._write_wanted.wait()
            self._write_wanted = trio.Event()
            await self.flush_quietly()
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
            self.want_write()

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
            await self.flush_quietly()
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
                self.credit.unpark_all()
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
                self.forget_if_done(event.stream_id)
            elif isinstance(event, GoAwayReceived):
                self.going_away = True
                self._goodbye = event.error
                if self._on_goaway is not None:
                    self._on_goaway(self)
            elif isinstance(event, PongReceived):
                self._rtt = trio.current_time() - event.sent_at
        for stream_id in ended:
            self.forget_if_done(stream_id)
        if self.core.mux.has_output:
            self.want_write()
        return None

    def _accept_stream(self, stream_id: int, protocol: str) -> None:
        stream = Stream(self, stream_id, protocol, self.limits)
        self._streams[stream_id] = stream
        if self._on_stream is None:
            stream.reset(ProtocolError(ErrorCode.NOT_FOUND, "this peer serves no streams"))
            return
        self._on_stream(stream)
