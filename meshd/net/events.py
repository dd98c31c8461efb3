"""What ``Peers`` tells its observers: a link up, a link down, a handshake that failed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from meshd.net.link import Link
from wire.errors import ProtocolError


@dataclass(frozen=True, slots=True)
class LinkUp:
    link: Link


@dataclass(frozen=True, slots=True)
class LinkDown:
    link: Link
    error: ProtocolError


@dataclass(frozen=True, slots=True)
class HandshakeFailed:
    address: str
    inbound: bool
    error: ProtocolError


PeerEvent = LinkUp | LinkDown | HandshakeFailed
Observer = Callable[[PeerEvent], None]
