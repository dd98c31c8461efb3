"""The SWIM protocol's messages, and the signed capability record they gossip.

A record is signed by its own node over a canonical msgpack encoding, so any
member can relay it and nobody can alter it. Its ``version`` is also the
node's SWIM incarnation number: a node refutes a suspicion of itself by
signing a newer record, which makes "alive" claims unforgeable. The state
machine that sends and receives these is ``meshd.mesh.membership``; the store
that admits records is ``meshd.mesh.records``.
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from collections import OrderedDict
from typing import Annotated, Literal, Self

import msgpack
from pydantic import Field, model_validator

from wire.identity import NodeIdentity, node_id_of, verify
from wire.limits import Limits, register_protocol
from wire.message import Message, WireModel
from wire.types import MAX_LAYERS, MAX_NODE_ID_LEN, Address, Count, Digest, Label, LayerCount, NodeId, Seconds, Text

SWIM_PROTOCOL = "meshd/swim/1"

MAX_UPDATES_PER_MESSAGE = 64
MAX_SYNC_ENTRIES = 16384

# A record is some 60 msgpack objects and a few hundred bytes, plus one per layer
# of each model it holds: a push-pull of 4 MiB and 2**17 objects holds some
# 1,000 members of a 60-layer model; probes and gossip are far smaller.
register_protocol(SWIM_PROTOCOL, Limits(max_message_bytes=4 << 20, max_objects=1 << 17, max_depth=8))

# ---- capability records -------------------------------------------------------------------------

_SIGNING_DOMAIN = b"meshd-capability-record-v1\x00"

# Bounds on what a peer may make us hold; a record is gossiped to everyone, so it stays small.
MAX_ADDRESSES = 8
MAX_ROLES = 8
MAX_MODELS = 16
MAX_SERVED = 32
# Layer ranges whose bytes a node keeps on disk for fetchers (a whole file is one range per model).
MAX_HELD = 32

Reachability = Literal["public", "nat", "unknown"]

ROLE_RELAY = "relay"
# A light client (`meshd ask --seed`) joins briefly: it serves nothing and never runs for tracker.
ROLE_CLIENT = "client"


class ModelInfo(WireModel):
    """A model a node can serve (it holds the file, or fetches its range of it from the others),
    described by what placement needs to know."""

    # The model id: the hash of the GGUF's manifest (meshd.store.manifest), not of the whole file.
    digest: Digest
    # The GGUF's own `general.name` ("Smollm2 135M 8k Lc100K Mix1 Ep2"), else the file's stem.
    name: Text
    n_layers: LayerCount
    # The largest layer's weight bytes (every layer's, where `layer_bytes` is empty).
    bytes_per_layer: Count
    # KV cache bytes one token occupies in one layer (K and V together).
    kv_bytes_per_token: Count
    # Token embedding, owned by the head stage.
    head_bytes: Count = 0
    # Output norm and LM head, owned by the tail stage (token_embd again when tied).
    tail_bytes: Count = 0
    # The node holds the whole file; if not, it fetches the range it is assigned from the members
    # that hold it, and the record's `holds` says what it has so far.
    whole: bool = True
    # Weight bytes of each layer, from the file's tensors (MoE layers outweigh dense ones many times).
    layer_bytes: Annotated[list[Count], Field(max_length=MAX_LAYERS)] = []
    # The layers a chain may be cut just before, ascending, from the file (glm-dsa's shared-indexer
    # layers reuse the top-k of the layer before them, so a stage may start only at a full-indexer
    # one); None: any layer. The engine refuses any other cut at load.
    cuts: Annotated[list[LayerCount], Field(max_length=MAX_LAYERS)] | None = None
    # The file's name less `.gguf` (a split set's less its part numbers), the name its user knows it
    # by, for `general.name` is whatever its converter wrote; "": none told (a record of an older node).
    file: Text = ""
    # Where a node that holds no file fetches what no member holds: the hub file of the model
    # ("hf:ORG/REPO@COMMIT", meshd.fetch.hub); "": members only. Any layer of a model some live member
    # names a hub for can be fetched, so placement does not wait for a member to hold it on disk.
    hub: Text = ""

    def known_as(self, wanted: str) -> bool:
        """Whether `wanted` is one of this model's names: the GGUF's own or its file's."""
        return wanted in (self.name, self.file) and wanted != ""

    @model_validator(mode="after")
    def _one_size_per_layer(self) -> ModelInfo:
        if self.layer_bytes and len(self.layer_bytes) != self.n_layers:
            raise ValueError(f"{len(self.layer_bytes)} layer sizes for {self.n_layers} layers")
        if self.layer_bytes and max(self.layer_bytes) != self.bytes_per_layer:
            raise ValueError("bytes_per_layer is not the largest of the layer sizes")
        if self.cuts is not None:
            if any(not 0 < cut < self.n_layers for cut in self.cuts):
                raise ValueError(f"a cut outside the {self.n_layers} layers' inner boundaries 1..{self.n_layers - 1}")
            if any(a >= b for a, b in zip(self.cuts, self.cuts[1:], strict=False)):
                raise ValueError("the cuts are not strictly increasing")
        return self


