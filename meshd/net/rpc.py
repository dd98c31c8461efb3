"""Request and reply on a stream: the one place that reads a peer's answer.

Every exchange in meshd has the same shape: send a message, read one back, and
raise the typed error the peer sent (an ``ErrorMessage``) instead of returning
it. A reply of another type than the one asked for, a stream the peer ends
without answering, and a deadline that passes are typed ``ProtocolError``s
too, so a caller handles every failure of an exchange with one
``except ProtocolError``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import trio

from meshd.net.peers import Peers
from meshd.net.stream import Stream
from wire.errors import ErrorCode, ProtocolError
from wire.meshrpc import MESH_PROTOCOL
from wire.message import ErrorMessage, Message, error_from_message, error_message

R = TypeVar("R", bound=Message)


def expect(message: Message, expected: type[R], what: str) -> R:
    """``message`` as an ``expected``; the peer's typed error raised; any other type refused.

    ``what`` names the exchange in the error (``"the relay's answer to reserve"``).
    """
    if isinstance(message, ErrorMessage) and expected is not ErrorMessage:
        raise error_from_message(message)
    if isinstance(message, expected):
        return message
    raise ProtocolError(
        ErrorCode.BAD_REQUEST, f"{what}: expected {_tag(expected)}, got {message.type!r}"
    )


async def receive(stream: Stream, expected: type[R], what: str, timeout: float | None = None) -> R:
    """The next message on ``stream``, checked by ``expect``, within ``timeout`` seconds.

    A stream that ends before the message is UNREACHABLE, as a lost link is
    (the peer went away mid-exchange; asking again, maybe elsewhere, can
    help); a timeout is DEADLINE_EXCEEDED.
    """
    with within(timeout, what):
        try:
            message = await stream.receive_message()
        except trio.EndOfChannel:
            raise ProtocolError(
                ErrorCode.UNREACHABLE, f"{what}: the peer ended the stream without answering"
            ) from None
    return expect(message, expected, what)


async def request(
    stream: Stream, message: Message, expected: type[R], what: str, timeout: float | None = None
) -> R:
    """Send ``message`` on ``stream`` and ``receive`` its reply, both within ``timeout``."""
    with within(timeout, what):
        await stream.send_message(message)
        reply = await receive(stream, expected, what)
    return reply


async def call(
    peers: Peers,
    address: str | None,
    protocol: str,
    message: Message,
    expected: type[R],
    *,
    node_id: str | None = None,
    timeout: float,
) -> R:
    """One ``request`` on a fresh stream to ``protocol`` at a peer, closed afterwards.

    The deadline covers dialing too. ``address`` and ``node_id`` are as for
    ``Peers.open_stream``.
    """
    what = f"{_tag(type(message))} to {address or (node_id or '?')[:16]}"
    with within(timeout, what):
        stream = await peers.open_stream(address, protocol, node_id=node_id)
        async with stream:
            reply = await request(stream, message, expected, what)
    return reply


async def mesh_rpc(peers: Peers, address: str | None, request: Message, node_id: str | None = None,
                   timeout: float = 5.0) -> Message:
    """One mesh request (``wire.meshrpc``) on a fresh stream, one reply of whatever type it is; a typed
    error reply is raised."""
    return await call(peers, address, MESH_PROTOCOL, request, Message, node_id=node_id, timeout=timeout)


async def answer_typed(stream: Stream, serve: Callable[[Stream, Message], Awaitable[None]]) -> None:
    """The serving side: reads a stream's first message and serves it; a refusal is a typed error
    message, then the end."""
    try:
        await serve(stream, await stream.receive_message())
    except ProtocolError as exc:
        try:
            await stream.send_message(error_message(exc))
        except ProtocolError:
            pass


@contextmanager
def within(timeout: float | None, what: str) -> Iterator[None]:
    """A deadline ``timeout`` seconds from now (None: none) that ends in
    DEADLINE_EXCEEDED naming ``what``: only this scope's own timeout becomes
    that error, never an enclosing one's (which stays a cancellation)."""
    if timeout is None:
        yield
        return
    with trio.move_on_after(timeout) as scope:
        yield
    if scope.cancelled_caught:
        raise ProtocolError(ErrorCode.DEADLINE_EXCEEDED, f"{what}: timed out after {timeout:g} s")


def _tag(cls: type[Message]) -> str:
    field = cls.model_fields.get("type")
    return repr(field.default) if field is not None and isinstance(field.default, str) else cls.__name__
