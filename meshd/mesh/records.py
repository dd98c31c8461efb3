"""Signed capability records: what a node says about itself, and the store that admits them.

A record is signed by its own node over a canonical msgpack encoding, so any
member can relay it and nobody can alter it. Its `version` is also the node's
SWIM incarnation number: a node refutes a suspicion of itself by signing a
newer record, which makes "alive" claims unforgeable. A node starting afresh
should begin at a version above any it used before (the daemon passes the
wall clock in milliseconds), so its new records supersede its old ones.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgpack
from pydantic import Field, model_validator

from wire.codec import WireModel
from wire.identity import NodeIdentity, node_id_of, verify

_SIGNING_DOMAIN = b"meshd-capability-record-v1\x00"

# Bounds on what a peer may make us hold; a record is gossiped to everyone, so it stays small.
MAX_ADDRESSES = 8
MAX_ROLES = 8
MAX_MODELS = 16
MAX_SERVED = 32
MAX_LAYERS = 4096

Reachability = Literal["public", "nat", "unknown"]

ROLE_RELAY = "relay"
# A light client (`meshd ask --seed`) joins briefly: it serves nothing and never runs for tracker.
ROLE_CLIENT = "client"

_Text = Annotated[str, Field(max_length=256)]
_Address = Annotated[str, Field(max_length=262)]  # a DNS name (253) plus ":port"
_Role = Annotated[str, Field(max_length=32)]
_Count = Annotated[int, Field(ge=0, lt=2**63)]


class ModelInfo(WireModel):
    """A model file a node holds, described by what placement needs to know."""

    digest: Annotated[str, Field(min_length=1, max_length=128)]
    name: _Text
    n_layers: Annotated[int, Field(ge=1, le=MAX_LAYERS)]
    bytes_per_layer: _Count
    # KV cache bytes one token occupies in one layer (K and V together).
    kv_bytes_per_token: _Count
    # Token embedding, owned by the head stage.
    head_bytes: _Count = 0
    # Output norm and LM head, owned by the tail stage (token_embd again when tied).
    tail_bytes: _Count = 0


class ServedRange(WireModel):
    """A half-open layer range of a model that a node has loaded and serves."""

    model: Annotated[str, Field(min_length=1, max_length=128)]
    start: Annotated[int, Field(ge=0, lt=MAX_LAYERS)]
    end: Annotated[int, Field(ge=1, le=MAX_LAYERS)]

    @model_validator(mode="after")
    def _non_empty(self) -> ServedRange:
        if self.start >= self.end:
            raise ValueError(f"empty layer range [{self.start}, {self.end})")
        return self


class CapabilityRecord(WireModel):
    """A node's signed description of itself; also its SWIM alive claim at incarnation `version`.

    A wire model (strict, closed): sequences are lists, as msgpack gives them."""

    node_id: Annotated[str, Field(min_length=1, max_length=64)]
    public_key: Annotated[bytes, Field(min_length=32, max_length=32)]
    version: _Count
    addresses: Annotated[list[_Address], Field(max_length=MAX_ADDRESSES)] = []
    reachability: Reachability = "unknown"
    relay_addresses: Annotated[list[_Address], Field(max_length=MAX_ADDRESSES)] = []
    roles: Annotated[list[_Role], Field(max_length=MAX_ROLES)] = []
    memory_bytes: _Count = 0
    # KV tokens the node keeps for its sessions (sessions x tokens each); placement counts their memory.
    kv_tokens: _Count = 0
    # Measured compute time of one layer for one decoded token; 0 until measured.
    seconds_per_layer: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.0
    models: Annotated[list[ModelInfo], Field(max_length=MAX_MODELS)] = []
    served: Annotated[list[ServedRange], Field(max_length=MAX_SERVED)] = []
    # Busy fraction of the engine (0 idle, 1 saturated, above 1 queueing).
    load: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.0
    # Unix time the node says it started; the election prefers long-lived nodes.
    started_at: Annotated[float, Field(allow_inf_nan=False)] = 0.0
    # A positive term means this node claims to be the tracker for that term.
    tracker_term: _Count = 0
    # A tracker counts the changes of its assignment here, so volunteers learn by gossip when to ask
    # for their range again instead of asking over and over.
    assignment_version: _Count = 0
    # The node's last word: it has left the mesh gracefully.
    leaving: bool = False
    signature: Annotated[bytes, Field(max_length=64)] = b""

    @classmethod
    def create(cls, identity: NodeIdentity, version: int, **fields: object) -> CapabilityRecord:
        """A new record for `identity`, signed."""
        unsigned = cls.model_validate(
            {"node_id": identity.node_id, "public_key": identity.public_key, "version": version, **fields}
        )
        return unsigned.model_copy(update={"signature": identity.sign(unsigned.signing_bytes())})

    def evolve(
        self, identity: NodeIdentity, version: int | None = None, **changes: object
    ) -> CapabilityRecord:
        """A newer version of this record (the next one unless `version` says) with `changes`, signed."""
        if identity.node_id != self.node_id:
            raise ValueError("only a record's own node can sign its next version")
        if version is None:
            version = self.version + 1
        elif version <= self.version:
            raise ValueError(f"version {version} is not newer than {self.version}")
        fields = self.model_dump(exclude={"node_id", "public_key", "version", "signature"})
        fields.update(changes)
        return CapabilityRecord.create(identity, version, **fields)

    def signing_bytes(self) -> bytes:
        # Field order is the schema's, not the sender's, so the encoding is canonical.
        body = self.model_dump(exclude={"signature"})
        packed: bytes = msgpack.packb(body, use_bin_type=True)
        return _SIGNING_DOMAIN + packed

    def verify(self) -> bool:
        """Signed by the key it names, and that key hashes to its node id."""
        if node_id_of(self.public_key) != self.node_id:
            return False
        return _verify_cached(self.public_key, self.signing_bytes(), self.signature)

    def model(self, digest: str) -> ModelInfo | None:
        return next((m for m in self.models if m.digest == digest), None)


_VERIFY_CACHE_SIZE = 8192
_verified: OrderedDict[tuple[bytes, bytes, bytes], bool] = OrderedDict()


def _verify_cached(public_key: bytes, message: bytes, signature: bytes) -> bool:
    # A record travels through many peers and a rejected one is not stored, so the same
    # bytes come back; Ed25519 verification (~60 us) dominates gossip handling otherwise.
    key = (public_key, message, signature)
    ok = _verified.get(key)
    if ok is None:
        ok = verify(public_key, message, signature)
        _verified[key] = ok
        if len(_verified) > _VERIFY_CACHE_SIZE:
            _verified.popitem(last=False)
    return ok


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