class ServedRange(WireModel):
    """A half-open layer range of a model that a node has loaded and serves."""

    model: Digest
    start: Annotated[int, Field(ge=0, lt=MAX_LAYERS)]
    end: LayerCount

    @model_validator(mode="after")
    def _non_empty(self) -> ServedRange:
        if self.start >= self.end:
            raise ValueError(f"empty layer range [{self.start}, {self.end})")
        return self


class HeldRange(ServedRange):
    """Layers of a model whose tensors (and the GGUF header) a node holds on disk and serves to
    members that fetch them: a whole file is [0, n_layers); a fetched range is what it fetched."""


_PLACEMENT_DOMAIN = b"meshd-placement-v1\x00"


class Placement(WireModel):
    """The tracker's signed word that it placed `node_id` on layers [start, end) of `model` in its
    term `term`. The tracker gives it with each assignment and the volunteer carries it in its own
    record, so any member can tell a placed member from an identity that merely says it serves: only
    the placed ones weigh in elections and witness proofs (meshd.mesh.authority). The tracker's key
    rides along, so the placement can be checked after the tracker is gone."""

    tracker: NodeId
    tracker_key: Annotated[bytes, Field(min_length=32, max_length=32)]
    term: Count
    node_id: NodeId
    model: Digest
    start: Annotated[int, Field(ge=0, lt=MAX_LAYERS)]
    end: LayerCount
    signature: Annotated[bytes, Field(max_length=64)] = b""

    @model_validator(mode="after")
    def _non_empty(self) -> Placement:
        if self.start >= self.end:
            raise ValueError(f"empty layer range [{self.start}, {self.end})")
        return self

    @classmethod
    def create(cls, identity: NodeIdentity, term: int, node_id: str, model: str, start: int, end: int) -> Placement:
        """`identity` (the tracker) places `node_id` on [start, end) of `model`, signed."""
        unsigned = cls(tracker=identity.node_id, tracker_key=identity.public_key, term=term, node_id=node_id,
                       model=model, start=start, end=end)
        return unsigned.model_copy(update={"signature": identity.sign(unsigned.signing_bytes())})

    def signing_bytes(self) -> bytes:
        packed: bytes = msgpack.packb(self.model_dump(exclude={"signature"}), use_bin_type=True)
        return _PLACEMENT_DOMAIN + packed

    def verify(self) -> bool:
        """Signed by the key it names, and that key hashes to the tracker's node id."""
        return _checked_once(self, self.tracker, self.tracker_key, self.signature)


