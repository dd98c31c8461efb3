"""Hole punching, the trio shell of ``relay.punch``: from a relayed link to a direct one.

The end a relay brings a circuit to (``Puncher.initiate``, run once that circuit's link is up)
swaps ports and a sync with the other end (``Puncher.respond``, the PUNCH_PROTOCOL handler) over
the circuit; both then dial from their listening ports. The connection both SYNs open runs an
ordinary link (WebSocket, Noise authenticating the node the circuit reached, mux), and
``Peers`` prefers it to the relayed one, which it retires: the relay carries nothing more for
that pair. If no round of ``PunchLimits.tries`` succeeds, the link stays relayed, with one log line,
and the punch is tried again later (``PunchLimits.retry_after``) while the link lives.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from collections.abc import Callable

import trio

from meshd.net import rpc
from meshd.net.link import Link
from meshd.net.peers import Peers
from meshd.net.stream import Stream, StreamLink
from meshd.relay.circuit import CircuitTransport
from relay.punch import (
    PUNCH_PROTOCOL,
    PunchBudget,
    PunchConnect,
    PunchLimits,
    PunchSync,
    dial_delay,
    punch_target,
)
from wire.errors import ErrorCode, ProtocolError

log = logging.getLogger(__name__)

# Where a node can be dialed directly, if anywhere (its signed record's address when it is public).
DirectAddress = Callable[[str], "str | None"]

# How often the initiator looks, after a dial of its own failed, for the other end's dial having
# landed on its listener (no NAT between them): a plain inbound link that replaces the circuit.
_LANDED_POLL = 0.05


class PunchFailed(Exception):
    """One round did not open a connection; ``landed``: because the other end's dial came in on our
    listener first (the connection is taken), which happens only with no NAT between us; ``refused``:
    the other end does not punch (it listens nowhere, as ``meshd ask`` does, or it refused), so no
    later round would do better."""

    def __init__(self, message: str, landed: bool = False, refused: bool = False) -> None:
        super().__init__(message)
        self.landed = landed
        self.refused = refused


async def dial_from(local: tuple[str, int], target: tuple[str, int], timeout: float) -> trio.SocketStream:
    """A TCP connection to ``target`` from ``local``, the host and port our listener is bound to
    (see ``Peers.listen``), within ``timeout``; ``PunchFailed`` otherwise."""
    family = socket.AF_INET6 if ":" in target[0] else socket.AF_INET
    host = local[0]
    if (":" in host) != (family == socket.AF_INET6) or ipaddress.ip_address(host).is_unspecified:
        # a wildcard listener (or one of the other family): any address of ours, the route's choice
        host = "::" if family == socket.AF_INET6 else "0.0.0.0"
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        await sock.bind((host, local[1]))
        with trio.fail_after(timeout):
            await sock.connect(target)
    except trio.TooSlowError:
        sock.close()
        raise PunchFailed(f"no TCP connection to {target[0]}:{target[1]} within {timeout:g} s") from None
    except OSError as exc:
        sock.close()
        landed = exc.errno in (errno.EADDRNOTAVAIL, errno.EADDRINUSE)
        raise PunchFailed(f"{target[0]}:{target[1]}: {exc.strerror or exc}", landed) from None
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


class Puncher:
    """Hole punches for one ``Peers``: answers the other end's requests, and runs them for circuits
    relays bring (pass ``initiate`` as ``enable_circuits``' ``on_circuit``)."""

    def __init__(self, peers: Peers, limits: PunchLimits | None = None,
                 direct_address: DirectAddress = lambda node: None) -> None:
        self.peers = peers
        self.limits = limits or PunchLimits()
        self._direct_address = direct_address
        self.budget = PunchBudget(self.limits)
        # node id -> "punched" or the last failure, for status and the tests
        self.outcomes: dict[str, str] = {}
        peers.handle(PUNCH_PROTOCOL, self.respond)

    def _local(self) -> tuple[str, int]:
        host, port = self.peers.listen_host, self.peers.listen_port
        if host is None or port is None:
            raise ProtocolError(ErrorCode.UNREACHABLE, "this node listens on no port to punch from")
        return host, port

    @staticmethod
    def _observed(link: StreamLink) -> str:
        transport = link.transport
        if link.path != "relayed" or not isinstance(transport, CircuitTransport):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a hole punch runs over a relay's circuit only")
        return transport.observed

    def _went_direct(self, node: str) -> bool:
        link = self.peers.link_to(node)
        return link is not None and link.path != "relayed"

    async def initiate(self, link: Link) -> None:
        """Tries to replace ``link`` (a circuit a relay brought) by a punched one, again after a
        failure while the link lives (``PunchLimits.retry_after``); never raises for the peer's doing."""
        node = link.remote_node_id
        if not self._observed(link):
            log.debug("no hole punch to %s: the relay told no address (it is no member)", node[:16])
            return
        if await self._reverse(node):
            return
        wait, told = self.limits.retry_after, False
        while True:
            failure, refused = await self._attempt(link)
            if self._went_direct(node):
                path = self.peers.link_to(node)
                self._note(node, "punched")
                log.info("went direct to %s (%s link)", node[:16], path.path if path is not None else "?")
                return
            self._note(node, failure)
            # a peer that cannot punch (an asker listening nowhere) is no news, nor is a retry's failure
            # after the first: the node's own log says once when a punch was tried and failed
            log.log(logging.DEBUG if refused or told else logging.INFO,
                    "hole punch to %s failed, staying relayed: %s", node[:16], failure)
            told = True
            if refused or not link.usable:
                return
            with trio.move_on_after(wait):
                await link.wait_closed()
            if not link.usable or self._went_direct(node):
                return
            wait = min(2 * wait, self.limits.retry_cap)

    async def _attempt(self, link: Link) -> tuple[str, bool]:
        """Up to ``PunchLimits.tries`` rounds, until one goes direct: the last failure, and whether
        the other end refused (no later round would do better)."""
        node = link.remote_node_id
        failure = "no round ran"
        for _ in range(self.limits.tries):
            if self._went_direct(node) or not link.usable:
                break
            try:
                await self._round(link)
            except PunchFailed as exc:
                if exc.refused:
                    return str(exc), True
                failure = str(exc)
                continue
            except ProtocolError as exc:
                failure = str(exc)
                continue
            if self._went_direct(node):
                break
        return failure, False

    async def _reverse(self, node: str) -> bool:
        """DCUtR's unilateral upgrade: a peer whose record says it is public is dialed there, as any
        member is (the address is its signed record's, not the peer's word on this stream)."""
        address = self._direct_address(node)
        if address is None:
            return False
        try:
            await self.peers.dial_direct(address, node)
        except ProtocolError as exc:
            log.debug("dialing %s back at %s: %s", node[:16], address, exc)
            return False
        if not self._went_direct(node):
            return False
        self._note(node, "direct")
        log.info("went direct to %s (dialed it back at %s)", node[:16], address)
        return True

    def _note(self, node: str, outcome: str) -> None:
        if node not in self.outcomes and len(self.outcomes) >= 4096:
            self.outcomes.pop(next(iter(self.outcomes)))
        self.outcomes[node] = outcome

    async def _round(self, link: Link) -> None:
        node = link.remote_node_id
        observed = self._observed(link)
        local = self._local()
        refusal = self.budget.take(node, trio.current_time())
        if refusal is not None:
            # tried lately (a failed punch, then another circuit between the same two): no news
            raise PunchFailed(f"no more rounds now: {refusal}", refused=True)
        try:
            await self._initiate_round(link, node, observed, local)
        finally:
            self.budget.done()

    async def _initiate_round(self, link: Link, node: str, observed: str, local: tuple[str, int]) -> None:
        step = self.limits.step_timeout
        what = f"a hole punch with {node[:16]}"
        stream = link.open_stream(PUNCH_PROTOCOL)
        async with stream:
            sent = trio.current_time()
            try:
                reply = await rpc.request(stream, PunchConnect(port=local[1]), PunchConnect, what, step)
            except ProtocolError as exc:
                if exc.code in (ErrorCode.DEADLINE_EXCEEDED, ErrorCode.OVERLOADED):
                    raise
                raise PunchFailed(f"{node[:16]} does not punch: {exc}", refused=True) from None
            rtt = trio.current_time() - sent
            target = punch_target(observed, reply.port)
            if target is None:
                raise PunchFailed(f"the relay saw {node[:16]} at {observed!r}, no host to dial")
            with rpc.within(step, what):
                await stream.send_message(PunchSync())
            await trio.sleep(dial_delay(rtt, self.limits))
            await self._dial(node, local, target, dialer=False)

    async def respond(self, stream: Stream) -> None:
        """The PUNCH_PROTOCOL handler: the other end of ``_round``."""
        link = stream.link
        node = link.remote_node_id
        observed = self._observed(link)
        refusal = self.budget.take(node, trio.current_time())
        if refusal is not None:
            raise ProtocolError(ErrorCode.OVERLOADED, f"no more hole punches now: {refusal}",
                                retry_after_ms=int(self.limits.window * 1000))
        try:
            step = self.limits.step_timeout
            what = f"a hole punch with {node[:16]}"
            request = await rpc.receive(stream, PunchConnect, what, step)
            target = punch_target(observed, request.port)
            if target is None:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"the relay saw this node at {observed!r}: no host")
            local = self._local()
            await rpc.request(stream, PunchConnect(port=local[1]), PunchSync, what, step)
            try:
                await self._dial(node, local, target, dialer=True)
            except PunchFailed as exc:
                log.debug("hole punch round with %s: %s", node[:16], exc)
        finally:
            self.budget.done()

    async def _dial(self, node: str, local: tuple[str, int], target: tuple[str, int], *, dialer: bool) -> None:
        """Opens the connection from ``local`` and runs a link over it that must authenticate ``node``."""
        try:
            connection = await dial_from(local, target, self.limits.connect_timeout)
        except PunchFailed as exc:
            if dialer or not exc.landed:
                raise
            # The other end's dial came in on our listener (no NAT between us): that link, a plain
            # inbound one once authenticated, replaces the circuit by itself.
            with trio.move_on_after(self.peers.config.dial_timeout):
                while not self._went_direct(node):
                    await trio.sleep(_LANDED_POLL)
                return
            raise PunchFailed("the other end's dial came in on our listener but no link followed") from None
        await self.peers.adopt(connection, dialer=dialer, node_id=node, path="punched")
