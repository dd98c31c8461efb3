"""Layer range assignment: which node serves which contiguous layers of a model.

The tracker cuts the layer stack into segments (the boundaries of the best
single chain) and gives every segment one or more hosts:

1. The primary chain minimises what one token costs, the sum over its stages
   of layers x seconds per layer, plus `hop_seconds` per stage: faster nodes
   get as many layers as their memory allows, and a stage is added only when
   it saves more compute than its hop costs (fewer stages preferred). This is
   an exact 0/1 knapsack over the most promising candidates (the fastest and
   the largest nodes), with the head stage paying for the token embedding and
   the tail stage for the output head.
2. Every other node becomes a replica of the weakest segment it can hold, so
   spare capacity goes where throughput is lowest; nodes too small for any
   segment are grouped to cover one together. Replicas share the primary's
   boundaries, so any replica can stand in for its segment in a route.
3. Given the current assignment, placement has hysteresis (`Placer`): a layer
   range is expensive to move (a reload, often a fetch), so a join or leave
   moves as few ranges as it must:
   * every node keeps its range while it is present and its range fits;
   * a segment left with no host goes to a spare node (one that held that very
     range before it left, then one holding its layers on disk, then the
     fastest); with no spare, to a replica of the segment with the most hosts;
     only when neither can take it is the model cut afresh (a forced re-cut);
   * a segment with no replica (unverifiable: a spot check needs a second host
     of the range) takes the next spare node that holds it, and else a replica
     from a segment with three or more hosts: the move a late-declared death
     forces, which a newcomer placed while the dead member still counted made;
   * a node back within `RETURN_GRACE` of leaving gets its range back (where no
     range lacks a replica it could fill instead), and if its leaving forced a
     re-cut and every host of the placement before it is back, that placement
     is restored;
   * other newcomers become replicas, of a segment with no replica first, then
     of the weakest;
   * a re-cut that nothing forces happens only when a fresh plan is faster by
     `AssignmentPolicy.keep_ratio` or, no slower, makes every layer verifiable
     (hosted twice or more) where the current one leaves `RECUT_UNVERIFIED` of
     them unverifiable.
   A new tracker starts from what the live members serve (`served_assignment`),
   so a change of tracker moves nothing either.

A volunteer need not hold the model's file: it may fetch its range from the
members that do (meshd.fetch) before it serves. A placement keeps ranges where
they are (3.), and a segment to host goes first to a spare node that already
holds its layers, so a fetch is planned only where no holder can take it; a
model whose layers no live member holds on disk is not placed at all (nobody
could fetch them). Routes use served ranges alone, so a stage still fetching
is assigned but never routed to.

A node's memory must hold its weights and the KV cache of its layers for the
planned context and sessions. Layers differ in size (a MoE layer outweighs a
dense lead layer many times): a stage's exact bytes are the sum of its own
layers', and the chain search counts every layer at the largest layer's size,
so what it places fits. A node that offloads (`gpu_layers`) keeps the last of
its layers, their KV and, at the tail, the output head in GPU memory, as the
engine does; the rest, the token embedding always, sits in RAM. Each volunteer
moves to its new range itself, loading it before it releases the old one, so
sessions in flight keep a route.

Some models may be cut only at some layers (glm-dsa: just before a full-indexer
layer, `ModelSpec.cuts`, from the file). Then every range starts and ends at an
allowed cut or an end of the model: the chain search is a shortest path over the
cut points with the nodes along the chain in a few orders, a segment too large
for one node is covered at the cuts, and a node too small for the smallest piece
between two cuts gets none.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from meshd.mesh.assignment import Assignment, AssignmentPolicy, CoverageError, ModelSpec, NodeCapacity, Range, Stage
from meshd.mesh.chains import Host, distinct, greedy_cover, primary_chain, tiles, usable_hosts
from meshd.mesh.routing import StageOption, plan_route
from meshd.mesh.shortfall import shortfall

# How long a departed member's range is kept for it: a member back within this (a daemon restarted or
# upgraded, a laptop woken, a link that dropped for a minute) gets its range back, loaded or on disk,
# instead of being placed as a newcomer while another node fetches and loads what it had. Five
# minutes covers those; a member away longer is taken as gone and stops shaping the placement.
RETURN_GRACE = 300.0
# A re-cut that nothing forces, for coverage: a fresh plan no slower than the current one replaces it
# when it makes every layer verifiable (hosted twice or more, so a spot check has a replica to compare
# with) while the current one leaves at least this fraction of the layers unverifiable. A quarter of
# the model unchecked is worth reloading every range for; a layer or two, or a partial gain that the
# next join may give without moving anything, is not.
RECUT_UNVERIFIED = 0.25

def assign(
    nodes: Sequence[NodeCapacity],
    model: ModelSpec,
    policy: AssignmentPolicy = AssignmentPolicy(),
    current: Assignment | None = None,
    returning: Mapping[str, Range] | None = None,
) -> Assignment:
    """Place `model` on `nodes`; with `current`, move as little as is worth it (the module's 3.);
    `returning`: the ranges nodes back within `RETURN_GRACE` had when they left (`Placer` keeps them).

    Raises CoverageError when the nodes cannot hold every layer."""
    return _place(nodes, model, policy, current, returning or {})[0]


class Placer:
    """One model's placement as members come and go, with the memory hysteresis needs: the ranges
    departed members had and the placement a forced re-cut replaced, each for `grace` seconds.
    Sans-IO: the caller passes the time. Bounded: it remembers only members placed within `grace`."""

    def __init__(self, policy: AssignmentPolicy = AssignmentPolicy(), grace: float = RETURN_GRACE) -> None:
        self.policy = policy
        self.grace = grace
        self.current: Assignment | None = None
        self._departed: dict[str, tuple[Range, float]] = {}  # node: the range it left, and when
        self._recut: tuple[Assignment, float] | None = None  # the placement a forced re-cut replaced, when

    def place(self, now: float, nodes: Sequence[NodeCapacity], model: ModelSpec) -> Assignment:
        """The placement of `model` on `nodes` (the members present now). CoverageError when they
        cannot cover it; the last placement is remembered all the same, for members coming back."""
        self._departed = {node: left for node, left in self._departed.items() if now - left[1] < self.grace}
        if self._recut is not None and now - self._recut[1] >= self.grace:
            self._recut = None
        present = {node.node_id for node in nodes}
        current = self.current
        for stage in current.stages if current is not None else ():
            if stage.node_id not in present:
                self._departed.setdefault(stage.node_id, ((stage.start, stage.end), now))
        returning = {node: left[0] for node, left in self._departed.items() if node in present}
        restored = _restore(self._recut[0], nodes, model, self.policy) if self._recut is not None else None
        if restored is not None:
            placed, self._recut = restored, None
        else:
            placed, forced = _place(nodes, model, self.policy, current, returning)
            if forced and current is not None and self._recut is None:
                self._recut = (current, now)
        for node in returning:
            del self._departed[node]
        self.current = placed
        return placed


def served_assignment(served: Mapping[str, Range], model: ModelSpec) -> Assignment | None:
    """The placement the ranges members serve (node: range) make, as `current` for `assign`: a new
    tracker starts from it, so a change of tracker moves no range. Its cuts are the ends no served
    range crosses; a part nobody serves is a segment `assign` fills. None when nothing is served."""
    n = model.n_layers
    ranges = {node: (start, end) for node, (start, end) in served.items() if 0 <= start < end <= n}
    if not ranges:
        return None
    ends = {0, n} | {point for start, end in ranges.values() for point in (start, end)}
    cuts = tuple(sorted(p for p in ends if not any(start < p < end for start, end in ranges.values())))
    stages = tuple(Stage(node, start, end) for node, (start, end) in sorted(ranges.items()))
    return Assignment(model.digest, n, cuts, stages, (), math.inf)


def _place(
    nodes: Sequence[NodeCapacity],
    model: ModelSpec,
    policy: AssignmentPolicy,
    current: Assignment | None,
    returning: Mapping[str, Range],
) -> tuple[Assignment, bool]:
    """The placement and whether it is a forced re-cut (the current one could not be repaired)."""
    # One entry per node (the last wins), or a node could be given two ranges.
    nodes = distinct(nodes)
    usable = usable_hosts(nodes, model)
    kept = None
    comparable = current is not None and current.model == model.digest and current.n_layers == model.n_layers
    if current is not None and comparable:
        kept = _repair(current, usable, model, policy, returning)
    try:
        fresh = _fresh(usable, nodes, model, policy)
    except CoverageError:
        if kept is None:
            raise
        return kept, False
    if kept is None:
        return fresh, comparable
    return (fresh, False) if _worth_recut(fresh, kept, policy) else (kept, False)


def _worth_recut(fresh: Assignment, kept: Assignment, policy: AssignmentPolicy) -> bool:
    """Whether a fresh plan pays for moving ranges nothing forces to move: faster by the policy's
    margin, or no slower and verifying every layer where `kept` leaves `RECUT_UNVERIFIED` of them unverified."""
    if fresh.seconds_per_token < policy.keep_ratio * kept.seconds_per_token:
        return True
    n = fresh.n_layers
    return fresh.seconds_per_token <= kept.seconds_per_token and _verified_layers(fresh) == n \
        and n - _verified_layers(kept) >= RECUT_UNVERIFIED * n


def _verified_layers(assignment: Assignment) -> int:
    """Layers two or more stages host: a spot check of them has a replica to compare with."""
    return sum(1 for depth in _depths(assignment.stages, assignment.n_layers) if depth >= 2)


def _depths(stages: Iterable[Stage], n_layers: int) -> list[int]:
    depth = [0] * n_layers
    for stage in stages:
        for layer in range(stage.start, min(stage.end, n_layers)):
            depth[layer] += 1
    return depth


def _restore(previous: Assignment, nodes: Sequence[NodeCapacity], model: ModelSpec,
             policy: AssignmentPolicy) -> Assignment | None:
    """`previous` again, newcomers since as its replicas, once every one of its hosts is back and still
    fits its range; None before that."""
    if previous.model != model.digest or previous.n_layers != model.n_layers:
        return None
    usable = usable_hosts(distinct(nodes), model)
    present = {node.node_id: node for node in usable}
    if not all(s.node_id in present and present[s.node_id].fits(model, s.start, s.end) for s in previous.stages):
        return None
    placed = {stage.node_id for stage in previous.stages}
    spare = [node for node in usable if node.node_id not in placed]
    stages = _replicate(list(previous.stages), previous.boundaries, spare, model, _speeds(usable), {})
    return _finish(model, previous.boundaries, stages, usable, policy)


def _fresh(
    usable: list[Host], nodes: Sequence[NodeCapacity], model: ModelSpec, policy: AssignmentPolicy
) -> Assignment:
    chain = primary_chain(usable, model, policy)
    if chain is None:
        raise CoverageError(shortfall(nodes, model, policy))
    boundaries = (0,) + tuple(stage.end for stage in chain)
    used = {stage.node_id for stage in chain}
    spare = [node for node in usable if node.node_id not in used]
    stages = _replicate(chain, boundaries, spare, model, _speeds(usable), {})
    return _finish(model, boundaries, stages, usable, policy)


def _repair(
    current: Assignment, usable: list[Host], model: ModelSpec, policy: AssignmentPolicy,
    returning: Mapping[str, Range],
) -> Assignment | None:
    """`current` with as few moves as keep every segment hosted (the module's 3.); None when only a
    re-cut can."""
    present = {node.node_id: node for node in usable}
    boundaries = current.boundaries
    if not all(model.allows(start, end) for start, end in zip(boundaries, boundaries[1:], strict=False)):
        return None  # placed before the model's cuts were known: only a fresh plan cuts where it may
    segments = list(zip(boundaries, boundaries[1:], strict=False))
    kept = [
        stage
        for stage in current.stages
        if stage.node_id in present
        and present[stage.node_id].fits(model, stage.start, stage.end)
        and any(start <= stage.start and stage.end <= end for start, end in segments)
    ]
    used = {stage.node_id for stage in kept}
    spare = [node for node in usable if node.node_id not in used]
    for start, end in segments:
        inside = [(stage.start, stage.end) for stage in kept if start <= stage.start and stage.end <= end]
        if tiles(Counter(inside), start, end):
            continue
        group = _host_segment(spare, model, start, end, returning)
        if group is None:
            # no spare node takes it: a replica of the segment with the most hosts does (one move)
            mover = _movable_replica(kept, segments, model, present, (start, end), least_copies=2)
            if mover is None:
                return None
            kept = [stage for stage in kept if stage.node_id != mover] + [Stage(mover, start, end)]
            continue
        kept.extend(group)
        taken = {stage.node_id for stage in group}
        spare = [node for node in spare if node.node_id not in taken]
    stages = _replicate(kept, boundaries, spare, model, _speeds(usable), returning)
    return _finish(model, boundaries, _fill_lone(stages, segments, model, present), usable, policy)


def _host_segment(spare: list[Host], model: ModelSpec, start: int, end: int,
                  returning: Mapping[str, Range]) -> list[Stage] | None:
    """The spare node to take the whole segment: one that had it before it left, else one that holds
    its layers on disk, else the fastest (a holder needs no fetch); or else a group of them."""
    fitting = [node for node in spare if node.fits(model, start, end)]  # fastest first
    if fitting:
        chosen = min(fitting, key=lambda node: (returning.get(node.node_id) != (start, end),
                                                not node.holds_range(start, end)))  # stable: fastest first
        return [Stage(chosen.node_id, start, end)]
    return greedy_cover(sorted(spare, key=lambda node: (-node.total, node.speed)), model, start, end)


def _copies(stages: Sequence[Stage], start: int, end: int) -> int:
    """How many times `stages` host every layer of the segment [start, end): its least covered layer's count."""
    return min(_depths((s for s in stages if start <= s.start and s.end <= end), end)[start:end])


def _movable_replica(stages: Sequence[Stage], segments: Sequence[Range], model: ModelSpec,
                     present: Mapping[str, Host], target: Range, least_copies: int) -> str | None:
    """A node hosting a whole segment other than `target` that is hosted `least_copies` times or more, and
    that fits `target`: one whose segment keeps a replica first (no second move to fill it), then one
    holding `target`'s layers (no fetch), then from the most copied segment, then the slowest (its
    segment loses least). None when there is none."""
    copies = {segment: _copies(stages, *segment) for segment in segments if segment != target}
    candidates = [stage for stage in stages if copies.get((stage.start, stage.end), 0) >= least_copies
                  and present[stage.node_id].fits(model, *target)]
    if not candidates:
        return None
    best = min(candidates, key=lambda stage: (copies[(stage.start, stage.end)] < 3,
                                              not present[stage.node_id].holds_range(*target),
                                              -copies[(stage.start, stage.end)], -present[stage.node_id].speed,
                                              stage.node_id))
    return best.node_id


def _fill_lone(stages: list[Stage], segments: Sequence[Range], model: ModelSpec,
               present: Mapping[str, Host]) -> list[Stage]:
    """Each segment hosted once (no replica: no spot check can compare it) takes a replica from a
    segment hosted three times or more, which keeps two: what a death declared after a newcomer was
    placed beside the dead member's range forces."""
    stages = list(stages)
    for segment in segments:
        if _copies(stages, *segment) != 1:
            continue
        mover = _movable_replica(stages, segments, model, present, segment, least_copies=3)
        if mover is not None:
            stages = [stage for stage in stages if stage.node_id != mover] + [Stage(mover, *segment)]
    return stages


def _replicate(
    stages: list[Stage],
    boundaries: tuple[int, ...],
    spare: list[Host],
    model: ModelSpec,
    speed: Mapping[str, float],
    returning: Mapping[str, Range],
) -> list[Stage]:
    """Give each spare node (fastest first) a replica: of a segment hosted once (that its range was
    before it left first), else of the segment it had before it left, else of the weakest it can hold."""
    stages = list(stages)
    segments = list(zip(boundaries, boundaries[1:], strict=False))
    strength = [0.0] * len(segments)
    copies = [_copies(stages, start, end) for start, end in segments]

    def segment_of(stage: Stage) -> int:
        return next(i for i, (start, end) in enumerate(segments) if start <= stage.start and stage.end <= end)

    # A segment's strength is the tokens per second its hosts could process together.
    for stage in stages:
        index = segment_of(stage)
        start, end = segments[index]
        strength[index] += 1.0 / ((end - start) * speed[stage.node_id])
    need = [model.stage_bytes(start, end) for start, end in segments]
    by_need = sorted(range(len(segments)), key=lambda i: need[i])
    leftover: list[Host] = []
    for node in spare:
        fits = [i for i in by_need if node.fits(model, *segments[i])]
        if not fits:
            leftover.append(node)
            continue
        lone = [i for i in fits if copies[i] < 2]
        had = next((i for i in fits if segments[i] == returning.get(node.node_id)), None)
        index = had if had is not None and (not lone or had in lone) else \
            min(lone or fits, key=lambda i: (strength[i], i))
        start, end = segments[index]
        stages.append(Stage(node.node_id, start, end))
        strength[index] += 1.0 / ((end - start) * node.speed)
        copies[index] += 1
    # Nodes too small for any segment on their own cover one together, weakest segment first.
    leftover.sort(key=lambda node: (-node.total, node.speed))
    open_segments = set(range(len(segments)))
    while leftover and open_segments:
        index = min(open_segments, key=lambda i: (copies[i] >= 2, strength[i], i))
        start, end = segments[index]
        group = greedy_cover(leftover, model, start, end)
        if group is None:
            open_segments.discard(index)
            continue
        stages.extend(group)
        taken = {stage.node_id for stage in group}
        leftover = [node for node in leftover if node.node_id not in taken]
        slowest = max(speed[stage.node_id] for stage in group)
        strength[index] += 1.0 / ((end - start) * slowest)
        copies[index] += 1
    return stages


def _speeds(usable: list[Host]) -> dict[str, float]:
    return {node.node_id: node.speed for node in usable}


def _finish(
    model: ModelSpec,
    boundaries: tuple[int, ...],
    stages: list[Stage],
    usable: list[Host],
    policy: AssignmentPolicy,
) -> Assignment:
    speed = _speeds(usable)
    options = [StageOption(stage.node_id, stage.start, stage.end, speed[stage.node_id]) for stage in stages]
    route = plan_route(options, model.n_layers, rtt=lambda a, b: 0.0 if a is None else policy.hop_seconds)
    chain = tuple(Stage(option.node_id, option.start, option.end) for option in route.stages)
    return Assignment(
        model.digest, model.n_layers, boundaries, tuple(stages), chain, route.seconds + policy.hop_seconds
    )