class CapabilityRecord(WireModel):
    """A node's signed description of itself; also its SWIM alive claim at incarnation `version`.

    A wire model (strict, closed): sequences are lists, as msgpack gives them."""

    node_id: NodeId
    public_key: Annotated[bytes, Field(min_length=32, max_length=32)]
    version: Count
    addresses: Annotated[list[Address], Field(max_length=MAX_ADDRESSES)] = []
    reachability: Reachability = "unknown"
    relay_addresses: Annotated[list[Address], Field(max_length=MAX_ADDRESSES)] = []
    roles: Annotated[list[Label], Field(max_length=MAX_ROLES)] = []
    memory_bytes: Count = 0
    # GPU memory the node offers, and how many layers of its range it offloads there (counted from
    # the range's end, the output head at the tail one more; -1: all of them).
    gpu_memory_bytes: Count = 0
    gpu_layers: Annotated[int, Field(ge=-1, le=MAX_LAYERS + 1)] = 0
    # KV tokens the node keeps for its sessions (sessions x tokens each); placement counts their memory.
    kv_tokens: Count = 0
    # Measured compute time of one layer for one decoded token; 0 until measured.
    seconds_per_layer: Seconds = 0.0
    # The numerics its stages compute with (engine build, machine, backend: meshd.engine.native);
    # a spot check compares bytes only within one, so routes name replicas of the stage's ("": unsaid)
    numerics: Text = ""
    # What its stage put on a GPU and where (meshd.engine RangeReport.offloaded), for `meshd status`
    # and the console: "layers [3, 6) on Vulkan0 (llvmpipe ...), 12.0 MiB"; "" where nothing is.
    offload: Text = ""
    models: Annotated[list[ModelInfo], Field(max_length=MAX_MODELS)] = []
    served: Annotated[list[ServedRange], Field(max_length=MAX_SERVED)] = []
    # What fetchers may ask this node for (meshd.fetch): the sources of each model's layers.
    holds: Annotated[list[HeldRange], Field(max_length=MAX_HELD)] = []
    # Busy fraction of the engine (0 idle, 1 saturated, above 1 queueing).
    load: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.0
    # Unix time the node says it started; the election prefers long-lived nodes.
    started_at: Annotated[float, Field(allow_inf_nan=False)] = 0.0
    # A positive term means this node claims to be the tracker for that term.
    tracker_term: Count = 0
    # This node's vote in the tracker election: the claim (term, candidate) it backs; 0: none.
    # A claim is the tracker only once the votes of a majority of live members name it.
    vote_term: Count = 0
    vote_for: Annotated[str, Field(max_length=MAX_NODE_ID_LEN)] = ""
    # A tracker counts the changes of its assignment here, so volunteers learn by gossip when to ask
    # for their range again instead of asking over and over.
    assignment_version: Count = 0
    # The tracker's signed placement of this node (a volunteer's range), as the tracker gave it.
    placement: Placement | None = None
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
        return _checked_once(self, self.node_id, self.public_key, self.signature)

    def model(self, digest: str) -> ModelInfo | None:
        return next((m for m in self.models if m.digest == digest), None)


_VERIFY_CACHE_SIZE = 8192
# keyed by a digest of what was checked, not by the bytes: a record's signed bytes are about 1.1 KB, and
# keyed by them a full cache held ~10 MiB, which took hours of gossip to fill (the soak's seed, relay and
# API member grew 0.2-0.35 MiB a minute for its whole hour); by digest it holds ~1.2 MiB (measured)
_verified: OrderedDict[bytes, bool] = OrderedDict()


# The answer of `verify` per live record or placement, by id: one checked again (a placement each time
# the election weighs its member, a record passed on by reference: a node's own, one object held by
# the many nodes of a simulation) is not re-encoded and hashed again (~40 us). Both are frozen, so
# their fields cannot change under the answer; an entry goes with its instance.
_checked: dict[int, tuple[weakref.ref[WireModel], bool]] = {}


def _checked_once(signed: Placement | CapabilityRecord, node_id: str, public_key: bytes, signature: bytes) -> bool:
    """``signed`` is signed by ``public_key``, which hashes to ``node_id``: answered once per instance."""
    key = id(signed)
    checked = _checked.get(key)
    if checked is not None and checked[0]() is signed:
        return checked[1]
    ok = node_id_of(public_key) == node_id and _verify_cached(public_key, signed.signing_bytes(), signature)
    _checked[key] = (weakref.ref(signed, functools.partial(_forget_check, key)), ok)
    return ok


def _forget_check(key: int, gone: weakref.ref[WireModel]) -> None:
    checked = _checked.get(key)
    if checked is not None and checked[0] is gone:
        del _checked[key]


