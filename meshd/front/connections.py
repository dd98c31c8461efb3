"""The front door's connections, bounded: how many are open at once (in all, and from one source),
and how long one may keep the server waiting to send.

Hypercorn's trio server accepts every connection it is offered and sends with no deadline (its
send is shielded from cancellation), and each socket is an fd of the mesh daemon's process: a
client that opened sockets and never used or read them could take every fd the daemon has. So
the listener Hypercorn serves admits a connection only within the caps. When the front door is
full, a newcomer takes the place of an idle connection (no request running on it: a keep-alive
socket, or one whose request head has not all come) of the source that holds the most, if that
source holds more than the newcomer's: HTTP lets a server close an idle connection at any time (a
client opens another), and the lone client is served while the crowd waits its turn. Otherwise, or
at its source's own cap, the newcomer is closed at once, unread. Idle connections also end on
their own after Hypercorn's keep-alive timeout (server.KEEP_ALIVE_SECONDS).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio

from meshd.mesh.addresses import source_group

log = logging.getLogger(__name__)

# Open connections in all: each is an fd and a task of the daemon, which needs its fds for the mesh
# (links, engine workers, model files) too; a few hundred serve MAX_ASKS streams and their viewers.
MAX_CONNECTIONS = 512
# Open connections from one source: one machine running door.MAX_ASKS streams at once, plus its
# clients' idle keep-alive pools; beyond that one source only crowds out the others.
MAX_PER_SOURCE = 128
# A send the client does not take in this long ends its connection: a client that stops reading
# holds a task, an fd and the answer's buffers, and Hypercorn's own send never gives up.
SEND_SECONDS = 30.0

Peer = tuple[str, int]


@dataclass(eq=False)
class Connection:
    peer: Peer
    source: str
    # closes the socket at once (a task waiting on it wakes with ClosedResourceError)
    close: Callable[[], None]
    # requests running on it: not idle while any does
    busy: int = 0


class Connections:
    """The open connections by peer and by source (oldest first), and what the caps did."""

    def __init__(self, limit: int = MAX_CONNECTIONS, per_source: int = MAX_PER_SOURCE) -> None:
        self.limit = limit
        self.per_source = per_source
        self._open: dict[Peer, Connection] = {}
        # each source's connections in the order they opened (dicts keep insertion order)
        self._sources: dict[str, dict[Peer, Connection]] = {}
        self.refused = 0
        self.evicted = 0
        self.send_timeouts = 0

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, peer: Peer, close: Callable[[], None]) -> Connection | None:
        """The newcomer's record, once there is room for it (an idle connection of a source holding
        more closed to make it); None: it is to be closed, its source holding its share or more."""
        source = source_group(peer[0])
        held = len(self._sources.get(source, {}))
        if held >= self.per_source or (len(self._open) >= self.limit and not self._evict_above(held)):
            # closed before Hypercorn sees it: a refusal costs an accept and a close, so a flood of
            # connections is turned away at the rate the kernel hands them over
            self.refused += 1
            return None
        connection = Connection(peer, source, close)
        self._open[peer] = connection
        self._sources.setdefault(source, {})[peer] = connection
        return connection

    def find(self, peer: Peer) -> Connection | None:
        return self._open.get(peer)

    def drop(self, connection: Connection) -> None:
        """Forgets a connection that ended (once; a second call does nothing)."""
        if self._open.get(connection.peer) is not connection:
            return
        del self._open[connection.peer]
        own = self._sources[connection.source]
        del own[connection.peer]
        if not own:
            del self._sources[connection.source]

    def _evict_above(self, held: int) -> bool:
        """Closes the oldest idle connection of the source holding the most, of those holding more
        than `held`: whether one was closed."""
        for conns in sorted(self._sources.values(), key=len, reverse=True):
            if len(conns) <= held:
                return False
            for connection in conns.values():
                if connection.busy == 0:
                    connection.close()
                    self.drop(connection)
                    self.evicted += 1
                    return True
        return False


class BoundedStream(trio.abc.HalfCloseableStream):
    """A socket stream of an admitted connection: sends under SEND_SECONDS, its record dropped when closed.

    Hypercorn's TCPServer reads `.socket` (for the addresses) and tells a plain stream from TLS by
    its lacking `do_handshake`; everything else is the stream interface."""

    def __init__(self, stream: trio.SocketStream, connection: Connection, book: Connections,
                 send_seconds: float = SEND_SECONDS) -> None:
        self._stream = stream
        self._connection = connection
        self._book = book
        self._send_seconds = send_seconds

    @property
    def socket(self) -> trio.socket.SocketType:
        return self._stream.socket

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with trio.move_on_after(self._send_seconds):
            await self._stream.send_all(data)
            return
        self._book.send_timeouts += 1
        self._stream.socket.close()
        self._book.drop(self._connection)
        raise trio.BrokenResourceError(f"the client took nothing sent for {self._send_seconds:g} s")

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self._stream.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    async def aclose(self) -> None:
        self._book.drop(self._connection)
        await self._stream.aclose()


class CappedListener(trio.abc.Listener[BoundedStream]):
    """A socket listener that hands on only the connections `book` admits."""

    def __init__(self, listener: trio.SocketListener, book: Connections) -> None:
        self._listener = listener
        self._book = book

    async def accept(self) -> BoundedStream:
        while True:
            stream = await self._listener.accept()
            try:
                host, port = stream.socket.getpeername()[:2]
            except OSError:
                # gone before it was looked at
                stream.socket.close()
                continue
            connection = self._book.admit((host, port), stream.socket.close)
            if connection is not None:
                return BoundedStream(stream, connection, self._book)
            stream.socket.close()
            log.debug("refused a connection from %s: its source holds its share of the connections", host)

    async def aclose(self) -> None:
        await self._listener.aclose()
