"""A secure, multiplexed link: the secure channel carrying the stream mux (sans-IO).

This is everything of a peer link except the transport, so the same link runs
over a WebSocket, a relay circuit or an in-memory pipe: feed it the records
that arrive, send the records it hands out, in order; once it is up, call
``handle_timer(now)`` when ``next_timer()`` comes.

The timer keeps the link alive and notices a dead peer: each keepalive tick
sends a PING (whose PONG proves the peer is there, and gives the round-trip
time), and a link that has received nothing for ``dead_after`` seconds is
over. Silence is measured in ticks, so that receiving a record costs no clock
read.
"""

from __future__ import annotations

from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.mux import Mux
from wire.mux_config import MuxConfig
from wire.mux_events import Event
from wire.noise import SecureChannel


class SecureLink:
    def __init__(
        self,
        identity: NodeIdentity,
        *,
        dialer: bool,
        mesh_key: bytes | None = None,
        expected_node_id: str | None = None,
        mux_config: MuxConfig | None = None,
    ) -> None:
        self.dialer = dialer
        self.channel = SecureChannel(
            identity, initiator=dialer, mesh_key=mesh_key, expected_node_id=expected_node_id
        )
        self.mux = Mux(dialer=dialer, config=mux_config)
        # Records received, and as many when the last tick looked.
        self._records = 0
        self._heard = 0
        self._heard_at = 0.0
        self._interval = 0.0
        self._dead_after = 0.0
        self._tick: float | None = None
        self._silence: ProtocolError | None = None

    @property
    def established(self) -> bool:
        return self.channel.established

    @property
    def remote_node_id(self) -> str | None:
        return self.channel.remote_node_id

    @property
    def error(self) -> ProtocolError | None:
        return self.channel.error or self.mux.error or self._silence

    def receive_record(self, record: bytes) -> list[Event]:
        """Authenticate and decrypt one record and run its plaintext through the mux.

        Raises ``ProtocolError`` when the link must close; whatever the peer
        should still be told (a REJECT, a GOAWAY) is left in ``records_to_send``.
        """
        self._records += 1
        plaintext = self.channel.receive_record(record)
        if not plaintext:
            return []
        return self.mux.receive_data(plaintext)

    def records_to_send(self) -> list[bytes]:
        channel = self.channel
        if self.mux.has_output and channel.can_send:
            channel.send(self.mux.data_to_send())
        return channel.records_to_send()

    # ----- timers

    def start_keepalive(self, now: float, *, interval: float, dead_after: float) -> None:
        """Ping every ``interval`` seconds from ``now`` on; give up after ``dead_after`` of silence."""
        if not (interval > 0 and dead_after > 0):
            raise ValueError("the keepalive interval and dead_after must be positive")
        self._interval = interval
        self._dead_after = dead_after
        self._heard = self._records
        self._heard_at = now
        self._tick = now + interval

    def next_timer(self) -> float | None:
        """When ``handle_timer`` must run next (absolute, in the caller's clock); None: never."""
        return None if self.error is not None else self._tick

    def handle_timer(self, now: float) -> ProtocolError | None:
        """Run the keepalive if it is due: queue a PING, or find the peer dead.

        Returns the error that ends the link when the peer has been silent for
        too long (also ``error`` from then on); send ``records_to_send`` after.
        """
        tick = self._tick
        if tick is None or now < tick or self.error is not None:
            return None
        if self._records != self._heard:
            self._heard = self._records
            self._heard_at = now
        elif now - self._heard_at >= self._dead_after:
            self._tick = None
            self._silence = ProtocolError(
                ErrorCode.UNREACHABLE, f"no traffic from the peer for {now - self._heard_at:.1f} s"
            )
            return self._silence
        self.mux.send_ping(now)
        self._tick = now + self._interval
        return None
