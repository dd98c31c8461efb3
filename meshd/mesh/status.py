"""What `meshd status` shows: one node's view of its members, the tracker and model coverage.

A pure function of that view (member states and records, the tracker), so it is
tested without a daemon; the daemon only sends the reply. A record may say more
than a status line holds (32 served ranges, a mesh of more members than a reply
lists): the view is cut to the reply's bounds, never refused, and the members come in pages.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TypeVar

from pydantic import BaseModel

from meshd.mesh.assignment import held_ranges
from meshd.mesh.election import Tracker
from meshd.mesh.membership import MemberInfo
from meshd.mesh.records import CapabilityRecord, ModelInfo, ServedRange
from meshd.mesh.routing import DEFAULT_SECONDS_PER_LAYER, SpeedBook, believed_speeds
from wire.meshrpc import (
    MAX_SECONDS_PER_LAYER,
    MAX_SPEEDS,
    STATUS_PAGE,
    MemberStatus,
    ModelCoverage,
    StageSpeed,
    StatusReply,
)

_T = TypeVar("_T")


def _cut(items: list[_T], model: type[BaseModel], name: str) -> list[_T]:
    """`items` within the schema's bound on the field `name` of `model`."""
    bounds = [getattr(m, "max_length", None) for m in model.model_fields[name].metadata]
    return items[:min(b for b in bounds if isinstance(b, int))]


def held_models(records: Iterable[CapabilityRecord]) -> dict[str, ModelInfo]:
    """Every model some of `records` hold, by digest (the first description of each wins)."""
    out: dict[str, ModelInfo] = {}
    for record in records:
        for info in record.models:
            out.setdefault(info.digest, info)
    return out


def status_view(node_id: str, members: Sequence[MemberInfo], live: Sequence[CapabilityRecord],
                tracker: Tracker | None, address_fits: Callable[[str], bool] | None = None,
                reason_of: Callable[[ModelInfo], str] | None = None, offset: int = 0) -> StatusReply:
    """`members`: the members in the mesh, this node included (as `Membership.members()` gives them:
    no departed one, so none lingers in status);
    `live`: the records of those believed alive, which alone count for coverage; `address_fits`:
    which addresses the asker may be told (others show as none); `reason_of`: why a model that is
    not covered cannot be; `offset`: the first member of the page (coverage comes with the first)."""
    page = members[offset:offset + STATUS_PAGE]
    shown = [_member_status(m.record, m.state.value, tracker, address_fits) for m in page]
    return StatusReply(node_id=node_id, tracker=tracker.node_id if tracker else None,
                       term=tracker.term if tracker else 0, members=shown, total_members=len(members),
                       coverage=_cut(coverage(live, reason_of), StatusReply, "coverage") if offset == 0 else [])


def coverage(live: Sequence[CapabilityRecord],
             reason_of: Callable[[ModelInfo], str] | None = None) -> list[ModelCoverage]:
    """Per model: how many of its layers some live member serves, by whom, the spare copies, and
    (from `reason_of`) why the layers no one serves cannot be."""
    out = []
    for digest, info in held_models(live).items():
        served = [(r.node_id, s) for r in live if not r.leaving for s in r.served if s.model == digest]
        layers = [0] * info.n_layers
        for _, s in served:
            for i in range(s.start, min(s.end, info.n_layers)):
                layers[i] += 1
        holders = [(r.node_id, held) for r in live if not r.leaving for held in held_ranges(r, digest)]
        held = [False] * info.n_layers
        for _, (start, end) in holders:
            held[start:min(end, info.n_layers)] = [True] * (min(end, info.n_layers) - start)
        out.append(ModelCoverage(
            model=digest, name=info.name, n_layers=info.n_layers, covered_layers=sum(1 for c in layers if c),
            assigned=_cut([f"{node[:12]} [{s.start}, {s.end})" for node, s in served], ModelCoverage, "assigned"),
            replicas=replica_count(served),
            reason=reason_of(info) if reason_of is not None and not all(layers) else "",
            holders=_cut([f"{node[:12]} [{start}, {end})" for node, (start, end) in holders], ModelCoverage, "holders"),
            held_layers=sum(held),
            unverified=_cut(unverified_ranges(served), ModelCoverage, "unverified"),
            file=info.file))
    return out


def stage_speeds(live: Sequence[CapabilityRecord], speeds: SpeedBook | None, own: str | None,
                 assigned: Callable[[str], Mapping[str, Collection[tuple[int, int]]] | None] | None = None,
                 ) -> list[StageSpeed]:
    """Every served range of every model that routes may use, with the seconds per layer routes
    planned here count for it and where that figure came from (`routing.believe`): what `meshd
    status` and the console show. `assigned` gives a model's placement (None: none here, every
    served range counts), as routes take it: ranges claimed beyond it, which no route uses, are left
    out, so no flood of claims crowds the placed ones out of the reply's bound."""
    out: list[StageSpeed] = []
    serving = [r for r in live if not r.leaving]
    for digest in held_models(serving):
        believed = believed_speeds(serving, digest, DEFAULT_SECONDS_PER_LAYER, speeds, own)
        placed = assigned(digest) if assigned is not None else None
        for record in serving:
            for s in record.served:
                if s.model != digest or len(out) >= MAX_SPEEDS or \
                        (placed is not None and (s.start, s.end) not in placed.get(record.node_id, ())):
                    continue
                figure = believed[record.node_id]
                # a member's own word is any finite number: bounded to the reply's schema before it is sent
                out.append(StageSpeed(node_id=record.node_id, model=digest, start=s.start, end=s.end,
                                      seconds_per_layer=min(figure.seconds_per_layer, MAX_SECONDS_PER_LAYER),
                                      source=figure.source, samples=figure.samples,
                                      declared=min(record.seconds_per_layer, MAX_SECONDS_PER_LAYER)))
    return out


def replica_count(served: Sequence[tuple[str, ServedRange]]) -> int:
    """The stages that repeat a range another node serves (each range's nodes but one): the replicas routes
    name and spot checks run on, the counterpart of `unverified_ranges`."""
    nodes: dict[tuple[int, int], set[str]] = {}
    for node, s in served:
        nodes.setdefault((s.start, s.end), set()).add(node)
    return sum(len(who) - 1 for who in nodes.values())


def unverified_ranges(served: Sequence[tuple[str, ServedRange]]) -> list[str]:
    """The ranges only one node serves: a spot check needs a second node serving exactly that range."""
    nodes: dict[tuple[int, int], set[str]] = {}
    for node, s in served:
        nodes.setdefault((s.start, s.end), set()).add(node)
    return [f"[{start}, {end})" for (start, end), who in sorted(nodes.items()) if len(who) == 1]


def _member_status(record: CapabilityRecord, state: str, tracker: Tracker | None,
                   address_fits: Callable[[str], bool] | None) -> MemberStatus:
    roles = list(record.roles) + (["tracker"] if tracker and tracker.node_id == record.node_id else [])
    address = record.addresses[0] if record.addresses else ""
    if address and address_fits is not None and not address_fits(address):
        address = ""
    return MemberStatus(node_id=record.node_id, address=address,
                        state=state, roles=roles, reachability=record.reachability,
                        relay_addresses=list(record.relay_addresses), memory_bytes=record.memory_bytes,
                        offload=record.offload,
                        served=_cut([f"{s.model[:12]} [{s.start}, {s.end})" for s in record.served],
                                    MemberStatus, "served"),
                        models=_cut([m.name for m in record.models], MemberStatus, "models"))
