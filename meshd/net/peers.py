"""Peers: listen, dial and keep one secure link per peer; route streams to handlers.

Usage::

    async with open_peers(identity, PeersConfig(mesh_key=key)) as peers:
        peers.handle("stage", serve_stage)            # async def serve_stage(stream)
        port = await peers.listen("0.0.0.0", 7400)
        stream = await peers.open_stream("10.0.0.2:7400", "stage", node_id=expected)
        await stream.send_message(activation)
        reply = await stream.receive_message()

Links are WebSockets (``ws://host:port``) by default; ``attach`` runs a link
over any other record transport, such as a relay circuit.

When two peers dial each other at once, both keep the link dialed by the
lower node id and retire the other gracefully (GOAWAY, open streams finish).

Every dial ends within ``dial_timeout`` (TCP, WebSocket upgrade and Noise
handshake together) with a ``ProtocolError`` naming the address and the stage
that hung; nothing on the dial path shields itself from cancellation. Inbound
connections pass ``meshd.net.admission`` first and must authenticate within
its ``preauth_timeout``, under a small message cap until then.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio
from trio_websocket import ConnectionClosed

from meshd.net.admission import Admission, AdmissionConfig, Ticket, fd_budget, raise_fd_limit
from meshd.net.events import HandshakeFailed, LinkDown, LinkUp, Observer, PeerEvent
from meshd.net.fastconn import FastHandler, is_fast, read_token
from meshd.net.fastpunch import FastPunchAnswer
from meshd.net.link import Link, LinkTimings
from meshd.net.stream import Stream
from meshd.net.transport import (
    RecordTransport,
    UpgradeFailed,
    WebSocketTransport,
    client_websocket,
    server_websocket,
)
from meshd.net.urls import split_url, ws_url
from relay.punch import FAST_PUNCH_PROTOCOL
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.limits import DEFAULT_LIMITS, Limits, same_protocol_other_version
from wire.link import SecureLink
from wire.mux_config import HeldBudget, MuxConfig
from wire.noise import mesh_key_from_secret

log = logging.getLogger(__name__)

Handler = Callable[[Stream], Awaitable[None]]
# Dials an address that is not a WebSocket (a relay circuit): (address, expected node id) -> link.
Dialer = Callable[[str, "str | None"], Awaitable[Link]]


@dataclass(frozen=True)
class PeersConfig:
    mesh_key: bytes | None = None
    mux: MuxConfig = field(default_factory=MuxConfig)
    timings: LinkTimings = field(default_factory=LinkTimings)
    limits: Limits = DEFAULT_LIMITS
    # How long a retired or shutting-down link lets open streams finish.
    drain_timeout: float = 5.0
    # Seconds a dial has, from TCP connect to the end of the Noise handshake.
    dial_timeout: float = 5.0
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # Bytes all links together may make this node hold in unfinished messages
    # (each link also has its mux's max_held), and how long a handler waits
    # for the first whole message of a stream.
    max_held_bytes: int = 32 << 20
    first_message_timeout: float = 10.0
    # The local host outgoing dials bind to (None: the kernel's choice), on a multi-homed host.
    dial_from: str | None = None


_STAGE_TIMEOUTS = {
    "tcp": "no TCP connection to {address} within {timeout:g} s",
    "upgrade": "no WebSocket upgrade from {address} within {timeout:g} s",
    "handshake": "no Noise handshake from {address} within {timeout:g} s",
}


class Peers:
    """The node's set of peer links. Create with ``open_peers``."""

    def __init__(
        self,
        identity: NodeIdentity,
        config: PeersConfig,
        nursery: trio.Nursery,
        observer: Observer | None,
    ) -> None:
        self.identity = identity
        self.node_id = identity.node_id
        self.config = config
        self._mesh_key = None if config.mesh_key is None else mesh_key_from_secret(config.mesh_key)
        self._nursery = nursery
        self._observer = observer
        self._handlers: dict[str, tuple[Handler, bool]] = {}
        self._held = HeldBudget(config.max_held_bytes)
        self._dialers: list[tuple[Callable[[str], bool], Dialer]] = []
        self._by_node: dict[str, Link] = {}
        self._by_address: dict[str, Link] = {}
        self._dials: dict[str, trio.Event] = {}
        self._links: set[Link] = set()
        self._listeners: list[trio.CancelScope] = []
        self._admission: Admission | None = None
        # The cancel scope of each inbound connection still authenticating.
        self._preauth: dict[Ticket, trio.CancelScope] = {}
        self._closing = False
        self._fast: FastHandler | None = None
        # The host and port of the first listener: punched connections are dialed from them (meshd.relay.punch).
        self.listen_host: str | None = None
        self.listen_port: int | None = None

    # ----- serving

    def handle(self, protocol: str, handler: Handler, *, raw: bool = False) -> None:
        """Run ``handler(stream)`` for every stream a peer opens for ``protocol``.

        Unless the protocol is ``raw`` bytes, the peer's first whole message
        must arrive within ``first_message_timeout``, or the stream is reset
        (DEADLINE_EXCEEDED): a stream costs a task and a place in the mux.

        The stream is closed when the handler returns. A ``ProtocolError`` it
        raises resets the stream with that error; any other exception resets it
        with INTERNAL (and is logged), never disturbing the node.
        """
        self._handlers[protocol] = (handler, raw)

    def handle_fast(self, handler: FastHandler) -> None:
        """Give inbound fast-path connections (``meshd.net.fastconn``) to ``handler``, which has the
        pre-auth deadline to take them; without one they are closed like any failed upgrade. Those
        punched over a link (``meshd.net.fastpunch``) go to it too."""
        self._fast = handler
        self.handle(FAST_PUNCH_PROTOCOL, FastPunchAnswer(handler, self.config.admission.preauth_timeout))

    async def listen(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Accept peers on ``ws://host:port``; returns the bound port.

        The first call lifts the process's file-descriptor limit to its hard
        limit and derives from it how many inbound connections to take.
        """
        if self._admission is None:
            limit = raise_fd_limit()
            self._admission = Admission(self.config.admission, fd_budget(limit, self.config.admission))
        listeners = await trio.open_tcp_listeners(port, host=host)
        for listener in listeners:
            # Set only once bound, so the bind still fails on a port another program holds; from now on
            # this process may bind a dialing socket to the same port: a hole punch dials from the
            # listening port, so a port-preserving NAT maps it to the public port the peer dials.
            # (Another process of the same user that sets SO_REUSEPORT before binding may then share
            # the port; one of another user may not.)
            listener.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        scope = trio.CancelScope()
        self._listeners.append(scope)

        async def serve(task_status: trio.TaskStatus[None]) -> None:
            with scope:
                async with trio.open_nursery() as nursery:
                    for listener in listeners:
                        nursery.start_soon(self._accept_loop, listener)
                    task_status.started()

        await self._nursery.start(serve)
        bound: int = listeners[0].socket.getsockname()[1]
        if self.listen_port is None:
            self.listen_host, self.listen_port = listeners[0].socket.getsockname()[:2]
        return bound

    async def _accept_loop(self, listener: trio.SocketListener) -> None:
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    # Out of file descriptors or memory: the reserve is for
                    # other work, so wait for connections to end.
                    log.warning("accepting a connection failed: %s", exc)
                    await trio.sleep(0.1)
                    continue
                self._nursery.start_soon(self._accept, stream)

    async def _accept(self, stream: trio.SocketStream) -> None:
        try:
            peer = stream.socket.getpeername()
        except OSError:
            await trio.aclose_forcefully(stream)
            return
        address = f"{peer[0]}:{peer[1]}"
        admission = self._admission
        assert admission is not None
        ticket: Ticket | None
        ticket, evicted = (None, []) if self._closing else admission.admit(str(peer[0]), trio.current_time())
        for old in evicted:
            pending = self._preauth.pop(old, None)
            if pending is not None:
                pending.cancel()
        if ticket is None:
            log.debug("refused a connection from %s: too many connections", address)
            await trio.aclose_forcefully(stream)
            return
        # trio runs this in our nursery and lets exceptions through: nothing a
        # connecting peer does may take the node down.
        try:
            async with trio.open_nursery() as connection:
                link = await self._admit(connection, stream, address, ticket)
                if link is not None:
                    await self._serve(link)
                connection.cancel_scope.cancel()
        except Exception:
            log.exception("inbound connection from %s failed", address)
        finally:
            admission.release(ticket, trio.current_time())
            self._preauth.pop(ticket, None)
            await trio.aclose_forcefully(stream)

    async def _admit(
        self, connection: trio.Nursery, stream: trio.SocketStream, address: str, ticket: Ticket
    ) -> Link | None:
        """Upgrade and authenticate an inbound connection within the pre-auth
        deadline; None if it failed, timed out or was displaced."""
        assert self._admission is not None
        with trio.CancelScope() as scope:
            self._preauth[ticket] = scope
            scope.deadline = trio.current_time() + self.config.admission.preauth_timeout
            try:
                if await is_fast(stream):
                    if self._fast is not None and await self._fast(await read_token(stream), stream):
                        self._admission.handed_off(ticket)
                    return None
            except (OSError, ValueError) as exc:
                log.debug("%s: no fast-path preamble: %s", address, exc)
                return None
            try:
                ws = await server_websocket(connection, stream)
            except (UpgradeFailed, ConnectionClosed) as exc:
                log.debug("%s: no WebSocket upgrade: %s", address, exc)
                return None
            core = self._core(dialer=False, node_id=None)
            transport = WebSocketTransport(ws, address, established=lambda: core.established)
            link = await self._establish(core, transport, graceful=False)
        self._preauth.pop(ticket, None)
        if scope.cancelled_caught:
            log.debug("%s: %s", address, "displaced" if ticket.evicted else "pre-auth deadline passed")
            return None
        if link is None:
            return None
        transport.authenticated()
        if not self._admission.authenticated(ticket):
            log.info("%s: refused an authenticated link: this node takes no more", address)
            return None
        self._register(link)
        return link

    # ----- dialing

    def add_dialer(self, matches: Callable[[str], bool], dial: Dialer) -> None:
        """Have ``connect`` reach the addresses ``matches`` accepts with ``dial``
        (which typically ends in ``attach``) instead of a WebSocket."""
        self._dialers.append((matches, dial))

    async def connect(self, address: str, *, node_id: str | None = None) -> Link:
        """The link to the peer at ``address``, dialing it if there is none.

        With ``node_id``, an existing link to that node is reused, and a peer at
        ``address`` with another identity is refused (UNAUTHORIZED).
        """
        custom = next((dial for matches, dial in self._dialers if matches(address)), None)
        url = address if custom is not None else ws_url(address)
        while True:
            for known in (self._by_node.get(node_id or ""), self._by_address.get(url)):
                if known is not None and known.usable and node_id in (None, known.remote_node_id):
                    return known
            pending = self._dials.get(url)
            if pending is None:
                break
            await pending.wait()
        done = trio.Event()
        self._dials[url] = done
        try:
            if custom is not None:
                link = await custom(address, node_id)
                if link.usable:
                    self._by_address[url] = link
                return link
            dialed: Link = await self._nursery.start(self._dial, url, node_id)
            return dialed
        finally:
            del self._dials[url]
            done.set()

    async def dial_direct(self, address: str, node_id: str) -> Link:
        """A new link dialed to ``address`` (``host:port``), which must authenticate ``node_id``, even
        when a link to that node exists: a relayed one yields to it (a hole punch's reversal)."""
        link: Link = await self._nursery.start(self._dial, ws_url(address), node_id)
        return link

    async def _dial(
        self,
        url: str,
        node_id: str | None,
        task_status: trio.TaskStatus[Link] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        if self._closing:
            raise ProtocolError(ErrorCode.UNREACHABLE, "this node is shutting down")
        host, port, resource = split_url(url)
        link: Link | None = None
        error: ProtocolError | None = None
        async with trio.open_nursery() as connection:
            try:
                link = await self._dial_link(connection, url, host, port, resource, node_id)
            except ProtocolError as exc:
                error = exc
                connection.cancel_scope.cancel()
            if link is not None:
                winner = self._by_node.get(link.remote_node_id, link)
                self._by_address[url] = winner
                task_status.started(winner)
                await self._serve(link)
                connection.cancel_scope.cancel()
        if error is not None:
            raise error

    async def _dial_link(
        self,
        connection: trio.Nursery,
        url: str,
        host: str,
        port: int,
        resource: str,
        node_id: str | None,
    ) -> Link:
        """TCP, WebSocket upgrade and Noise handshake, all within ``dial_timeout``."""
        address = f"{host}:{port}"
        timeout = self.config.dial_timeout
        stage = "tcp"
        stream: trio.SocketStream | None = None
        link: Link | None = None
        failure: str | None = None
        try:
            with trio.fail_after(timeout):
                stream = await trio.open_tcp_stream(host, port, local_address=self.config.dial_from)
                stage = "upgrade"
                host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                ws = await client_websocket(connection, stream, host_header, resource)
                stage = "handshake"
                core = self._core(dialer=True, node_id=node_id)
                transport = WebSocketTransport(ws, url, established=lambda: core.established)
                link = await self._establish(core, transport, raise_errors=True)
        except trio.TooSlowError:
            failure = _STAGE_TIMEOUTS[stage].format(address=address, timeout=timeout)
        except OSError as exc:
            failure = f"cannot reach {address}: {exc.strerror or exc or type(exc).__name__}"
        except (UpgradeFailed, ConnectionClosed) as exc:
            failure = f"{address} {exc if isinstance(exc, UpgradeFailed) else 'closed the connection'}"
        except BaseException:
            if stream is not None:
                await trio.aclose_forcefully(stream)
            raise
        if failure is not None:
            if stream is not None:
                await trio.aclose_forcefully(stream)
            error = ProtocolError(ErrorCode.UNREACHABLE, failure)
            self._notify(HandshakeFailed(url, inbound=False, error=error))
            raise error
        assert link is not None
        transport.authenticated()
        self._register(link)
        return link

    async def attach(
        self, transport: RecordTransport, *, dialer: bool, node_id: str | None = None, path: str = "direct"
    ) -> Link:
        """Run a link over ``transport`` (a relay circuit, a pipe), once authenticated.

        ``dialer`` says which end this is; the two ends must disagree. The link
        lives in this ``Peers`` like any other and is returned after the
        handshake (or the link to that node that wins over it). ``path`` says how its bytes go
        (``Link.path``): a relayed link yields to any other to the same node.
        """
        link: Link = await self._nursery.start(self._attach, transport, dialer, node_id, path)
        return link

    async def _attach(
        self,
        transport: RecordTransport,
        dialer: bool,
        node_id: str | None,
        path: str,
        task_status: trio.TaskStatus[Link] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        core = self._core(dialer=dialer, node_id=node_id)
        link = await self._establish(core, transport, raise_errors=True)
        assert link is not None
        link.path = path
        self._register(link)
        task_status.started(self._by_node.get(link.remote_node_id, link))
        await self._serve(link)

    async def adopt(self, stream: trio.SocketStream, *, dialer: bool, node_id: str, path: str) -> Link:
        """Run a link over a TCP connection opened some other way (a hole punch's simultaneous open):
        the WebSocket upgrade (``dialer`` is its client) and the Noise handshake, which must
        authenticate ``node_id``, within ``dial_timeout``; UNREACHABLE if they do not. The link
        lives in this ``Peers`` like any other; returned is the one to that node that wins."""
        link: Link = await self._nursery.start(self._adopt, stream, dialer, node_id, path)
        return link

    async def _adopt(
        self,
        stream: trio.SocketStream,
        dialer: bool,
        node_id: str,
        path: str,
        task_status: trio.TaskStatus[Link] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        try:
            peer = stream.socket.getpeername()
            address = f"{peer[0]}:{peer[1]}"
        except OSError as exc:
            await trio.aclose_forcefully(stream)
            raise ProtocolError(ErrorCode.UNREACHABLE, f"the connection went: {exc}") from None
        link: Link | None = None
        failure: str | None = None
        refused: ProtocolError | None = None
        async with trio.open_nursery() as connection:
            try:
                with trio.fail_after(self.config.dial_timeout):
                    if dialer:
                        ws = await client_websocket(connection, stream, address, "/")
                    else:
                        ws = await server_websocket(connection, stream)
                    core = self._core(dialer=dialer, node_id=node_id)
                    transport = WebSocketTransport(ws, address, established=lambda: core.established)
                    link = await self._establish(core, transport, raise_errors=True)
            except trio.TooSlowError:
                failure = f"no link over the connection with {address} within {self.config.dial_timeout:g} s"
            except (OSError, UpgradeFailed, ConnectionClosed) as exc:
                failure = f"the connection with {address} failed: {exc}"
            except ProtocolError as exc:
                refused = exc  # the handshake's: raised as it is, out of this nursery
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
            if link is None:
                await trio.aclose_forcefully(stream)
                connection.cancel_scope.cancel()
            else:
                transport.authenticated()
                link.path = path
                self._register(link)
                task_status.started(self._by_node.get(link.remote_node_id, link))
                await self._serve(link)
                connection.cancel_scope.cancel()
        if refused is not None:
            raise refused
        if failure is not None:
            raise ProtocolError(ErrorCode.UNREACHABLE, failure)

    def _core(self, *, dialer: bool, node_id: str | None) -> SecureLink:
        core = SecureLink(
            self.identity,
            dialer=dialer,
            mesh_key=self._mesh_key,
            expected_node_id=node_id,
            mux_config=self.config.mux,
        )
        core.mux.node_budget = self._held
        return core

    async def _establish(
        self, core: SecureLink, transport: RecordTransport, *, raise_errors: bool = False, graceful: bool = True
    ) -> Link | None:
        """Run the handshake; the link (not yet registered), or None if it failed.

        Without ``graceful`` a failed transport is left for the caller to cut:
        an unauthenticated peer gets no close handshake (and no more reading).
        """
        link = Link(
            core,
            transport,
            timings=self.config.timings,
            limits=self.config.limits,
            on_stream=self._on_stream,
            on_goaway=self._on_goaway,
        )
        try:
            await link.handshake()
            if link.remote_node_id == self.node_id:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "dialed this node itself")
        except ProtocolError as exc:
            log.info("handshake with %s failed: %s", transport.remote_address, exc)
            self._notify(HandshakeFailed(transport.remote_address, inbound=not core.dialer, error=exc))
            if graceful:
                # Not shielded: a Ctrl-C must not wait for a peer that does not answer.
                with trio.move_on_after(self.config.timings.close_timeout):
                    try:
                        await transport.aclose()
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
            if raise_errors:
                raise
            return None
        return link

    # ----- links

    def link_to(self, node_id: str) -> Link | None:
        link = self._by_node.get(node_id)
        return link if link is not None and link.usable else None

    @property
    def links(self) -> list[Link]:
        return [link for link in self._by_node.values() if not link.closed]

    def _register(self, link: Link) -> None:
        self._links.add(link)
        node = link.remote_node_id
        current = self._by_node.get(node)
        if current is None or current.closed or current.going_away:
            self._by_node[node] = link
        elif self._prefer(link, current):
            self._by_node[node] = link
            self._retire(current)
        else:
            self._retire(link)
        self._notify(LinkUp(link))

    def _prefer(self, new: Link, current: Link) -> bool:
        """Both ends pick the same link: one not relayed over one relayed (both ends know which is a
        circuit), then the one dialed by the lower node id; between two dialed by the same node, the
        newer (the old one is stale)."""
        if (new.path == "relayed") != (current.path == "relayed"):
            return current.path == "relayed"
        lower_dialed = self.node_id if self.node_id < new.remote_node_id else new.remote_node_id

        def dialed_by(link: Link) -> str:
            return self.node_id if link.dialer else link.remote_node_id

        if dialed_by(new) == dialed_by(current):
            return True
        return dialed_by(new) == lower_dialed

    def _retire(self, link: Link) -> None:
        link.going_away = True
        self._forget(link)
        self._nursery.start_soon(
            link.aclose,
            ProtocolError(ErrorCode.UNREACHABLE, "duplicate link retired"),
            self.config.drain_timeout,
        )

    def _forget(self, link: Link) -> None:
        for table in (self._by_node, self._by_address):
            for key in [key for key, value in table.items() if value is link]:
                del table[key]

    def _on_goaway(self, link: Link) -> None:
        self._forget(link)

    async def _serve(self, link: Link) -> None:
        try:
            await link.run()
        finally:
            link.core.mux.release_held()
            self._forget(link)
            self._links.discard(link)
            error = link.error or ProtocolError(ErrorCode.UNREACHABLE, "link closed")
            self._notify(LinkDown(link, error))

    # ----- streams

    async def open_stream(
        self, address: str | None, protocol: str, *, node_id: str | None = None
    ) -> Stream:
        """Open a stream to ``protocol`` on a peer, reusing or dialing its link.

        Give ``address``, ``node_id`` or both; with only ``node_id`` there must
        already be a link to that node.
        """
        if address is None:
            if node_id is None:
                raise ValueError("open_stream needs an address or a node id")
            link = self.link_to(node_id)
            if link is None:
                raise ProtocolError(ErrorCode.UNREACHABLE, f"no link to node {node_id}")
        else:
            link = await self.connect(address, node_id=node_id)
        return link.open_stream(protocol)

    def _on_stream(self, stream: Stream) -> None:
        entry = self._handlers.get(stream.protocol)
        if entry is None:
            ours = same_protocol_other_version(stream.protocol, self._handlers)
            stream.reset(ProtocolError(ErrorCode.NOT_FOUND, f"no handler for {stream.protocol!r}") if ours is None
                         else ProtocolError(ErrorCode.VERSION_MISMATCH, f"this node speaks {ours}, not "
                                            f"{stream.protocol}: run one meshd release on every member"))
            return
        handler, raw = entry
        watch = None
        if not raw:
            watch = trio.CancelScope()
            self._nursery.start_soon(self._first_message_deadline, stream, watch)
        self._nursery.start_soon(self._run_handler, handler, stream, watch)

    async def _first_message_deadline(self, stream: Stream, watch: trio.CancelScope) -> None:
        timeout = self.config.first_message_timeout
        with watch:
            await trio.sleep(timeout)
            if not stream.messages_received:
                stream.reset(ProtocolError(ErrorCode.DEADLINE_EXCEEDED, f"no whole message within {timeout:g} s"))

    async def _run_handler(self, handler: Handler, stream: Stream, watch: trio.CancelScope | None) -> None:
        try:
            await handler(stream)
        except ProtocolError as exc:
            stream.reset(exc)
        except trio.EndOfChannel:
            pass
        except Exception:
            log.exception("handler for %r failed", stream.protocol)
            stream.reset(ProtocolError(ErrorCode.INTERNAL, "the handler failed"))
        finally:
            if watch is not None:
                watch.cancel()
            await stream.aclose()

    # ----- shutdown

    async def aclose(self, reason: str = "node shutting down") -> None:
        """Stop listening; close every link, letting open streams finish within
        ``drain_timeout``, then resetting them with ``reason``."""
        self._closing = True
        for scope in self._listeners:
            scope.cancel()
        error = ProtocolError(ErrorCode.UNREACHABLE, reason)
        async with trio.open_nursery() as nursery:
            for link in list(self._links):
                nursery.start_soon(link.aclose, error, self.config.drain_timeout)

    def _notify(self, event: PeerEvent) -> None:
        if self._observer is not None:
            try:
                self._observer(event)
            except Exception:
                log.exception("peer event observer failed on %r", event)


@asynccontextmanager
async def open_peers(
    identity: NodeIdentity,
    config: PeersConfig | None = None,
    observer: Observer | None = None,
) -> AsyncIterator[Peers]:
    """A ``Peers`` whose links and handlers live inside this context."""
    async with trio.open_nursery() as nursery:
        peers = Peers(identity, config or PeersConfig(), nursery, observer)
        try:
            yield peers
        finally:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(
                    peers.config.drain_timeout + 2 * peers.config.timings.close_timeout
                ):
                    await peers.aclose()
            nursery.cancel_scope.cancel()
