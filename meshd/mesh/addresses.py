"""Which addresses a node publishes and tells whom (sans-IO): the address a seed observed it at, and
the records a peer may be told (`meshd.mesh.records.record_fits`: no loopback address beyond loopback)."""

from __future__ import annotations

import ipaddress
import socket

from meshd.mesh.membership import Ack, Alive, Gossip, Ping, PingReq, Sync
from meshd.mesh.records import address_fits, join_address, record_fits
from wire.message import Message

# One IPv6 source is its /64 (``source_group``)
IPV6_SOURCE_PREFIX = 64


def source_group(host: str) -> str:
    """What per-source counts count (a stage's sessions, the front door's connections, a holder's
    fetch streams): an IPv4 address, or the /64 of an IPv6 one.

    One IPv6 host is routinely given a whole /64 (SLAAC, privacy addresses) and can
    source from any of its 2**64 addresses, so counting IPv6 addresses one by one
    would give one machine any number of "sources". A host that is not an IP address
    (a name, "", a relayed circuit's source node) counts as itself."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, IPV6_SOURCE_PREFIX), strict=False))
    return str(ip)


def is_ip(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    except OSError:
        return False
    return True


def observed_address(observed: str, port: int, seed_host: str) -> str | None:
    """The address a seed says it sees this node at, with the listening port, if it is one to publish:
    an IP (not 0.0.0.0 or ::), and loopback only from a seed that is on loopback itself."""
    if not is_ip(observed):
        return None
    address = join_address(observed, port)
    return address if address_fits(address, seed_host) else None


_GOSSIPING = (Ping, Ack, PingReq, Gossip)


def fit_for_peer(message: Message, peer_host: str) -> Message:
    """`message` without the records that a peer at `peer_host` must not be told (see `record_fits`)."""
    if isinstance(message, Sync):
        entries = [entry for entry in message.entries if record_fits(entry.record, peer_host)]
        if len(entries) == len(message.entries):
            return message
        return message.model_copy(update={"entries": entries})
    if isinstance(message, _GOSSIPING):
        gossip = [u for u in message.gossip if not isinstance(u, Alive) or record_fits(u.record, peer_host)]
        if len(gossip) == len(message.gossip):
            return message
        return message.model_copy(update={"gossip": gossip})
    return message
