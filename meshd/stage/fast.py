"""The fast path's door on a node: fast-path connections matched to the sessions expecting them.

A stage that gets a ``Hop`` with a ``FastOffer`` expects one connection with
the offer's token; the node's listener hands every connection that starts
with a fast-link preamble to ``FastDoor.accept`` (``Peers.handle_fast``),
which gives it to the session that expects it, once, and answers ACCEPTED.
One door serves all of a node's stage services (a member may serve a range
while it retires another).
"""

from __future__ import annotations

import secrets
import socket
from dataclasses import dataclass, field

import trio

from meshd.net.fastconn import detach
from wire.fastlink import ACCEPTED, KEY_BYTES, TOKEN_BYTES
from wire.stage import FastOffer


def new_offer() -> FastOffer:
    return FastOffer(token=secrets.token_bytes(TOKEN_BYTES), key=secrets.token_bytes(KEY_BYTES))


@dataclass(eq=False)
class Expected:
    """A connection a session waits for, and (once it came) the socket for its worker."""

    arrived: trio.Event = field(default_factory=trio.Event)
    sock: socket.socket | None = None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class FastDoor:
    def __init__(self) -> None:
        self._waiting: dict[bytes, Expected] = {}
        self._changed = trio.Event()

    def expect(self, token: bytes) -> Expected:
        expected = Expected()
        self._waiting[token] = expected
        self._changed.set()
        self._changed = trio.Event()
        return expected

    def forget(self, token: bytes) -> None:
        expected = self._waiting.pop(token, None)
        if expected is not None:
            expected.close()

    async def accept(self, token: bytes, stream: trio.SocketStream) -> bool:
        """Gives the connection to the session expecting ``token`` (its Hop may still be on the
        way: the listener's pre-auth deadline bounds the wait); False if none does."""
        while (expected := self._waiting.get(token)) is None:
            await self._changed.wait()
        # single use: a second connection with the same token finds no one
        del self._waiting[token]
        await stream.send_all(ACCEPTED)
        expected.sock = detach(stream)
        expected.arrived.set()
        return True
