"""Requests one mesh node makes of another: its assignment, a route, the mesh's status."""

from __future__ import annotations

from pydantic import Field, model_validator

from wire.limits import Limits, register_protocol
from wire.message import Message, WireModel
from wire.swim import MAX_ADDRESSES, MAX_MODELS, MAX_ROLES, MAX_SERVED, SWIM_PROTOCOL, Placement
from wire.types import Address, Count, Digest, Host, Label, Layer, NodeId, Port, Prose, Text

MESH_PROTOCOL = "meshd/mesh/1"

__all__ = ["MESH_PROTOCOL", "SWIM_PROTOCOL"]

# Requests are tiny; the largest reply is a status of a big mesh (a few hundred
# bytes a member): 4 MiB holds some 10,000 members.
register_protocol(MESH_PROTOCOL, Limits(max_message_bytes=4 << 20, max_objects=1 << 17, max_depth=8))


class AssignmentRequest(Message, tag="assignment_request"):
    """To the tracker: which range should the asking node serve?"""


class AssignmentReply(Message, tag="assignment"):
    term: Count
    model: Digest | None = None
    start: Layer = 0
    end: Layer = 0
    reason: Text = ""
    # the tracker's signature over this range of the asker's: the asker carries it in its record
    placement: Placement | None = None


class RouteStage(WireModel):
    node_id: NodeId
    address: Address
    start: Layer
    end: Layer
    # a replica's numerics fingerprint as its record says ("": the same as its stage's, or not known):
    # the asker asks a replica of other numerics for sketches to compare within a tolerance (wire.sketch)
    numerics: Text = ""


class RouteRequest(Message, tag="route_request"):
    model: Digest | None = None
    exclude: list[NodeId] = Field(default_factory=list, max_length=256)


# Replicas a route reply names per stage: a spot check's second node and a third to settle a mismatch
MAX_REPLICAS_PER_STAGE = 2


class RouteReply(Message, tag="route"):
    model: Digest
    n_layers: Layer
    stages: list[RouteStage] = Field(max_length=256)
    seconds_per_token: float = Field(ge=0.0)
    # other members serving exactly a stage's range, for the asker's spot checks (no route requests of
    # its own before the first token); None: the planner did not say
    replicas: list[RouteStage] | None = Field(default=None, max_length=256 * MAX_REPLICAS_PER_STAGE)


class MemberStatus(WireModel):
    node_id: NodeId
    address: Text
    state: Label
    # A status line holds whatever a record may (its roles and "tracker"): the reply's bounds are the
    # record's, so no valid record can break `meshd status`.
    roles: list[Label] = Field(max_length=MAX_ROLES + 1)
    reachability: Label
    memory_bytes: Count
    served: list[Text] = Field(max_length=MAX_SERVED)
    models: list[Text] = Field(max_length=MAX_MODELS)
    relay_addresses: list[Address] = Field(default_factory=list, max_length=MAX_ADDRESSES)
    # the record's `offload`: what its stage put on a GPU and where ("": nothing)
    offload: Text = ""


class LinkStatus(WireModel):
    """One of the answering node's links: to whom, how its bytes go ("direct", "punched" through two
    NATs, or "relayed" through a relay's circuit), and its last keepalive's round trip."""

    node_id: NodeId
    path: Label
    address: Text
    rtt_ms: float | None = Field(default=None, ge=0.0)


class ModelCoverage(WireModel):
    model: Digest
    name: Text
    n_layers: Layer
    covered_layers: Layer
    assigned: list[Text] = Field(max_length=1024)
    # Stages that serve a range another live member serves too (on each range, its members but one):
    # what spot checks run on. Not the whole model's spare copies, which one range's lack made 0.
    replicas: Count
    # Why the members cannot cover the model (empty when they can): memory needed against offered.
    reason: Prose = ""
    # Who holds which of its layers on disk, the sources a fetching volunteer takes them from.
    holders: list[Text] = Field(default_factory=list, max_length=1024)
    held_layers: Layer = 0
    # Ranges that exactly one live member serves: no replica to spot-check their outputs on.
    unverified: list[Text] = Field(default_factory=list, max_length=1024)
    # The model's file name less `.gguf`, a second name to ask for it by ("": none told).
    file: Text = ""


class FetchStatus(WireModel):
    """A fetch the answering node runs: the tensors of its range, from the members that hold them."""

    model: Digest
    name: Text
    start: Layer
    end: Layer
    # verified so far (fetched now, or held before), of the total asked for
    done_bytes: Count
    total_bytes: Count
    # over the network in this fetch
    fetched_bytes: Count = 0
    # Bytes a second over the last few seconds; 0 before there is a measure.
    rate: float = Field(ge=0.0, allow_inf_nan=False)
    sources: Count = 0
    # "fetching", "loading", "done" or "failed: ..." (why).
    state: Text = "fetching"


