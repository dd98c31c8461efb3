"""A fast-path connection to a stage that has no address to dial, punched over the link that reaches it.

A stage behind a NAT is known by a relay's circuit address, which no TCP dial reaches. When this
node's link to it is direct or punched (``meshd.relay.punch``), the fast path's connection
(``meshd.net.fastconn``) is punched over that link instead: the dialing end binds a fresh port and
names it (``FastPunch``), the other end binds one, answers with it and dials at once, and the dialing
end dials half the round trip later (``relay.punch.dial_delay``). Each NAT lets the other's SYN in as
the answer to its own, and the two SYNs make one connection (TCP simultaneous open). The dialing end
also listens on its port, so where no NAT stands in front of it the other's SYN lands there instead.
It then sends the fast-link preamble as on a dialed connection, and the other end hands the
connection to its fast door as its listener does; from there on nothing differs.

A peer names only a port: each end dials the host its link to the other comes from. Rounds are
bounded (``FastPunchLimits``): a few per connection, and at once per peer and per node on the
answering side, each within the link's step and connect timeouts.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import weakref
from collections import Counter
from collections.abc import AsyncIterator

import trio

from meshd.net.fastconn import FastHandler, dial_fast, is_fast, read_token
from meshd.net.stream import Stream, StreamLink
from meshd.net.urls import split_address, split_url, ws_url
from relay.protocol import CIRCUIT_MARK
from relay.punch import FAST_PUNCH_PROTOCOL, FastPunch, FastPunchLimits, PunchLimits, dial_delay, punch_target
from wire.errors import ErrorCode, ProtocolError
from wire.fastlink import preamble
from wire.message import ErrorMessage, Message, error_from_message

log = logging.getLogger(__name__)


# How a stage's error (BAD_REQUEST) begins when a fast session's next hop is a stage behind a NAT that
# only a relay's circuit reaches (said at open), or to which no connection could be punched (said when
# the hop begins): the asker then runs the session on the daemons' path (meshd.client.ask), and nobody
# is routed around
RELAYED_HOP = "the fast path takes direct or punched hops, not a relay's circuit"


# links whose first punched fast-path connection the log has told, and links over which a connection
# could not be punched, whose sessions then open on the daemons' path at once (weak: an entry goes with
# its link, and a new link to the node is tried afresh)
_told: weakref.WeakSet[StreamLink] = weakref.WeakSet()
_unpunchable: weakref.WeakSet[StreamLink] = weakref.WeakSet()


class _RoundFailed(Exception):
    pass


def fast_reaches(address: str, link: StreamLink | None) -> bool:
    """Whether a fast-path connection can go to ``address``: a host and port is dialed; a relay's
    circuit needs a link to that node that is direct or punched (``link``: this node's, if any), and
    over which no punch has failed (a proxy in between, a NAT that changed its mind)."""
    return CIRCUIT_MARK not in address or link is not None and link.path != "relayed" and link not in _unpunchable


async def connect_fast(address: str, link: StreamLink, token: bytes, timeout: float,
                       limits: PunchLimits = PunchLimits(),
                       rounds: FastPunchLimits = FastPunchLimits()) -> trio.SocketStream:
    """A connection to the stage at ``address`` (which ``link`` reaches) that has sent the preamble for
    ``token``: dialed where the address is a host and port (UNREACHABLE if that fails), punched over
    ``link`` where it is a relay's circuit (BAD_REQUEST, starting with RELAYED_HOP, if that fails
    within ``timeout``)."""
    if CIRCUIT_MARK not in address:
        host, port = split_address(address)
        return await dial_fast(host, port, token, timeout)
    node = link.remote_node_id[:16]
    if link.path == "relayed":
        raise _not_punched(f"only a relay's circuit reaches {node}")
    failure = ""
    try:
        with trio.move_on_after(timeout):
            for attempt in range(1, rounds.tries + 1):
                try:
                    connection = await _round(link, limits)
                except _RoundFailed as exc:
                    failure = str(exc)
                    log.debug("fast punch to %s: round %d of %d failed: %s", node, attempt, rounds.tries, failure)
                    continue
                try:
                    await connection.send_all(preamble(token))
                except (OSError, trio.BrokenResourceError) as exc:
                    await trio.aclose_forcefully(connection)
                    failure = f"the punched connection went: {exc}"
                    continue
                # the node's log says once per link that its fast path goes there (a session each after that)
                if link not in _told:
                    _told.add(link)
                    log.info("fast path to %s: punched a connection over the %s link", node, link.path)
                return connection
            raise _not_punched(f"no fast-path connection punched to {node}: {failure}")
        failure = failure or "no round ended"
        raise _not_punched(f"no fast-path connection punched to {node} within {timeout:g} s: {failure}")
    except BaseException:
        # Remembered also where whoever waited gave up first (an asker's stall bound shorter than the
        # rounds: the session is cancelled): else each of the link's sessions ran the same rounds and
        # stalled the same way, its asker routing around healthy stages until no route was left.
        if failure and link not in _unpunchable:
            _unpunchable.add(link)
            log.info("no fast-path connection punched to %s over the %s link: %s; its sessions take the "
                     "daemons' path", node, link.path, failure)
        raise


def _not_punched(why: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, f"{RELAYED_HOP} ({why})")


def _link_host(link: StreamLink) -> str:
    """The host the link's connection comes from (a punched link's: the other end's NAT)."""
    try:
        return split_url(ws_url(link.address))[0]
    except (ValueError, ProtocolError):
        raise _RoundFailed(f"the link's address {link.address!r} names no host") from None


