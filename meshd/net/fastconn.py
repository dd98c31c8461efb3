"""Fast-path connections (``wire.fastlink``): dialled and accepted by daemons, then handed to workers.

The upstream daemon dials the downstream's listening address (the one its
Noise link takes, so an emulated or real network hop lies on it too) and sends
the preamble with the session's single-use token; its worker gets a socket of
its own on the connection (``detach``) and may write at once, and the daemon
then waits for ``ACCEPTED`` (``accepted``). The downstream's listener
(``Peers``) tells the preamble from a WebSocket upgrade by peeking at the
first byte, under the same pre-auth admission and deadline as any inbound
connection, and gives the token and connection to the handler the stage
service registered (``Peers.handle_fast``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable

import trio

from wire.errors import ErrorCode, ProtocolError
from wire.fastlink import ACCEPTED, MAGIC, PREAMBLE_BYTES, preamble, read_preamble

# (token, the connection past its preamble) -> whether the token was taken (then the handler has
# answered ACCEPTED and taken its own copy of the socket)
FastHandler = Callable[[bytes, trio.SocketStream], Awaitable[bool]]


async def is_fast(stream: trio.SocketStream) -> bool:
    """Whether the connection starts as a fast-link preamble does, by its first byte (peeked, so nothing
    is consumed): a WebSocket upgrade starts "GET". One byte, so a stranger that sends a part of the
    magic and stalls is waited on like any other, not polled."""
    return bool(await stream.socket.recv(1, socket.MSG_PEEK) == MAGIC[:1])


async def read_token(stream: trio.SocketStream) -> bytes:
    """The preamble's token, read exactly (nothing past it); ValueError if it is no preamble."""
    data = b""
    while len(data) < PREAMBLE_BYTES:
        chunk = await stream.socket.recv(PREAMBLE_BYTES - len(data))
        if not chunk:
            raise ValueError("the connection closed inside its preamble")
        data += chunk
    return read_preamble(data)


def detach(stream: trio.SocketStream) -> socket.socket:
    """A blocking socket of the caller's own on the connection (the stream may then be closed)."""
    sock = socket.socket(fileno=os.dup(stream.socket.fileno()))
    sock.setblocking(True)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


async def dial_fast(host: str, port: int, token: bytes, timeout: float) -> trio.SocketStream:
    """A connection to ``host:port`` that has sent the preamble for ``token``.

    Its worker may write at once (the far daemon hands the connection on with what
    came after the preamble); ``accepted`` says whether the far daemon took it.
    """
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_tcp_stream(host, port)
            try:
                await stream.send_all(preamble(token))
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
            return stream
    except (OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
        raise _unreachable(f"{host}:{port}", exc) from None


async def accepted(stream: trio.SocketStream, address: str, timeout: float) -> None:
    """Returns once the far daemon (at ``address``) has answered ACCEPTED; UNREACHABLE if it refused or
    never did."""
    try:
        with trio.fail_after(timeout):
            answer = await stream.receive_some(len(ACCEPTED))
    except (OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
        raise _unreachable(address, exc) from None
    if answer != ACCEPTED:
        raise ProtocolError(ErrorCode.UNREACHABLE, f"{address} refused the fast-path connection")


def _unreachable(address: str, exc: BaseException) -> ProtocolError:
    return ProtocolError(ErrorCode.UNREACHABLE, f"no fast-path connection to {address}: {exc or 'timed out'}")