# Members per status reply: a page of the widest records fits a mesh message (4 MiB) with room.
STATUS_PAGE = 1024
# Stage speeds per reply: a served range each (a few hundred bytes) of a mesh of thousands of members.
MAX_SPEEDS = 4096
# A speed of a layer beyond this (seconds) is no speed: a figure is bounded before it is shown or compared.
MAX_SECONDS_PER_LAYER = 3600.0


class StageSpeed(WireModel):
    """The seconds per layer routes count for one served range, and where that figure came from:
    "probe" (the tracker timed it), "own" (the answering tracker's own stage), "default" (not timed
    yet: the conservative default), "declared" (not timed yet, slower than that by its own word),
    "traffic" (real asks saw it far slower than any of those: meshd.mesh.traffic).
    `samples`: the probes whose samples the figure is the median of (traffic: the reporters'); `declared`: what the member says of
    itself (0: nothing), shown beside what counts."""

    node_id: NodeId
    model: Digest
    start: Layer
    end: Layer
    seconds_per_layer: float = Field(ge=0.0, le=MAX_SECONDS_PER_LAYER, allow_inf_nan=False)
    source: Label
    samples: Count = 0
    declared: float = Field(default=0.0, ge=0.0, le=MAX_SECONDS_PER_LAYER, allow_inf_nan=False)


# The most seconds a token may be reported to have taken (the report is the asker's word: bounded)
MAX_SECONDS_PER_TOKEN = 3600.0


class TimedStage(WireModel):
    node_id: NodeId
    start: Layer
    end: Layer
    # the stage's own seconds per token over the decode, as its signed span receipts said to the asker
    # (None: the ask had no such receipts, an unverified one or on the daemons' path)
    own: float | None = Field(default=None, ge=0.0, le=MAX_SECONDS_PER_TOKEN, allow_inf_nan=False)


class TrafficReport(Message, tag="traffic_report"):
    """To the tracker, from a member (or to a member from its own `meshd ask`, which it passes on):
    the route one ask took, stage by stage, and the seconds per token its asker saw over the decode
    of `tokens` tokens. The tracker turns it into stage speeds (meshd.mesh.traffic)."""

    model: Digest
    stages: list[TimedStage] = Field(min_length=1, max_length=256)
    tokens: int = Field(ge=2, le=1 << 20)
    seconds_per_token: float = Field(gt=0.0, le=MAX_SECONDS_PER_TOKEN, allow_inf_nan=False)


class TrafficTaken(Message, tag="traffic_taken"):
    """Whether the tracker counted a `TrafficReport` (a member's answer to its own asker: whether it
    counted it, as the tracker, or passed it on), and why not where it did not."""

    taken: bool
    reason: Text = ""


class SpeedsRequest(Message, tag="speeds_request"):
    """The stage speeds the answering node counts (the tracker's are measured: it asks any node's)."""


class SpeedsReply(Message, tag="speeds"):
    # the node whose figures these are (the tracker, when it answered)
    by: NodeId
    speeds: list[StageSpeed] = Field(default_factory=list, max_length=MAX_SPEEDS)


class StatusRequest(Message, tag="status_request"):
    """The page of members from `offset` on (in the answering node's order; coverage on the first)."""

    offset: Count = 0


class StatusReply(Message, tag="status"):
    node_id: NodeId
    tracker: NodeId | None = None
    term: Count
    members: list[MemberStatus] = Field(max_length=STATUS_PAGE)
    coverage: list[ModelCoverage] = Field(max_length=64)
    # The answering node's own fetches, newest last.
    fetches: list[FetchStatus] = Field(default_factory=list, max_length=8)
    # Members the answering node knows in all; `members` is the page of them from the asked offset.
    total_members: Count = 0
    # The stage speeds routes count, as `speeds_by` (the tracker, where it answered) counts them; on
    # the first page only. Empty from a node that predates them.
    speeds: list[StageSpeed] = Field(default_factory=list, max_length=MAX_SPEEDS)
    speeds_by: NodeId | None = None
    # The answering node's own links (first page only), and, from a relay, the bytes its circuits
    # have forwarded since it started (None from a node that relays nothing).
    links: list[LinkStatus] = Field(default_factory=list, max_length=STATUS_PAGE)
    relayed_bytes: Count | None = None


class DialBackRequest(Message, tag="dial_back_request"):
    """Can you reach me? (How a node learns its address, and whether it is behind NAT.)

    With ``port``: at that port of the host you see me from. With ``address``
    (an operator's ``--advertise``): there, if its host is the one you see."""

    address: Address | None = None
    port: Port | None = None

    @model_validator(mode="after")
    def _one_target(self) -> DialBackRequest:
        if (self.port is None) == (self.address is None):
            raise ValueError("give exactly one of address and port")
        return self


class DialBackReply(Message, tag="dial_back"):
    reachable: bool
    detail: Text = ""
    # The host the request came from, as the answering node saw it: the asker's address to the mesh.
    observed: Host = ""