def _socket(host: str) -> trio.socket.SocketType:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


@contextlib.asynccontextmanager
async def _ports(host: str, listening: bool) -> AsyncIterator[tuple[trio.socket.SocketType, trio.socket.SocketType | None]]:
    """A dialing socket on a fresh port (and, ``listening``, a listener on the same port), closed after."""
    wildcard = "::" if ":" in host else "0.0.0.0"
    sock = _socket(host)
    listener = _socket(host) if listening else None
    try:
        if listener is not None:
            await listener.bind((wildcard, 0))
            listener.listen(1)
            await sock.bind((wildcard, listener.getsockname()[1]))
        else:
            await sock.bind((wildcard, 0))
        yield sock, listener
    finally:
        sock.close()
        if listener is not None:
            listener.close()


async def _exchange(stream: Stream, message: Message | None, timeout: float) -> FastPunch:
    with trio.fail_after(timeout):
        if message is not None:
            await stream.send_message(message)
        reply = await stream.receive_message()
    if isinstance(reply, ErrorMessage):
        raise error_from_message(reply)
    if not isinstance(reply, FastPunch):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"expected a fast punch, got {reply.type!r}")
    return reply


async def _round(link: StreamLink, limits: PunchLimits) -> trio.SocketStream:
    host = _link_host(link)
    async with _ports(host, listening=True) as (sock, listener):
        assert listener is not None
        stream = link.open_stream(FAST_PUNCH_PROTOCOL)
        async with stream:
            sent = trio.current_time()
            try:
                reply = await _exchange(stream, FastPunch(port=sock.getsockname()[1]), limits.step_timeout)
            except (ProtocolError, trio.TooSlowError) as exc:
                raise _RoundFailed(f"no fast punch answered: {exc or 'timed out'}") from None
            target = punch_target(host, reply.port)
            if target is None:
                raise _RoundFailed(f"{host} is no host to dial")
            await trio.sleep(dial_delay(trio.current_time() - sent, limits))
            return await _meet(sock, listener, target, limits.connect_timeout)


