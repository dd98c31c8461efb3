"""Peer addresses: ``host:port`` or ``ws://host:port[/]``, the WebSocket URL a link dials."""

from __future__ import annotations

from urllib.parse import urlsplit

from wire.errors import ErrorCode, ProtocolError


def ws_url(address: str) -> str:
    """``host:port`` or ``ws://host:port[/]`` as a WebSocket URL."""
    if address.startswith(("ws://", "wss://")):
        return address
    if ":" not in address:
        raise ValueError(f"address {address!r} needs a port (host:port)")
    return f"ws://{address}/"


def split_url(url: str) -> tuple[str, int, str]:
    parts = urlsplit(url)
    if parts.scheme != "ws" or not parts.hostname:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"cannot dial {url!r}: only ws://host:port is supported")
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"cannot dial {url!r}: it needs a port")
    return parts.hostname, port, parts.path or "/"


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` as its host and port; BAD_REQUEST for anything else."""
    try:
        host, port, _ = split_url(ws_url(address))
    except ValueError as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
    return host, port
