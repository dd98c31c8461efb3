"""What a mesh node's duties (meshd.mesh.duty) run with and ask of their shell: the configuration,
and the events the shell acts on (ask the tracker for a range, load one) or logs."""

from __future__ import annotations

from dataclasses import dataclass

from meshd.mesh.assignment import Assignment, AssignmentPolicy
from meshd.mesh.election import Tracker
from meshd.mesh.membership import MemberEvent
from meshd.mesh.node import TrackerChanged
from meshd.mesh.probes import ProbeConfig, StageProbe
from meshd.mesh.records import ModelInfo
from meshd.mesh.traffic import TrafficConfig


@dataclass(frozen=True)
class DutyConfig:
    # The model this node offers to serve, if any (a node that fetches it learns it later: `volunteer`).
    volunteer: ModelInfo | None = None
    # Disk a node that fetches its range may fill (None: no limit, or it holds the whole file).
    disk_bytes: int | None = None
    # KV tokens a stage holds when no volunteer of the model says (sessions x tokens each).
    kv_tokens: int = 4096
    # The tracker places this long after the first news of a burst, not at each piece of it.
    settle: float = 0.5
    # After a failed ask or load, ask again after `retry`, doubling up to `retry_max`.
    retry: float = 1.0
    retry_max: float = 30.0
    policy: AssignmentPolicy = AssignmentPolicy()
    # As tracker, how it times the stages it placed (meshd.mesh.probes); None: it does not.
    probes: ProbeConfig | None = ProbeConfig()
    # As tracker, how it weighs what members' asks saw of the stages (meshd.mesh.traffic).
    traffic: TrafficConfig = TrafficConfig()


@dataclass(frozen=True)
class AskAssignment:
    """Ask `tracker` for this node's range; answer with `MeshDuty.assignment_reply`."""

    tracker: Tracker


@dataclass(frozen=True)
class LoadRange:
    """Load layers [start, end) of `model` beside what is served; answer with `range_loaded` or
    `range_failed`. Sessions on the old range keep it until they end."""

    model: str
    start: int
    end: int


@dataclass(frozen=True)
class AssignmentChanged:
    """As tracker, this node placed `model` anew; `assignment` None: it cannot be covered, `reason` says why."""

    model: str
    assignment: Assignment | None
    reason: str = ""


@dataclass(frozen=True)
class RangeRefused:
    """The tracker assigned a range this node will not load."""

    start: int
    end: int
    reason: str


DutyEvent = MemberEvent | TrackerChanged | AskAssignment | LoadRange | AssignmentChanged | RangeRefused | StageProbe
