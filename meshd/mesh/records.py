"""The store that admits signed capability records: the newest valid one per node.

The record itself is a wire schema (``wire.swim.CapabilityRecord``, with its
signing): a node signs it over a canonical msgpack encoding, so any member
can relay it and nobody can alter it, and its `version` is also the node's
SWIM incarnation number. A node starting afresh should begin at a version
above any it used before (the daemon passes the wall clock in milliseconds),
so its new records supersede its old ones.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field

from relay.protocol import CIRCUIT_MARK
from wire.swim import (
    MAX_ADDRESSES,
    MAX_HELD,
    MAX_MODELS,
    MAX_ROLES,
    MAX_SERVED,
    ROLE_CLIENT,
    ROLE_RELAY,
    CapabilityRecord,
    HeldRange,
    ModelInfo,
    Reachability,
    ServedRange,
)
from wire.types import MAX_LAYERS

__all__ = [
    "MAX_ADDRESSES",
    "MAX_HELD",
    "MAX_LAYERS",
    "MAX_MODELS",
    "MAX_ROLES",
    "MAX_SERVED",
    "ROLE_CLIENT",
    "ROLE_RELAY",
    "CapabilityRecord",
    "HeldRange",
    "ModelInfo",
    "Reachability",
    "RecordStore",
    "ServedRange",
    "StoreStats",
    "Verdict",
]


# ---- addresses: which a node publishes, and which may go to which peer ------------------------


def split_address(address: str) -> tuple[str, int] | None:
    """``host:port`` or ``[v6]:port`` as (host, port); None if it is neither."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return (host, int(port)) if host else None


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_unspecified(host: str) -> bool:
    """0.0.0.0 or ``::``: a host to listen on, never one to dial."""
    ip = _ip(host)
    return ip is not None and ip.is_unspecified


def is_loopback(host: str) -> bool:
    ip = _ip(host)
    return host == "localhost" if ip is None else ip.is_loopback


def host_of(address: str) -> str:
    """The host of a peer's address as a link names it (``h:p``, ``[v6]:p`` or ``ws://h:p/``)."""
    bare = address.removeprefix("ws://").removeprefix("wss://").rstrip("/")
    parts = split_address(bare)
    return parts[0] if parts is not None else bare


def address_fits(address: str, peer_host: str) -> bool:
    """Whether ``address`` may be sent to a peer at ``peer_host``.

    It must name a host (0.0.0.0 and ``::`` name none), and a loopback one only
    to a peer on loopback too: anyone else dialling it would reach itself. A
    relay circuit fits when its relay's address does."""
    direct = address.partition(CIRCUIT_MARK)[0]
    parts = split_address(direct)
    if parts is None or is_unspecified(parts[0]):
        return False
    return not is_loopback(parts[0]) or is_loopback(peer_host)


def record_fits(record: CapabilityRecord, peer_host: str) -> bool:
    """Whether ``record`` may be sent to a peer at ``peer_host``: all its addresses fit that peer.

    A signed record cannot be trimmed on the way, so one with an address the
    peer must not be told is withheld from it whole. A record without addresses
    (a node reached only through relays, or not yet knowing its address) fits."""
    return all(address_fits(a, peer_host) for a in (*record.addresses, *record.relay_addresses))


class Verdict(str, enum.Enum):
    ACCEPTED = "accepted"
    FORGED = "forged"  # bad signature, or the node id does not match the key
    STALE = "stale"  # older than the version held: a replay of an old record
    DUPLICATE = "duplicate"  # the version held, arriving again through another peer


# Enum attribute access is slow and offer() runs for every record gossip brings.
_ACCEPTED, _FORGED, _STALE, _DUPLICATE = Verdict.ACCEPTED, Verdict.FORGED, Verdict.STALE, Verdict.DUPLICATE


@dataclass
class StoreStats:
    accepted: int = 0
    forged: int = 0
    stale: int = 0
    duplicate: int = 0


@dataclass
class RecordStore:
    """The newest valid record per node. Versions outlive forgotten records, so a replay stays stale."""

    _records: dict[str, CapabilityRecord] = field(default_factory=dict)
    _versions: dict[str, int] = field(default_factory=dict)
    stats: StoreStats = field(default_factory=StoreStats)

    def offer(self, record: CapabilityRecord) -> Verdict:
        held = self._versions.get(record.node_id)
        # Version first: duplicates and replays are the common case and cost no signature check.
        if held is not None and record.version <= held:
            if record.version == held:
                self.stats.duplicate += 1
                return _DUPLICATE
            self.stats.stale += 1
            return _STALE
        if not record.verify():
            self.stats.forged += 1
            return _FORGED
        self.stats.accepted += 1
        self._records[record.node_id] = record
        self._versions[record.node_id] = record.version
        return _ACCEPTED

    @property
    def versions(self) -> Mapping[str, int]:
        """The version held per node (kept after its record is forgotten), read-only."""
        return self._versions

    def get(self, node_id: str) -> CapabilityRecord | None:
        return self._records.get(node_id)

    def version(self, node_id: str) -> int | None:
        return self._versions.get(node_id)

    def forget(self, node_id: str) -> None:
        """Drop the record but remember its version."""
        self._records.pop(node_id, None)
