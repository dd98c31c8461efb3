"""What a mux (wire.mux) tells its owner happened on the link, one event per received frame at most."""

from __future__ import annotations

from dataclasses import dataclass

from wire.errors import ProtocolError

# build, and one is built per received frame.


@dataclass(slots=True)
class StreamOpened:
    stream_id: int
    protocol: str


@dataclass(slots=True)
class DataReceived:
    """Stream data; ``data`` is a read-only view of the received buffer."""

    stream_id: int
    data: memoryview


@dataclass(slots=True)
class StreamEnded:
    """The peer will send no more on this stream (half-close)."""

    stream_id: int


@dataclass(slots=True)
class StreamReset:
    """The stream is gone. ``remote`` tells who reset it; unread data is void
    unless the peer had already ended its side."""

    stream_id: int
    error: ProtocolError
    remote: bool


@dataclass(slots=True)
class CreditAvailable:
    """Send credit grew: for one stream, or (id 0) for the link or after SETTINGS."""

    stream_id: int


@dataclass(slots=True)
class PongReceived:
    """The answer to a ``send_ping(now)``; ``sent_at`` is that ``now``."""

    sent_at: float


@dataclass(slots=True)
class GoAwayReceived:
    """The peer takes no new streams; ours above ``last_stream_id`` were reset."""

    last_stream_id: int
    error: ProtocolError


Event = (
    StreamOpened
    | DataReceived
    | StreamEnded
    | StreamReset
    | CreditAvailable
    | PongReceived
    | GoAwayReceived
)
