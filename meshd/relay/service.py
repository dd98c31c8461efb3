"""The relay service: trio shell around ``RelayState``.

It keeps one hop stream per reservation, and for each circuit splices the
dialer's hop stream to a stop stream it opens on the reserved node's link,
forwarding bytes it never decodes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from meshd.mesh.records import host_of
from meshd.net import rpc
from meshd.net.peers import Peers
from meshd.net.stream import Stream, StreamLink
from meshd.relay.circuit import CircuitTransport
from relay.limits import Circuit, RelayLimits, RelayState
from relay.protocol import (
    HOP_PROTOCOL,
    STOP_PROTOCOL,
    Accepted,
    Connect,
    Connected,
    Incoming,
    Reserve,
    Reserved,
)
from wire.errors import ErrorCode, ProtocolError

log = logging.getLogger(__name__)

# Bytes moved per read; a link's records are at most 64 KiB anyway.
CHUNK = 64 << 10
STOP_TIMEOUT = 10.0

# Sees every chunk the relay forwards, in order (debugging, and the tests' proof of opacity).
Tap = Callable[[bytes], None]


class RelayService:
    def __init__(self, peers: Peers, limits: RelayLimits | None = None,
                 is_member: Callable[[str], bool] = lambda node: True, tap: Tap | None = None,
                 is_known: Callable[[str], bool] | None = None) -> None:
        self.peers = peers
        self.state = RelayState(limits or RelayLimits())
        self._is_member = is_member
        # Whom a circuit's end may learn the other's public host for (``_connect``): a node with a
        # live member record, first-hand or not (a circuit can come before this relay has probed
        # its dialer); by default the members who may reserve.
        self._is_known = is_known or is_member
        self._tap = tap
        self._links: dict[str, StreamLink] = {}
        self.forwarded_bytes = 0
        peers.handle(HOP_PROTOCOL, self._on_hop)

    @property
    def limits(self) -> RelayLimits:
        return self.state.limits

    async def _on_hop(self, stream: Stream) -> None:
        if isinstance(stream.link.transport, CircuitTransport):
            # a circuit is relayed once: a reservation or a dial through a circuit would nest links
            raise ProtocolError(ErrorCode.BAD_REQUEST, "no circuit runs inside a circuit")
        request = await stream.receive_message()
        if isinstance(request, Reserve):
            await self._reserve(stream)
        elif isinstance(request, Connect):
            await self._connect(stream, request.target)
        else:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{request.type!r} is not a relay request")

    async def _reserve(self, stream: Stream) -> None:
        node = stream.remote_node_id
        # The link is Noise-authenticated (and, with a mesh key, only members can link at all);
        # the record check keeps light clients and strangers who hold the key from parking here.
        if not self._is_member(node):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "only mesh members may reserve on this relay",
                                retry_after_ms=self.limits.retry_after_ms)
        host = host_of(stream.link.address)
        reservation = self.state.reserve(node, trio.current_time(), host)
        self._links[node] = stream.link
        log.info("reservation for %s", node[:16])
        try:
            while True:
                await stream.send_message(Reserved(max_circuit_bytes=self.limits.max_circuit_bytes,
                                                   max_circuit_seconds=self.limits.max_circuit_seconds,
                                                   lifetime_seconds=self.limits.reservation_seconds))
                # Held until the reserver ends it, its link goes, or it runs out unrenewed.
                with trio.move_on_at(self.state.reservation_deadline(reservation)):
                    try:
                        renewal = await stream.receive_message()
                    except (trio.EndOfChannel, ProtocolError):
                        return
                    if not isinstance(renewal, Reserve):
                        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{renewal.type!r} does not renew a reservation")
                    reservation = self.state.reserve(node, trio.current_time(), host)
                    continue
                raise ProtocolError(ErrorCode.DEADLINE_EXCEEDED, "the reservation ran out without renewal")
        finally:
            self.state.release(node, reservation)
            if node not in self.state.reservations:
                self._links.pop(node, None)
            log.info("reservation for %s ended", node[:16])

    async def _connect(self, stream: Stream, target: str) -> None:
        source = stream.remote_node_id
        link = self._links.get(target)
        if link is None or not link.usable or not self.state.holds_reservation(target, trio.current_time()):
            raise ProtocolError(ErrorCode.NOT_FOUND, f"node {target[:16]} holds no reservation on this relay")
        circuit = self.state.open_circuit(source, target, trio.current_time())
        # Each end's public host, for a hole punch between members (meshd.relay.punch); a dialer that is
        # no member (an asker) punches nothing, and learns no volunteer's public host, nor tells its own.
        # (a dialer holding a reservation here is a member this relay probed, though its record may
        # not have reached here yet, as when two homes' first circuit comes right after their joins)
        member = self.state.holds_reservation(source, trio.current_time()) or self._is_known(source)
        try:
            stop = link.open_stream(STOP_PROTOCOL)
            try:
                await rpc.request(stop, Incoming(source=source, observed=host_of(stream.link.address) if member else ""),
                                  Accepted, f"node {target[:16]} taking the circuit", STOP_TIMEOUT)
                await stream.send_message(Connected(observed=host_of(link.address) if member else ""))
                await self._splice(circuit, stream, stop)
            finally:
                await stop.aclose()
        finally:
            self.state.close_circuit(circuit.id)

    async def _splice(self, circuit: Circuit, a: Stream, b: Stream) -> None:
        """Forwards both ways until both ends finish, or a limit or a failure ends the circuit for both."""
        failure: ProtocolError | None = None
        running = 2

        async with trio.open_nursery() as nursery:

            def fail(error: ProtocolError) -> None:
                nonlocal failure
                failure = failure or error
                nursery.cancel_scope.cancel()

            async def pump(src: Stream, dst: Stream) -> None:
                nonlocal running
                try:
                    while True:
                        data = await src.receive_some(CHUNK)
                        if not data:
                            await dst.send_eof()
                            break
                        self.state.forwarded(circuit.id, len(data), trio.current_time())
                        self.forwarded_bytes += len(data)
                        if self._tap is not None:
                            self._tap(data)
                        await dst.send_all(data)
                except ProtocolError as exc:
                    fail(exc)
                running -= 1
                if not running:
                    nursery.cancel_scope.cancel()

            async def watch() -> None:
                while True:
                    await trio.sleep_until(self.state.deadline(circuit.id))
                    expired = self.state.expired(circuit.id, trio.current_time())
                    if expired is not None:
                        fail(expired)
                        return

            nursery.start_soon(pump, a, b)
            nursery.start_soon(pump, b, a)
            nursery.start_soon(watch)
        if failure is not None:
            log.info("circuit %s -> %s ended: %s", circuit.source[:16], circuit.target[:16], failure)
            a.reset(failure)
            b.reset(failure)
