"""QUIC-like stream multiplexing over one ordered, reliable link (sans-IO).

Frames are a 10-byte header (type u8, flags u8, stream id u32, length u32,
big-endian) and a payload. Streams are opened by either side without a round
trip: the dialer uses odd ids, the listener even ones, each increasing.

Flow control is credit based, per stream and per link, as in HTTP/2: each
side grants windows in its SETTINGS (its first frame) and tops them up with
WINDOW frames as the application consumes data. ``send_data`` refuses data
beyond the credit, so a sender never holds more unsent data than its peer
allowed; ``send_capacity`` says how much may go now.

A fault confined to one stream (overrunning its window, data after its end, a
bad open) resets that stream; a fault in framing or a control frame is a link
error: ``receive_data`` raises ``ProtocolError`` and the mux is dead, with a
GOAWAY carrying the reason left in ``data_to_send`` for the peer.

What a peer can make us queue or hold is bounded (the HTTP/2 CVE-2019-9512
and -9514 class, and unfinished messages):

* Between two timer ticks (``handle_timer(now)``, or ``send_ping(now)``, once
  per keepalive interval) at most ``max_pongs`` PINGs are answered; the rest
  go unanswered, and ``ping_flood`` of them end the link. Refused OPENs,
  RESETs received and RESETs we send on the peer's streams count towards
  ``reset_flood``, which ends the link too: a peer that never reads cannot
  make our outbound queue grow.
* Bytes the application consumed but still holds in an unfinished message
  (``set_held``) are not granted again as link credit beyond ``max_held`` per
  link and, with a shared ``HeldBudget``, the node's ``limit``: what a peer
  can make us keep is at most the link window plus that budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from wire.errors import ErrorCode, ProtocolError, bad_request
from wire.mux_config import HeldBudget, MuxConfig
from wire.mux_events import (
    CreditAvailable,
    DataReceived,
    Event,
    GoAwayReceived,
    PongReceived,
    StreamEnded,
    StreamOpened,
    StreamReset,
)
from wire.mux_frames import (
    CONTROL_LIMITS,
    DATA,
    FIN,
    GOAWAY,
    HEADER,
    HEADER_BYTES,
    MAX_PROTOCOL_BYTES,
    MAX_STREAM_ID,
    MAX_WINDOW,
    OPEN,
    PING,
    PING_BODY,
    PONG,
    RESET,
    SETTINGS,
    U32,
    WINDOW,
    pack_error,
    unpack_error,
)
from wire.mux_settings import PeerSettings, read_settings, settings_payload

_MAX_OUTSTANDING_PINGS = 16


@dataclass(slots=True)
class _Stream:
    send_window: int
    recv_window: int
    local_open: bool = True
    remote_open: bool = True
    unconsumed: int = 0
    pending_update: int = 0
    held: int = 0



class Mux:
    """One side of a multiplexed link. Feed it bytes, send what it queues."""

    def __init__(
        self,
        *,
        dialer: bool,
        config: MuxConfig | None = None,
        node_budget: HeldBudget | None = None,
    ) -> None:
        self.config = config or MuxConfig()
        # Shared by the node's links; may be set after construction, before data flows.
        self.node_budget = node_budget
        self._held = 0
        self._pongs = 0
        self._pings_seen = 0
        self._resets = 0
        self._dialer = dialer
        self._next_local_id = 1 if dialer else 2
        self._last_peer_id = 0
        self._streams: dict[int, _Stream] = {}
        self._local_count = 0
        self._peer_count = 0
        self._peer: PeerSettings | None = None
        self._link_send_window = 0
        self._link_recv_window = self.config.link_window
        self._link_unconsumed = 0
        self._link_pending_update = 0
        # Credit goes back in batches of half a window: fewer WINDOW frames,
        # and the sender never runs dry while one is in flight.
        self._link_update_threshold = max(1, self.config.link_window // 2)
        self._stream_update_threshold = max(1, self.config.stream_window // 2)
        self._out: list[bytes | bytearray | memoryview] = []
        self._inbuf = b""
        self._pings: dict[bytes, float] = {}
        self._ping_counter = 0
        self._goaway_sent = False
        self._goaway_received: ProtocolError | None = None
        self._error: ProtocolError | None = None
        self._queue_settings()

    # ----- introspection

    @property
    def error(self) -> ProtocolError | None:
        """The link error that killed this mux, if any."""
        return self._error

    @property
    def ready(self) -> bool:
        """Whether the peer's SETTINGS arrived, so data can flow."""
        return self._peer is not None

    @property
    def accepting_streams(self) -> bool:
        return self._error is None and self._goaway_received is None and not self._goaway_sent

    @property
    def stream_count(self) -> int:
        return len(self._streams)

    @property
    def has_output(self) -> bool:
        """Whether ``data_to_send`` would return anything."""
        return bool(self._out)

    def is_open(self, stream_id: int) -> bool:
        return stream_id in self._streams

    @property
    def held(self) -> int:
        """Bytes of this link the application holds in unfinished messages."""
        return self._held

    def send_capacity(self, stream_id: int) -> int:
        """Bytes ``send_data`` will take for this stream right now."""
        stream = self._streams.get(stream_id)
        if stream is None or not stream.local_open or self._peer is None or self._error:
            return 0
        return max(0, min(stream.send_window, self._link_send_window))

    # ----- sending

    def open_stream(self, protocol: str) -> int:
        self._check_alive()
        if self._goaway_received is not None:
            raise ProtocolError(
                self._goaway_received.code,
                f"peer is going away: {self._goaway_received.message}",
            )
        if self._goaway_sent:
            raise ProtocolError(ErrorCode.INTERNAL, "this side is going away")
        if self._peer is not None and self._local_count >= self._peer.max_streams:
            raise ProtocolError(
                ErrorCode.OVERLOADED, f"peer allows {self._peer.max_streams} concurrent streams"
            )
        name = protocol.encode()
        if not 1 <= len(name) <= MAX_PROTOCOL_BYTES:
            raise ValueError(f"a protocol name is 1 to {MAX_PROTOCOL_BYTES} bytes")
        stream_id = self._next_local_id
        if stream_id > MAX_STREAM_ID:
            raise ProtocolError(ErrorCode.OVERLOADED, "stream ids exhausted; open a new link")
        self._next_local_id += 2
        window = self._peer.stream_window if self._peer else 0
        self._streams[stream_id] = _Stream(
            send_window=window, recv_window=self.config.stream_window
        )
        self._local_count += 1
        self._frame(OPEN, 0, stream_id, name)
        return stream_id

    def send_data(
        self, stream_id: int, data: bytes | bytearray | memoryview, end: bool = False
    ) -> None:
        """Queue ``data`` (at most ``send_capacity``) and, if ``end``, half-close.

        The mux keeps a reference to ``data`` until ``data_to_send``: do not
        change it before then.
        """
        self._check_alive()
        stream = self._streams.get(stream_id)
        if stream is None or not stream.local_open:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"stream {stream_id} is not open for sending"
            )
        size = len(data)
        if size:
            if size > stream.send_window or size > self._link_send_window or self._peer is None:
                raise ValueError(
                    f"{size} bytes exceed the send credit of {self.send_capacity(stream_id)}"
                )
            stream.send_window -= size
            self._link_send_window -= size
            step = self._peer.max_frame
            if size <= step:
                self._frame(DATA, FIN if end else 0, stream_id, data)
            else:
                view = memoryview(data)
                for start in range(0, size, step):
                    last = start + step >= size
                    self._frame(
                        DATA, FIN if end and last else 0, stream_id, view[start : start + step]
                    )
        elif end:
            self._frame(DATA, FIN, stream_id, b"")
        if end:
            stream.local_open = False
            self._maybe_forget(stream_id, stream)

    def end_stream(self, stream_id: int) -> None:
        self.send_data(stream_id, b"", end=True)

    def reset_stream(self, stream_id: int, error: ProtocolError) -> None:
        """Abort both directions of a stream and tell the peer why."""
        if self._error is not None:
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        self._frame(RESET, 0, stream_id, pack_error(error))
        self._forget(stream_id)
        if not self._is_local(stream_id):
            # Not raised here (the application is resetting): the peer's next
            # OPEN or RESET ends the link if it made us reset too many.
            self._resets += 1

    def set_held(self, stream_id: int, held: int) -> None:
        """The application holds ``held`` consumed bytes of this stream in an
        unfinished message (0 once it is whole). Credit for held bytes beyond
        the budget waits until they are let go; a stream that is gone holds
        nothing."""
        stream = self._streams.get(stream_id)
        if stream is None or self._error is not None:
            return
        change = max(0, held) - stream.held
        if change:
            stream.held += change
            self._add_held(change)
            if change < 0:
                self._grant_link_credit()

    def release_held(self) -> None:
        """The link is over: whatever its streams held no longer counts against the node."""
        for stream in self._streams.values():
            stream.held = 0
        if self._held:
            self._add_held(-self._held)

    def handle_timer(self, now: float) -> None:
        """A timer tick (once per keepalive interval): the flood budgets start
        afresh, and credit held back for the node's budget is looked at again."""
        self._pongs = self._pings_seen = self._resets = 0
        if self._error is None:
            self._grant_link_credit()

    def consumed(self, stream_id: int, size: int) -> None:
        """The application took ``size`` received bytes off this stream: grant them again.

        Report every received byte once, read or dropped, or the link window
        shrinks for good. Bytes of a stream that is gone still free link credit.
        """
        if self._error is not None or size <= 0:
            return
        self._release_link_credit(size)
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        if size > stream.unconsumed:
            size = stream.unconsumed
        stream.unconsumed -= size
        if not stream.remote_open:
            return
        stream.pending_update += size
        if stream.pending_update >= self._stream_update_threshold:
            self._frame(WINDOW, 0, stream_id, U32.pack(stream.pending_update))
            stream.recv_window += stream.pending_update
            stream.pending_update = 0

    def _release_link_credit(self, size: int) -> None:
        if size > self._link_unconsumed:
            size = self._link_unconsumed
        self._link_unconsumed -= size
        self._link_pending_update += size
        if self._link_pending_update >= self._link_update_threshold:
            self._grant_link_credit()

    def _grant_link_credit(self) -> None:
        # What the peer can make us keep is the credit it has, what is not
        # consumed yet and what is held: window - pending + held. Keeping
        # ``pending >= held - allowance`` bounds it by window + allowance.
        grant = self._link_pending_update
        if self._held:
            grant -= max(0, self._held - self._held_allowance())
        # Held back credit goes out as soon as any of it may: the peer may
        # have run dry waiting for it.
        if grant >= self._link_update_threshold or (
            grant > 0 and self._link_pending_update >= self._link_update_threshold
        ):
            self._frame(WINDOW, 0, 0, U32.pack(grant))
            self._link_recv_window += grant
            self._link_pending_update -= grant

    def _held_allowance(self) -> int:
        allowance = self.config.max_held
        budget = self.node_budget
        if budget is not None:
            others = budget.held - self._held
            allowance = min(allowance, max(0, budget.limit - others))
        return allowance

    def _add_held(self, change: int) -> None:
        self._held += change
        if self.node_budget is not None:
            self.node_budget.held += change

    def send_ping(self, now: float) -> None:
        """Ask for a PONG; its arrival gives a PongReceived carrying ``now`` back.

        Also a timer tick (see ``handle_timer``).
        """
        self._check_alive()
        self.handle_timer(now)
        if len(self._pings) >= _MAX_OUTSTANDING_PINGS:
            self._pings.pop(next(iter(self._pings)))
        self._ping_counter += 1
        opaque = PING_BODY.pack(self._ping_counter)
        self._pings[opaque] = now
        self._frame(PING, 0, 0, opaque)

    def goaway(self, error: ProtocolError) -> None:
        """Refuse new streams from now on; existing ones may finish."""
        if self._error is not None or self._goaway_sent:
            return
        self._goaway_sent = True
        self._frame(GOAWAY, 0, 0, U32.pack(self._last_peer_id) + pack_error(error))

    def data_to_send(self) -> bytes:
        if not self._out:
            return b""
        out = b"".join(self._out)
        self._out.clear()
        return out

    # ----- receiving

    def receive_data(self, data: bytes) -> list[Event]:
        """Parse whatever whole frames ``data`` completes; keep the rest."""
        self._check_alive()
        buf = self._inbuf + data if self._inbuf else data
        # DATA payloads are views into ``buf``, not copies.
        view = memoryview(buf)
        events: list[Event] = []
        offset = 0
        total = len(buf)
        max_frame = self.config.max_frame
        try:
            while total - offset >= HEADER_BYTES:
                kind, flags, stream_id, length = HEADER.unpack_from(buf, offset)
                limit = max_frame if kind == DATA else CONTROL_LIMITS.get(kind)
                if limit is None:
                    raise bad_request(f"unknown frame type {kind}")
                if length > limit:
                    raise bad_request(f"frame type {kind} of {length} bytes exceeds {limit}")
                end = offset + HEADER_BYTES + length
                if end > total:
                    break
                if kind == DATA:
                    self._on_data(flags, stream_id, view[offset + HEADER_BYTES : end], events)
                else:
                    payload = bytes(view[offset + HEADER_BYTES : end])
                    self._on_control(kind, flags, stream_id, payload, events)
                offset = end
        except ProtocolError as exc:
            self._fail(exc)
            raise
        self._inbuf = bytes(view[offset:]) if offset < total else b""
        return events

    def _on_data(
        self, flags: int, stream_id: int, payload: memoryview, events: list[Event]
    ) -> None:
        if flags & ~FIN:
            raise bad_request(f"unknown DATA flags {flags:#x}")
        if self._peer is None:
            raise bad_request("DATA before SETTINGS")
        size = len(payload)
        if size > self._link_recv_window:
            raise bad_request("peer overran the link window")
        self._link_recv_window -= size
        self._link_unconsumed += size
        stream = self._streams.get(stream_id)
        if stream is None:
            if not self._was_opened(stream_id):
                raise bad_request(f"DATA on stream {stream_id}, which was never opened")
            # Data in flight when the stream was reset: drop it, keep the credit flowing.
            self._release_link_credit(size)
            return
        if not stream.remote_open:
            self._release_link_credit(size)
            self._stream_error(stream_id, "data after the end of the stream", events)
            return
        if size > stream.recv_window:
            self._release_link_credit(size)
            self._stream_error(stream_id, "peer overran the stream window", events)
            return
        stream.recv_window -= size
        stream.unconsumed += size
        if size:
            events.append(DataReceived(stream_id, payload))
        if flags & FIN:
            stream.remote_open = False
            events.append(StreamEnded(stream_id))
            self._maybe_forget(stream_id, stream)

    def _on_control(
        self,
        kind: int,
        flags: int,
        stream_id: int,
        payload: bytes,
        events: list[Event],
    ) -> None:
        if flags:
            raise bad_request(f"frame type {kind} carries unknown flags {flags:#x}")
        if kind == SETTINGS:
            self._on_settings(stream_id, payload, events)
            return
        if self._peer is None:
            raise bad_request(f"frame type {kind} before SETTINGS")
        if kind in (OPEN, RESET):
            if stream_id == 0:
                raise bad_request(f"frame type {kind} on stream 0")
            if kind == OPEN:
                self._on_open(stream_id, payload, events)
            else:
                self._on_reset(stream_id, payload, events)
        elif kind == WINDOW:
            self._on_window(stream_id, payload, events)
        elif stream_id != 0:
            raise bad_request(f"frame type {kind} must be on stream 0")
        elif kind == PING:
            if len(payload) != 8:
                raise bad_request("PING payload must be 8 bytes")
            self._pings_seen += 1
            if self._pings_seen > self.config.ping_flood:
                raise ProtocolError(ErrorCode.OVERLOADED, f"PING flood ({self._pings_seen} in one interval)")
            if self._pongs < self.config.max_pongs:
                self._pongs += 1
                self._frame(PONG, 0, 0, payload)
        elif kind == PONG:
            if len(payload) != 8:
                raise bad_request("PONG payload must be 8 bytes")
            sent_at = self._pings.pop(payload, None)
            if sent_at is not None:
                events.append(PongReceived(sent_at))
        else:
            self._on_goaway(payload, events)

    def _on_settings(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id != 0:
            raise bad_request("SETTINGS must be on stream 0")
        if self._peer is not None:
            raise bad_request("SETTINGS sent twice")
        self._peer = read_settings(payload)
        self._link_send_window = self._peer.link_window
        for stream in self._streams.values():
            stream.send_window = self._peer.stream_window
        events.append(CreditAvailable(0))

    def _on_open(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        self._count_reset(0)
        if self._is_local(stream_id):
            raise bad_request(f"peer opened stream {stream_id} with our parity")
        if stream_id <= self._last_peer_id:
            raise bad_request(f"peer reopened stream {stream_id}")
        self._last_peer_id = stream_id
        try:
            protocol = payload.decode()
        except UnicodeDecodeError:
            protocol = ""
        refusal = None
        if not protocol:
            refusal = ProtocolError(ErrorCode.BAD_REQUEST, "bad protocol name")
        elif self._goaway_sent:
            refusal = ProtocolError(ErrorCode.OVERLOADED, "link is going away", retry_after_ms=0)
        elif self._peer_count >= self.config.max_streams:
            refusal = ProtocolError(
                ErrorCode.OVERLOADED, f"at most {self.config.max_streams} concurrent streams"
            )
        if refusal is not None:
            self._count_reset()
            self._frame(RESET, 0, stream_id, pack_error(refusal))
            return
        assert self._peer is not None
        self._streams[stream_id] = _Stream(
            send_window=self._peer.stream_window, recv_window=self.config.stream_window
        )
        self._peer_count += 1
        events.append(StreamOpened(stream_id, protocol))

    def _on_reset(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        self._count_reset()
        error = unpack_error(payload)
        if stream_id not in self._streams:
            if not self._was_opened(stream_id):
                raise bad_request(f"RESET of stream {stream_id}, which was never opened")
            return
        self._forget(stream_id)
        events.append(StreamReset(stream_id, error, remote=True))

    def _on_window(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            raise bad_request("WINDOW payload must be 4 bytes")
        (increment,) = U32.unpack(payload)
        if not 1 <= increment <= MAX_WINDOW:
            raise bad_request(f"window increment {increment} out of range")
        if stream_id == 0:
            self._link_send_window += increment
            if self._link_send_window > MAX_WINDOW:
                raise bad_request("link window overflow")
            events.append(CreditAvailable(0))
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            if not self._was_opened(stream_id):
                raise bad_request(f"WINDOW for stream {stream_id}, which was never opened")
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            self._stream_error(stream_id, "stream window overflow", events)
            return
        events.append(CreditAvailable(stream_id))

    def _on_goaway(self, payload: bytes, events: list[Event]) -> None:
        if len(payload) < 4:
            raise bad_request("truncated GOAWAY")
        (last_stream_id,) = U32.unpack_from(payload)
        error = unpack_error(payload[4:])
        if self._goaway_received is None:
            self._goaway_received = error
        events.append(GoAwayReceived(last_stream_id, error))
        unprocessed = [sid for sid in self._streams if sid > last_stream_id and self._is_local(sid)]
        for sid in unprocessed:
            self._forget(sid)
            events.append(
                StreamReset(
                    sid,
                    ProtocolError(ErrorCode.OVERLOADED, f"peer went away: {error.message}"),
                    remote=True,
                )
            )

    # ----- internals

    def _queue_settings(self) -> None:
        self._frame(SETTINGS, 0, 0, settings_payload(self.config))

    def _frame(
        self, kind: int, flags: int, stream_id: int, payload: bytes | bytearray | memoryview
    ) -> None:
        self._out.append(HEADER.pack(kind, flags, stream_id, len(payload)))
        if payload:
            self._out.append(payload)

    def _is_local(self, stream_id: int) -> bool:
        return (stream_id % 2 == 1) == self._dialer

    def _was_opened(self, stream_id: int) -> bool:
        if self._is_local(stream_id):
            return stream_id < self._next_local_id
        return stream_id <= self._last_peer_id

    def _count_reset(self, count: int = 1) -> None:
        self._resets += count
        if self._resets > self.config.reset_flood:
            raise ProtocolError(
                ErrorCode.OVERLOADED, f"RESET flood ({self._resets} refused or reset streams in one interval)"
            )

    def _stream_error(self, stream_id: int, message: str, events: list[Event]) -> None:
        self._count_reset()
        error = ProtocolError(ErrorCode.BAD_REQUEST, message)
        self._frame(RESET, 0, stream_id, pack_error(error))
        self._forget(stream_id)
        events.append(StreamReset(stream_id, error, remote=False))

    def _maybe_forget(self, stream_id: int, stream: _Stream) -> None:
        if not stream.local_open and not stream.remote_open:
            self._forget(stream_id)

    def _forget(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id)
        if stream.held:
            self._add_held(-stream.held)
            if self._error is None:
                self._grant_link_credit()
        if self._is_local(stream_id):
            self._local_count -= 1
        else:
            self._peer_count -= 1

    def _check_alive(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail(self, error: ProtocolError) -> None:
        self.release_held()
        self._out.clear()
        self._frame(GOAWAY, 0, 0, U32.pack(self._last_peer_id) + pack_error(error))
        self._error = error