def _checked_key(public_key: bytes, message: bytes, signature: bytes) -> bytes:
    """The cache's key for one check: each part's length goes in before it, so no other (key, message,
    signature) hashes the bytes of a verified one (a signature a byte shorter, a key a byte longer)."""
    digest = hashlib.blake2b(digest_size=32)
    for part in (public_key, signature, message):
        digest.update(len(part).to_bytes(4, "big"))
        digest.update(part)
    return digest.digest()


def _verify_cached(public_key: bytes, message: bytes, signature: bytes) -> bool:
    # A record travels through many peers and a rejected one is not stored, so the same
    # bytes come back; Ed25519 verification (~60 us) dominates gossip handling otherwise
    # (the key, a BLAKE2b of a record's bytes, costs about 1/50 of a verification).
    key = _checked_key(public_key, message, signature)
    ok = _verified.get(key)
    if ok is None:
        ok = verify(public_key, message, signature)
        _verified[key] = ok
        if len(_verified) > _VERIFY_CACHE_SIZE:
            _verified.popitem(last=False)
    return ok


# ---- SWIM messages ------------------------------------------------------------------------------


class Alive(WireModel):
    """A member's signed record: it is alive at incarnation `record.version` (or left, if it says so)."""

    kind: Literal["alive"] = "alive"
    record: CapabilityRecord


_ACCUSATION_DOMAIN = b"meshd-accusation-v1\x00"


class _Accusation(WireModel):
    """An accusation about `node` at `incarnation`, signed by its `accuser`, so that whoever passes
    it on cannot pass off its own accusations as others' (Lifeguard counts accusers)."""

    node: NodeId
    incarnation: Count
    accuser: NodeId
    signature: Annotated[bytes, Field(max_length=64)] = b""

    def signing_bytes(self) -> bytes:
        body = [self.model_dump()["kind"], self.node, self.incarnation, self.accuser]
        packed: bytes = msgpack.packb(body, use_bin_type=True)
        return _ACCUSATION_DOMAIN + packed

    def signed(self, identity: NodeIdentity) -> Self:
        """This accusation signed by `identity`, which must be its accuser."""
        if identity.node_id != self.accuser:
            raise ValueError("only the accuser can sign its accusation")
        return self.model_copy(update={"signature": identity.sign(self.signing_bytes())})

    def verify(self, public_key: bytes) -> bool:
        """Signed by `public_key`, the key of the accuser's record."""
        return bool(self.signature) and _verify_cached(public_key, self.signing_bytes(), self.signature)


class Suspect(_Accusation):
    kind: Literal["suspect"] = "suspect"


class Dead(_Accusation):
    kind: Literal["dead"] = "dead"


Update = Annotated[Alive | Suspect | Dead, Field(discriminator="kind")]
_Updates = Annotated[list[Update], Field(max_length=MAX_UPDATES_PER_MESSAGE)]


# Every message but Sync says which version of its record the sender is at, so a receiver that
# missed it (or never heard of the sender) notices and pulls it, instead of waiting for push-pull.


class Ping(Message, tag="swim.ping"):
    seq: Count
    version: Count
    gossip: _Updates = []


class Ack(Message, tag="swim.ack"):
    seq: Count
    version: Count
    gossip: _Updates = []


class PingReq(Message, tag="swim.ping_req"):
    """Ask the receiver to probe `target` and pass the ack back under our `seq`."""

    seq: Count
    target: NodeId
    version: Count
    gossip: _Updates = []


class Gossip(Message, tag="swim.gossip"):
    version: Count
    gossip: _Updates


class SyncEntry(WireModel):
    """A member as the sender sees it: its record, and whether it is suspected or dead at that version."""

    record: CapabilityRecord
    state: Literal["alive", "suspect", "dead", "left"]


class Sync(Message, tag="swim.sync"):
    """Push-pull: the sender's whole view (or just its own record, to pull the receiver's view);
    `reply` asks the receiver to answer with its whole view."""

    reply: bool
    entries: Annotated[list[SyncEntry], Field(max_length=MAX_SYNC_ENTRIES)]


SwimMessage = Ping | Ack | PingReq | Gossip | Sync
SWIM_MESSAGES = (Ping, Ack, PingReq, Gossip, Sync)