async def _meet(sock: trio.socket.SocketType, listener: trio.socket.SocketType, target: tuple[str, int],
                timeout: float) -> trio.SocketStream:
    """The one connection with ``target``: our SYN crossing theirs, or theirs landing on our listener."""
    won: list[trio.socket.SocketType] = []
    failures: list[str] = []
    strangers = 0
    refused = False

    async def dial(scope: trio.CancelScope) -> None:
        nonlocal refused
        try:
            await sock.connect(target)
        except OSError as exc:
            # EADDRNOTAVAIL: their SYN landed on our listener first, which took the connection
            failures.append(exc.strerror or str(exc))
            refused = exc.errno == errno.ECONNREFUSED
            if refused and strangers:
                scope.cancel()  # the round is over: see accept
            return
        won.append(sock.dup())
        scope.cancel()

    async def accept(scope: trio.CancelScope) -> None:
        nonlocal strangers
        while True:
            conn, peer = await listener.accept()
            if (peer[0], peer[1]) == target:
                won.append(conn)
                scope.cancel()
                return
            # Anyone else who found the port gets nothing. Counted (and the first named): it may be the peer's
            # own SYN from where the link does not say it is (a proxy in front of this node, a NAT that gave
            # the peer another port). Once our SYN was refused too, nothing more comes this round: it ends
            # now rather than at the connect timeout, and the rounds end well within an asker's stall bound.
            if not strangers:
                failures.append(f"refused {peer[0]}:{peer[1]}, not the peer")
            strangers += 1
            conn.close()
            if refused:
                scope.cancel()

    with trio.move_on_after(timeout):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dial, nursery.cancel_scope)
            nursery.start_soon(accept, nursery.cancel_scope)
    if not won:
        more = f" and {strangers - 1} more" if strangers > 1 else ""
        raise _RoundFailed(f"no TCP connection with {target[0]}:{target[1]}: {', '.join(failures) or 'timed out'}{more}")
    for extra in won[1:]:
        extra.close()
    return trio.SocketStream(won[0])


class FastPunchAnswer:
    """The FAST_PUNCH_PROTOCOL handler: the answering end of ``connect_fast``'s rounds, whose
    connections go to ``handler`` (the node's fast door) within ``first_timeout``."""

    def __init__(self, handler: FastHandler, first_timeout: float, limits: PunchLimits = PunchLimits(),
                 rounds: FastPunchLimits = FastPunchLimits()) -> None:
        self.handler = handler
        self.first_timeout = first_timeout
        self.limits = limits
        self.rounds = rounds
        # rounds in flight by peer (a peer's entry goes when its last round ends)
        self.running: Counter[str] = Counter()

    async def __call__(self, stream: Stream) -> None:
        link = stream.link
        node = link.remote_node_id
        if link.path == "relayed":
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a fast-path connection is punched over a direct or punched "
                                                       "link only")
        if self.running[node] >= self.rounds.per_peer or self.running.total() >= self.rounds.in_flight:
            raise ProtocolError(ErrorCode.OVERLOADED, "too many fast-path connections being punched",
                                retry_after_ms=1000)
        self.running[node] += 1
        try:
            await self._answer(stream, link)
        finally:
            self.running[node] -= 1
            if not self.running[node]:
                del self.running[node]

    async def _answer(self, stream: Stream, link: StreamLink) -> None:
        asked = await _exchange(stream, None, self.limits.step_timeout)
        try:
            host = _link_host(link)
        except _RoundFailed as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
        target = punch_target(host, asked.port)
        if target is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{host} is no host to dial")
        async with _ports(host, listening=False) as (sock, _):
            with trio.fail_after(self.limits.step_timeout):
                await stream.send_message(FastPunch(port=sock.getsockname()[1]))
            try:
                with trio.fail_after(self.limits.connect_timeout):
                    await sock.connect(target)
            except (OSError, trio.TooSlowError) as exc:
                log.debug("fast punch with %s: %s", link.remote_node_id[:16], exc or "timed out")
                return
            connection = trio.SocketStream(sock.dup())
        try:
            with trio.move_on_after(self.first_timeout):
                if await is_fast(connection):
                    await self.handler(await read_token(connection), connection)
        except (OSError, ValueError) as exc:
            log.debug("fast punch with %s: no fast-path preamble: %s", link.remote_node_id[:16], exc)
        finally:
            await trio.aclose_forcefully(connection)
