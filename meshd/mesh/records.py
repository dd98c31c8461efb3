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
from dataclasses import dataclass, field

from wire.swim import (
    MAX_ADDRESSES,
    MAX_MODELS,
    MAX_ROLES,
    MAX_SERVED,
    ROLE_CLIENT,
    ROLE_RELAY,
    CapabilityRecord,
    ModelInfo,
    Reachability,
    ServedRange,
)
from wire.types import MAX_LAYERS

__all__ = [
    "MAX_ADDRESSES",
    "MAX_LAYERS",
    "MAX_MODELS",
    "MAX_ROLES",
    "MAX_SERVED",
    "ROLE_CLIENT",
    "ROLE_RELAY",
    "CapabilityRecord",
    "ModelInfo",
    "Reachability",
    "RecordStore",
    "ServedRange",
    "StoreStats",
    "Verdict",
]


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

    def get(self, node_id: str) -> CapabilityRecord | None:
        return self._records.get(node_id)

    def version(self, node_id: str) -> int | None:
        return self._versions.get(node_id)

    def forget(self, node_id: str) -> None:
        """Drop the record but remember its version."""
        self._records.pop(node_id, None)
