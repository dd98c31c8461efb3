"""A secure, multiplexed link: the secure channel carrying the stream mux (sans-IO).

This is everything of a peer link except the transport, so the same link runs
over a WebSocket, a relay circuit or an in-memory pipe: feed it the records
that arrive, send the records it hands out, in order.
"""

from __future__ import annotations

from wire.errors import ProtocolError
from wire.identity import NodeIdentity
from wire.mux import Event, Mux, MuxConfig
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

    @property
    def established(self) -> bool:
        return self.channel.established

    @property
    def remote_node_id(self) -> str | None:
        return self.channel.remote_node_id

    @property
    def error(self) -> ProtocolError | None:
        return self.channel.error or self.mux.error

    def receive_record(self, record: bytes) -> list[Event]:
        """Authenticate and decrypt one record and run its plaintext through the mux.

        Raises ``ProtocolError`` when the link must close; whatever the peer
        should still be told (a REJECT, a GOAWAY) is left in ``records_to_send``.
        """
        plaintext = self.channel.receive_record(record)
        if not plaintext:
            return []
        return self.mux.receive_data(plaintext)

    def records_to_send(self) -> list[bytes]:
        channel = self.channel
        if self.mux.has_output and channel.can_send:
            channel.send(self.mux.data_to_send())
        return channel.records_to_send()
