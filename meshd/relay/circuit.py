"""The two ends of a relay circuit: dialing through a relay, and taking circuits a relay brings.

Each end runs an ordinary link (``Peers.attach``) over the circuit, so the
Noise handshake is end to end and the relay forwards only ciphertext.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from meshd.net import rpc
from meshd.net.link import Link
from meshd.net.peers import Peers
from meshd.net.stream import Stream
from meshd.net.transport import StreamTransport
from relay.protocol import (
    HOP_PROTOCOL,
    STOP_PROTOCOL,
    Accepted,
    Connect,
    Connected,
    Incoming,
    is_circuit_address,
    parse_circuit_address,
)
from wire.errors import ErrorCode, ProtocolError
from wire.noise import RecordReader

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0


class CircuitTransport(StreamTransport):
    """Records on a relayed stream. A reset of the stream (the relay enforcing a
    limit, or losing the other end) ends the transport as a hang-up would, and
    is kept in ``error`` for whoever wants to know why."""

    def __init__(self, stream: Stream, remote_address: str, observed: str = "") -> None:
        super().__init__(stream, remote_address)
        self._circuit = stream
        # The host the relay sees the other end at: where a hole punch may dial it.
        self.observed = observed
        self.error: ProtocolError | None = None
        self.closed = trio.Event()

    async def send_record(self, record: bytes) -> None:
        # A link sends again a record whose write raised Cancelled (meshd.net.link): a record
        # must therefore raise it only if none of it went, or the far end gets it twice and
        # fails the link (a spent nonce, PAYLOAD_CORRUPT). The stream's ``send_all`` can raise
        # it after queuing all of it, in the relay link's flush.
        stream = self._circuit
        frame = RecordReader.frame(record)
        try:
            if stream.send_nowait(frame):
                # Queued whole on the relay's link, which writes it in order with all else: sent.
                # A cancellation comes at the caller's next checkpoint instead.
                await trio.lowlevel.cancel_shielded_checkpoint()
                return
            try:
                # Short of the relay link's credit: the stream's way, which waits for it.
                await stream.send_all(frame)
            except trio.Cancelled:
                # Whether any of it went is unknown now: neither sending it again nor skipping
                # it keeps the nonces in step, so the circuit ends (the link sees it broken).
                stream.reset(ProtocolError(ErrorCode.CANCELLED, "a record's write was cut short"))
                raise
        except ProtocolError as exc:
            self.error = self.error or exc
            raise trio.BrokenResourceError(str(exc)) from None

    async def receive_record(self) -> bytes:
        try:
            return await super().receive_record()
        except ProtocolError as exc:
            self.error = self.error or exc
            raise trio.EndOfChannel from None

    async def aclose(self) -> None:
        self.closed.set()
        await super().aclose()


async def open_circuit(peers: Peers, address: str) -> CircuitTransport:
    """A circuit to the node named in ``address``, through the relay it names."""
    relay, target = parse_circuit_address(address)
    what = f"a circuit to {target[:16]} through relay {relay}"
    with rpc.within(CONNECT_TIMEOUT, what):
        stream = await peers.open_stream(relay, HOP_PROTOCOL)
        try:
            reply = await rpc.request(stream, Connect(target=target), Connected, what)
        except BaseException:
            await stream.aclose()
            raise
    return CircuitTransport(stream, address, reply.observed)


async def dial_circuit(peers: Peers, address: str, node_id: str | None) -> Link:
    """A link to the node named in ``address``, run through a circuit of the relay it names."""
    _, target = parse_circuit_address(address)
    if node_id is not None and node_id != target:
        raise ProtocolError(ErrorCode.UNAUTHORIZED, f"{address} is a circuit to another node than {node_id[:16]}")
    transport = await open_circuit(peers, address)
    return await peers.attach(transport, dialer=True, node_id=target, path="relayed")


# Whether a node (the relay, by its node id) holds a reservation of ours, so may bring us circuits.
ReservedOn = Callable[[str], bool]


def reserved_nowhere(relay: str) -> bool:
    return False


# Called with the link a relay's circuit brought, once it is up (meshd.relay.punch tries to go direct).
OnCircuit = Callable[[Link], Awaitable[None]]


async def serve_incoming(peers: Peers, stream: Stream, reserved_on: ReservedOn = reserved_nowhere,
                         on_circuit: OnCircuit | None = None) -> None:
    """A relay brings a circuit: accept it and run a link over it until that link ends.

    Only a relay we hold a reservation on may (anyone else would run links into us that
    no reservation of ours invited), and never over a link that is itself a circuit: a
    circuit inside a circuit would let a peer carry a second full link inside a stream.
    """
    if isinstance(stream.link.transport, CircuitTransport):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "no circuit runs inside a circuit")
    if not reserved_on(stream.remote_node_id):
        raise ProtocolError(ErrorCode.UNAUTHORIZED, "this node holds no reservation on that relay")
    request = await rpc.receive(stream, Incoming, "a relay's incoming circuit")
    await stream.send_message(Accepted())
    transport = CircuitTransport(stream, f"circuit from {request.source[:16]} via {stream.remote_node_id[:16]}",
                                 request.observed)
    # The relay vouches for who dials; the handshake checks it.
    link = await peers.attach(transport, dialer=False, node_id=request.source, path="relayed")
    if on_circuit is not None and link.transport is transport:
        await on_circuit(link)
    await transport.closed.wait()


def enable_circuits(peers: Peers, reserved_on: ReservedOn = reserved_nowhere,
                    on_circuit: OnCircuit | None = None) -> None:
    """Let ``peers`` dial circuit addresses (``connect``, ``open_stream``) and take circuits the
    relays ``reserved_on`` names bring (by default none: a node with no reservation takes none);
    ``on_circuit`` runs with the link each one brings, once it is up."""

    async def dial(address: str, node_id: str | None) -> Link:
        return await dial_circuit(peers, address, node_id)

    async def incoming(stream: Stream) -> None:
        await serve_incoming(peers, stream, reserved_on, on_circuit)

    peers.add_dialer(is_circuit_address, dial)
    peers.handle(STOP_PROTOCOL, incoming)
