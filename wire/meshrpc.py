"""Requests one mesh node makes of another: its assignment, a route, the mesh's status."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from wire.codec import Message, WireModel, register

MESH_PROTOCOL = "meshd/mesh/1"
SWIM_PROTOCOL = "meshd/swim/1"

NodeId = Annotated[str, Field(min_length=1, max_length=64)]
Digest = Annotated[str, Field(min_length=1, max_length=128)]
Layer = Annotated[int, Field(ge=0, le=1 << 20)]
Text = Annotated[str, Field(max_length=256)]


@register
class AssignmentRequest(Message):
    """To the tracker: which range should the asking node serve?"""

    type: Literal["assignment_request"] = "assignment_request"
    v: Literal[1] = 1


@register
class AssignmentReply(Message):
    type: Literal["assignment"] = "assignment"
    v: Literal[1] = 1
    term: int = Field(ge=0)
    model: Digest | None = None
    start: Layer = 0
    end: Layer = 0
    reason: Text = ""


class RouteStage(WireModel):
    node_id: NodeId
    address: Annotated[str, Field(min_length=1, max_length=262)]
    start: Layer
    end: Layer


@register
class RouteRequest(Message):
    type: Literal["route_request"] = "route_request"
    v: Literal[1] = 1
    model: Digest | None = None
    exclude: list[NodeId] = Field(default_factory=list, max_length=256)


@register
class RouteReply(Message):
    type: Literal["route"] = "route"
    v: Literal[1] = 1
    model: Digest
    n_layers: Layer
    stages: list[RouteStage] = Field(max_length=256)
    seconds_per_token: float = Field(ge=0.0)


class MemberStatus(WireModel):
    node_id: NodeId
    address: Text
    state: Annotated[str, Field(max_length=16)]
    roles: list[Annotated[str, Field(max_length=32)]] = Field(max_length=16)
    reachability: Annotated[str, Field(max_length=16)]
    memory_bytes: int = Field(ge=0)
    served: list[Text] = Field(max_length=16)
    models: list[Text] = Field(max_length=16)
    relay_addresses: list[Text] = Field(default_factory=list, max_length=16)


class ModelCoverage(WireModel):
    model: Digest
    name: Text
    n_layers: Layer
    covered_layers: Layer
    assigned: list[Text] = Field(max_length=1024)
    replicas: int = Field(ge=0)
    # Why the members cannot cover the model (empty when they can): memory needed against offered.
    reason: Annotated[str, Field(max_length=1024)] = ""


@register
class StatusRequest(Message):
    type: Literal["status_request"] = "status_request"
    v: Literal[1] = 1


@register
class StatusReply(Message):
    type: Literal["status"] = "status"
    v: Literal[1] = 1
    node_id: NodeId
    tracker: NodeId | None = None
    term: int = Field(ge=0)
    members: list[MemberStatus] = Field(max_length=4096)
    coverage: list[ModelCoverage] = Field(max_length=64)


@register
class DialBackRequest(Message):
    """Can you reach me? (How a node learns its address, and whether it is behind NAT.)

    With ``port``: at that port of the host you see me from. With ``address``
    (an operator's ``--advertise``): there, if its host is the one you see."""

    type: Literal["dial_back_request"] = "dial_back_request"
    v: Literal[1] = 1
    address: Annotated[str, Field(max_length=262)] = ""
    port: Annotated[int, Field(ge=1, le=65535)] | None = None

    @model_validator(mode="after")
    def _one_target(self) -> DialBackRequest:
        if (self.port is None) == (not self.address):
            raise ValueError("give exactly one of address and port")
        return self


@register
class DialBackReply(Message):
    type: Literal["dial_back"] = "dial_back"
    v: Literal[1] = 1
    reachable: bool
    detail: Text = ""
    # The host the request came from, as the answering node saw it: the asker's address to the mesh.
    observed: Annotated[str, Field(max_length=253)] = ""
