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

import itertools
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from meshd.mesh.records import ROLE_CLIENT, CapabilityRecord, ModelInfo
from meshd.mesh.routing import StageOption, plan_route

Range = tuple[int, int]

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


@dataclass(frozen=True)
class ModelSpec:
    """What placement needs to know of a model, with the KV budget already chosen."""

    digest: str
    n_layers: int
    bytes_per_layer: int  # the largest layer's weights: what the chain search counts for every layer
    kv_bytes_per_layer: int = 0  # KV cache of one layer for the planned context x sessions
    head_bytes: int = 0  # token embedding, at the stage owning layer 0
    tail_bytes: int = 0  # output norm and LM head, at the stage owning the last layer
    kv_tokens: int = 0  # the tokens `kv_bytes_per_layer` is for: what a shortfall names
    name: str = ""
    layer_sizes: tuple[int, ...] = ()  # weights of each layer; empty: every one `bytes_per_layer`
    # The layers a chain may be cut just before, ascending (glm-dsa: its full-indexer layers); None: any.
    cuts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.layer_sizes and len(self.layer_sizes) != self.n_layers:
            raise ValueError(f"{len(self.layer_sizes)} layer sizes for {self.n_layers} layers")
        if self.cuts is not None and list(self.cuts) != sorted(set(self.cuts) & set(range(1, self.n_layers))):
            raise ValueError(f"cuts {list(self.cuts)[:8]} are not ascending layers inside the {self.n_layers}")

    def allows(self, start: int, end: int) -> bool:
        """Whether a stage may serve [start, end): both its ends are the model's ends or allowed cuts."""
        return self.cuts is None or all(b in (0, self.n_layers) or b in self._cut_set for b in (start, end))

    @cached_property
    def _cut_set(self) -> frozenset[int]:
        return frozenset(self.cuts or ())

    def points(self, start: int, end: int) -> list[int]:
        """Where [start, end) may be cut: its ends and the allowed cuts inside it, ascending."""
        inside = range(start + 1, end) if self.cuts is None else [c for c in self.cuts if start < c < end]
        return [start, *inside, end]

    def pieces(self) -> list[Range]:
        """The smallest ranges a stage may serve: from each allowed cut to the next."""
        points = self.points(0, self.n_layers)
        return list(zip(points, points[1:], strict=False))

    @cached_property
    def _sums(self) -> np.ndarray | None:
        """Prefix sums of the layer sizes: any stage's weights in one subtraction."""
        return np.concatenate(([0], np.cumsum(self.layer_sizes, dtype=np.int64))) if self.layer_sizes else None

    @classmethod
    def from_info(cls, info: ModelInfo, kv_tokens: int) -> ModelSpec:
        """`kv_tokens`: tokens of KV each stage must hold, context length x concurrent sessions."""
        return cls(
            digest=info.digest,
            n_layers=info.n_layers,
            bytes_per_layer=info.bytes_per_layer,
            kv_bytes_per_layer=info.kv_bytes_per_token * kv_tokens,
            head_bytes=info.head_bytes,
            tail_bytes=info.tail_bytes,
            kv_tokens=kv_tokens,
            name=info.name,
            layer_sizes=tuple(info.layer_bytes),
            cuts=None if info.cuts is None else tuple(info.cuts),
        )

    def with_kv_tokens(self, kv_tokens: int) -> ModelSpec:
        per_token = self.kv_bytes_per_layer // self.kv_tokens if self.kv_tokens else 0
        return replace(self, kv_bytes_per_layer=per_token * kv_tokens, kv_tokens=kv_tokens)

    @property
    def layer_bytes(self) -> int:
        return self.bytes_per_layer + self.kv_bytes_per_layer

    def weights(self, start: int, end: int) -> int:
        """Weight bytes of layers [start, end)."""
        sums = self._sums
        return int(sums[end] - sums[start]) if sums is not None else (end - start) * self.bytes_per_layer

    def weight_bytes(self, start: int, end: int) -> int:
        """Bytes of the tensors a stage serving layers [start, end) loads (what it fetches)."""
        size = self.weights(start, end)
        if start == 0:
            size += self.head_bytes
        if end == self.n_layers:
            size += self.tail_bytes
        return size

    def stage_bytes(self, start: int, end: int) -> int:
        """Memory a stage serving layers [start, end) needs, RAM and GPU together."""
        size = self.weights(start, end) + (end - start) * self.kv_bytes_per_layer
        if start == 0:
            size += self.head_bytes
        if end == self.n_layers:
            size += self.tail_bytes
        return size

    def stage_split(self, start: int, end: int, gpu_layers: int) -> tuple[int, int]:
        """(RAM, GPU memory) a stage serving [start, end) needs when it offloads `gpu_layers`."""
        return self.split(end - start, start == 0, end == self.n_layers, gpu_layers,
                          self.weights(start, end), lambda k: self.weights(end - k, end))

    def gpu_layers_within(self, start: int, end: int, gpu_memory: int) -> int:
        """The most layers of [start, end) a stage offloads within ``gpu_memory`` (the output head counting
        as one more at the tail, as the engine's plan does): -1 when they all fit."""
        slots = end - start + (end == self.n_layers)
        if self.stage_split(start, end, -1)[1] <= gpu_memory:
            return -1
        return max((k for k in range(slots) if self.stage_split(start, end, k)[1] <= gpu_memory), default=0)

    def split(self, count: int, head: bool, tail: bool, gpu_layers: int, weights: int,
              last_weights: Callable[[int], int]) -> tuple[int, int]:
        """(RAM, GPU memory) of a stage of `count` layers weighing `weights`, the last k of them `last_weights(k)`.

        As the engine counts: the last layers of the range go to the GPU with their KV, at the tail
        the output head is one more (the last), -1 offloads them all; the token embedding stays in RAM."""
        on_gpu, head_out = offload_plan(count, tail, gpu_layers)
        gpu = last_weights(on_gpu) + on_gpu * self.kv_bytes_per_layer + (self.tail_bytes if head_out else 0)
        ram = weights - last_weights(on_gpu) + (count - on_gpu) * self.kv_bytes_per_layer
        ram += (self.head_bytes if head else 0) + (self.tail_bytes if tail and not head_out else 0)
        return ram, gpu


def offload_plan(count: int, tail: bool, gpu_layers: int) -> tuple[int, bool]:
    """How many of a stage's `count` layers (its last ones) go to the GPU, and whether its output head does.

    The engine's rule: `gpu_layers` counts from the end of the range, at the tail the output head
    is one more (the last); -1, or as many as there are, offloads them all."""
    slots = count + tail
    offload = slots if gpu_layers < 0 else min(gpu_layers, slots)
    head_out = tail and offload > 0
    return offload - head_out, head_out


@dataclass(frozen=True)
class NodeCapacity:
    node_id: str
    memory_bytes: int
    seconds_per_layer: float  # 0 when not measured yet
    gpu_memory_bytes: int = 0
    gpu_layers: int = 0  # layers of its range it offloads, from the range's end; -1: all
    # Layer ranges of the model it holds on disk: serving one of them needs no fetch.
    holds: tuple[Range, ...] = ()

    def fits(self, model: ModelSpec, start: int, end: int) -> bool:
        """Whether layers [start, end) fit this node's RAM and GPU memory."""
        return stage_fits(model, start, end, self.memory_bytes, self.gpu_memory_bytes, self.gpu_layers) is None


def stage_fits(model: ModelSpec, start: int, end: int, memory: int, gpu_memory: int, gpu_layers: int) -> str | None:
    """Why layers [start, end) do not fit this memory (RAM, GPU and the offload), or None when they do."""
    ram, gpu = model.stage_split(start, end, gpu_layers)
    if ram > memory:
        return f"needs {ram} bytes of RAM, this node offers {memory}"
    if gpu > gpu_memory:
        return f"needs {gpu} bytes of GPU memory for its {gpu_layers} offloaded layers, this node offers {gpu_memory}"
    return None


@dataclass(frozen=True)
class Stage:
    node_id: str
    start: int
    end: int

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class AssignmentPolicy:
    # What one more stage costs a token: a network hop (the tracker knows its mesh's RTTs).
    hop_seconds: float = 0.005
    # How many of the fastest and of the largest nodes the exact search considers.
    candidates: int = 24
    # Keep the current placement unless a fresh one costs at most this fraction of it (25% more
    # tokens a second): timing noise and a plan a few per cent better never pay for reloading (and
    # often fetching) every range, which drops the sessions' KV and stalls asks meanwhile.
    keep_ratio: float = 0.8


@dataclass(frozen=True)
class Assignment:
    model: str
    n_layers: int
    boundaries: tuple[int, ...]  # segment cuts, from 0 to n_layers
    stages: tuple[Stage, ...]  # every node's range, at most one per node
    chain: tuple[Stage, ...]  # the fastest chain through them, as a route with `hop_seconds` links
    seconds_per_token: float  # estimated along `chain`: compute plus one hop per stage

    def ranges(self) -> dict[str, Range]:
        return {stage.node_id: (stage.start, stage.end) for stage in self.stages}


class CoverageError(ValueError):
    """The nodes holding a model cannot serve all of its layers."""


def capacities(records: Iterable[CapabilityRecord], digest: str) -> list[NodeCapacity]:
    """The nodes that can serve `digest`: they hold the file or fetch their range of it, stay, and
    are not light clients."""
    return [
        NodeCapacity(record.node_id, record.memory_bytes, record.seconds_per_layer,
                     record.gpu_memory_bytes, record.gpu_layers, held_ranges(record, digest))
        for record in records
        if not record.leaving and ROLE_CLIENT not in record.roles and record.model(digest) is not None
    ]


def held_ranges(record: CapabilityRecord, digest: str) -> tuple[Range, ...]:
    """The layers of `digest` that `record`'s node holds on disk: all of a whole file, or what it fetched."""
    info = record.model(digest)
    if info is not None and info.whole:
        return ((0, info.n_layers),)
    return tuple((held.start, held.end) for held in record.holds if held.model == digest)


def unheld_layers(records: Iterable[CapabilityRecord], digest: str, n_layers: int) -> list[Range]:
    """The layer ranges of `digest` that none of `records` (the live ones) holds on disk: a range
    there can be neither served nor fetched. None where a member fetches the model from the hub
    (its ModelInfo names one): every layer can be fetched from there."""
    held = [False] * n_layers
    for record in records:
        if record.leaving:
            continue
        info = record.model(digest)
        if info is not None and info.hub:
            return []
        for start, end in held_ranges(record, digest):
            held[start:min(end, n_layers)] = [True] * (min(end, n_layers) - start)
    gaps: list[Range] = []
    for layer, ok in enumerate(held):
        if ok:
            continue
        if gaps and gaps[-1][1] == layer:
            gaps[-1] = (gaps[-1][0], layer + 1)
        else:
            gaps.append((layer, layer + 1))
    return gaps


@dataclass(frozen=True)
class _Node:
    node_id: str
    memory: int
    speed: float  # seconds per layer, unmeasured ones estimated
    gpu_memory: int = 0
    gpu_layers: int = 0
    holds: tuple[Range, ...] = ()

    def holds_range(self, start: int, end: int) -> bool:
        return any(a <= start and end <= b for a, b in self.holds)

    @property
    def total(self) -> int:
        """RAM and GPU memory together: what ranks nodes by size."""
        return self.memory + self.gpu_memory

    def fits(self, model: ModelSpec, start: int, end: int) -> bool:
        if self.gpu_layers == 0:  # all in RAM: the tracker's hot path
            return model.stage_bytes(start, end) <= self.memory
        return stage_fits(model, start, end, self.memory, self.gpu_memory, self.gpu_layers) is None

    def cap(self, model: ModelSpec, head: bool, tail: bool) -> int:
        """The most layers it holds as a stage with these ends, every layer at the largest layer's size."""
        if self.gpu_layers == 0:  # all in RAM: one division (the usual case, and the tracker's hot path)
            extra = (model.head_bytes if head else 0) + (model.tail_bytes if tail else 0)
            if model.layer_bytes == 0:  # a record may say its layers weigh nothing: then only the ends count
                return model.n_layers if self.memory >= extra else 0
            return max(0, min(model.n_layers, (self.memory - extra) // model.layer_bytes))

        def fits(count: int) -> bool:
            ram, gpu = model.split(count, head, tail, self.gpu_layers, count * model.bytes_per_layer,
                                   lambda k: k * model.bytes_per_layer)
            return ram <= self.memory and gpu <= self.gpu_memory

        low, high = 0, model.n_layers  # memory only grows with the layers held: bisect
        while low < high:
            middle = (low + high + 1) // 2
            if fits(middle):
                low = middle
            else:
                high = middle - 1
        return low


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
    nodes = _distinct(nodes)
    usable = _usable(nodes, model)
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
    usable = _usable(_distinct(nodes), model)
    present = {node.node_id: node for node in usable}
    if not all(s.node_id in present and present[s.node_id].fits(model, s.start, s.end) for s in previous.stages):
        return None
    placed = {stage.node_id for stage in previous.stages}
    spare = [node for node in usable if node.node_id not in placed]
    stages = _replicate(list(previous.stages), previous.boundaries, spare, model, _speeds(usable), {})
    return _finish(model, previous.boundaries, stages, usable, policy)


def _fresh(
    usable: list[_Node], nodes: Sequence[NodeCapacity], model: ModelSpec, policy: AssignmentPolicy
) -> Assignment:
    chain = _primary_chain(usable, model, policy)
    if chain is None:
        raise CoverageError(_shortfall(nodes, model, policy))
    boundaries = (0,) + tuple(stage.end for stage in chain)
    used = {stage.node_id for stage in chain}
    spare = [node for node in usable if node.node_id not in used]
    stages = _replicate(chain, boundaries, spare, model, _speeds(usable), {})
    return _finish(model, boundaries, stages, usable, policy)


def _distinct(nodes: Sequence[NodeCapacity]) -> list[NodeCapacity]:
    return list({node.node_id: node for node in nodes}.values())


def _usable(nodes: Sequence[NodeCapacity], model: ModelSpec) -> list[_Node]:
    """The nodes that can hold a layer, fastest first."""
    measured = [node.seconds_per_layer for node in nodes if node.seconds_per_layer > 0]
    # An unmeasured node is taken to be typical of the mesh, neither favoured nor shunned.
    default_speed = statistics.median(measured) if measured else 1e-3
    candidates = (
        _Node(node.node_id, node.memory_bytes, node.seconds_per_layer or default_speed,
              node.gpu_memory_bytes, node.gpu_layers, node.holds)
        for node in nodes
    )
    return sorted(
        (node for node in candidates if _holds_a_piece(node, model)),
        key=lambda node: (node.speed, -node.total, node.node_id),
    )


def _holds_a_piece(node: _Node, model: ModelSpec) -> bool:
    """Whether the node holds the smallest range a stage of `model` may serve: a layer, or where
    the model may be cut only at some layers, one of the pieces between them."""
    if model.cuts is None:
        return node.cap(model, False, False) >= 1
    return any(end - start <= node.cap(model, start == 0, end == model.n_layers) for start, end in _fewest_pieces(model))


def _fewest_pieces(model: ModelSpec) -> list[Range]:
    """The shortest piece of each kind (head, middle, tail, the whole): if a node holds none of these, it
    holds no piece, since what it holds depends only on a piece's length and ends."""
    shortest: dict[tuple[bool, bool], Range] = {}
    for start, end in model.pieces():
        kind = (start == 0, end == model.n_layers)
        if kind not in shortest or end - start < shortest[kind][1] - shortest[kind][0]:
            shortest[kind] = (start, end)
    return list(shortest.values())


def _primary_chain(usable: list[_Node], model: ModelSpec, policy: AssignmentPolicy) -> list[Stage] | None:
    if model.cuts is not None:
        return _best_cut_chain(_candidates(usable, policy.candidates), model, policy.hop_seconds) or \
            _greedy_cover(sorted(usable, key=lambda node: (-node.total, node.speed)), model, 0, model.n_layers)
    chain = _best_chain(_candidates(usable, policy.candidates), model, policy.hop_seconds)
    if chain is None:
        # The candidates alone fall short (many small nodes): take everyone, largest first.
        chain = _greedy_cover(
            sorted(usable, key=lambda node: (-node.total, node.speed)), model, 0, model.n_layers
        )
    return chain


def _repair(
    current: Assignment, usable: list[_Node], model: ModelSpec, policy: AssignmentPolicy,
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
        if _tiles(Counter(inside), start, end):
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


def _host_segment(spare: list[_Node], model: ModelSpec, start: int, end: int,
                  returning: Mapping[str, Range]) -> list[Stage] | None:
    """The spare node to take the whole segment: one that had it before it left, else one that holds
    its layers on disk, else the fastest (a holder needs no fetch); or else a group of them."""
    fitting = [node for node in spare if node.fits(model, start, end)]  # fastest first
    if fitting:
        chosen = min(fitting, key=lambda node: (returning.get(node.node_id) != (start, end),
                                                not node.holds_range(start, end)))  # stable: fastest first
        return [Stage(chosen.node_id, start, end)]
    return _greedy_cover(sorted(spare, key=lambda node: (-node.total, node.speed)), model, start, end)


def _copies(stages: Sequence[Stage], start: int, end: int) -> int:
    """How many times `stages` host every layer of the segment [start, end): its least covered layer's count."""
    return min(_depths((s for s in stages if start <= s.start and s.end <= end), end)[start:end])


def _movable_replica(stages: Sequence[Stage], segments: Sequence[Range], model: ModelSpec,
                     present: Mapping[str, _Node], target: Range, least_copies: int) -> str | None:
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
               present: Mapping[str, _Node]) -> list[Stage]:
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
    spare: list[_Node],
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
    leftover: list[_Node] = []
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
        group = _greedy_cover(leftover, model, start, end)
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


def _speeds(usable: list[_Node]) -> dict[str, float]:
    return {node.node_id: node.speed for node in usable}


def _finish(
    model: ModelSpec,
    boundaries: tuple[int, ...],
    stages: list[Stage],
    usable: list[_Node],
    policy: AssignmentPolicy,
) -> Assignment:
    speed = _speeds(usable)
    options = [StageOption(stage.node_id, stage.start, stage.end, speed[stage.node_id]) for stage in stages]
    route = plan_route(options, model.n_layers, rtt=lambda a, b: 0.0 if a is None else policy.hop_seconds)
    chain = tuple(Stage(option.node_id, option.start, option.end) for option in route.stages)
    return Assignment(
        model.digest, model.n_layers, boundaries, tuple(stages), chain, route.seconds + policy.hop_seconds
    )


def _candidates(usable: list[_Node], count: int) -> list[_Node]:
    """The fastest and the largest nodes: the only ones a cheapest chain is likely to use."""
    largest = sorted(usable, key=lambda node: (-node.total, node.speed, node.node_id))[:count]
    chosen = {node.node_id: node for node in usable[:count]}  # usable is sorted fastest first
    chosen.update((node.node_id, node) for node in largest)
    return sorted(chosen.values(), key=lambda node: (node.speed, -node.total, node.node_id))


_MID, _HEAD, _TAIL = 0, 1, 2


def _best_chain(nodes: list[_Node], model: ModelSpec, hop: float) -> list[Stage] | None:
    """The chain over [0, n) of least compute + hop cost, each node used at most once.

    0/1 knapsack over layer counts: state (has head, has tail, layers placed);
    a node hosts l layers as the head, the tail or a middle stage, at cost
    l x speed + hop. Positions come afterwards: head, middles, tail."""
    n = model.n_layers
    best_single = None
    for node in nodes:
        if node.fits(model, 0, n):
            cost = n * node.speed + hop
            if best_single is None or cost < best_single[0]:
                best_single = (cost, node)
    layers = np.arange(n + 1, dtype=np.float64)
    # state index: 2 * has_head + has_tail
    dp = np.full((4, n + 1), np.inf)
    dp[0, 0] = 0.0
    history: list[tuple[np.ndarray, np.ndarray]] = []  # per node: (source state, layers taken)
    for node in nodes:
        caps = {
            _MID: node.cap(model, False, False),
            _HEAD: node.cap(model, True, False),
            _TAIL: node.cap(model, False, True),
        }
        new = dp.copy()
        source = np.full((4, n + 1), -1, dtype=np.int8)
        taken = np.zeros((4, n + 1), dtype=np.int32)
        for state in range(4):
            row = dp[state]
            if not np.isfinite(row).any():
                continue
            has_head, has_tail = state >> 1, state & 1
            roles = [(_MID, state)]
            if not has_head:
                roles.append((_HEAD, state | 2))
            if not has_tail:
                roles.append((_TAIL, state | 1))
            shifted = row - layers * node.speed
            for role, target in roles:
                cap = int(min(caps[role], n))
                if cap < 1:
                    continue
                # new[L] = min over j in [L - cap, L - 1] of row[j] + (L - j) * speed + hop
                padded = np.concatenate((np.full(cap - 1, np.inf), shifted))
                windows = sliding_window_view(padded, cap)[:n]
                best_j = windows.argmin(axis=1) + np.arange(n) - (cap - 1)
                candidate = windows.min(axis=1) + layers[1:] * node.speed + hop
                better = candidate < new[target, 1:]
                if better.any():
                    new[target, 1:][better] = candidate[better]
                    source[target, 1:][better] = state
                    taken[target, 1:][better] = (np.arange(1, n + 1) - best_j)[better]
        history.append((source, taken))
        dp = new
    multi_cost = dp[3, n]
    if best_single is not None and best_single[0] <= multi_cost:
        return [Stage(best_single[1].node_id, 0, n)]
    if not np.isfinite(multi_cost):
        return None
    # Walk the choices back: which node took how many layers in which role.
    placed: list[tuple[int, _Node, int]] = []
    state, count = 3, n
    for node, (source, taken) in zip(reversed(nodes), reversed(history), strict=False):
        previous = int(source[state, count])
        if previous < 0:
            continue
        layers_taken = int(taken[state, count])
        role = _HEAD if (previous ^ state) == 2 else _TAIL if (previous ^ state) == 1 else _MID
        placed.append((role, node, layers_taken))
        state, count = previous, count - layers_taken
    order = {_HEAD: 0, _MID: 1, _TAIL: 2}
    placed.sort(key=lambda item: (order[item[0]], item[1].speed, item[1].node_id))
    chain, position = [], 0
    for _, node, layers_taken in placed:
        chain.append(Stage(node.node_id, position, position + layers_taken))
        position += layers_taken
    return chain


def _greedy_cover(nodes: list[_Node], model: ModelSpec, start: int, end: int) -> list[Stage] | None:
    """Cover [start, end) with the fewest of `nodes` (sorted largest first), layers spread evenly.

    The largest node takes the embedding if the range starts at layer 0, the next
    largest the output head if it ends at the last layer. Where the model may be cut only
    at some layers, the fewest nodes that cover it cut there."""
    if model.cuts is not None:
        found = _first_cut_chain(_orders(nodes), model, start, end)
        return found[1] if found is not None else _every_cover(nodes, model, start, end)
    need_head, need_tail = start == 0, end == model.n_layers
    length = end - start
    if nodes and nodes[0].fits(model, start, end):
        return [Stage(nodes[0].node_id, start, end)]
    chosen: list[tuple[_Node, int]] = []  # (node, layers it can hold in its role)
    total = 0
    for node in nodes:
        as_head = need_head and not chosen
        as_tail = not as_head and need_tail and len(chosen) == (1 if need_head else 0)
        cap = min(node.cap(model, as_head, as_tail), length)
        if cap < 1:
            if as_head or as_tail:
                return None  # the largest remaining node cannot take the head or tail: none can
            continue
        chosen.append((node, cap))
        total += cap
        if total >= length and len(chosen) >= 2:
            break
    # Every stage needs a layer of its own: one layer cannot be split between
    # a head and a tail that no single node can hold together.
    if total < length or not 2 <= len(chosen) <= length:
        return None
    # Water-filling, smallest capacity first: each gets an even share of what is left, or its fill.
    share: dict[str, int] = {}
    left = length
    for position, (node, cap) in enumerate(sorted(chosen, key=lambda item: item[1])):
        share[node.node_id] = min(cap, left // (len(chosen) - position))
        left -= share[node.node_id]
    order = [node for node, _ in chosen]
    if need_tail:
        tail = order.pop(1 if need_head else 0)
        order.append(tail)
    stages, position = [], start
    for node in order:
        stages.append(Stage(node.node_id, position, position + share[node.node_id]))
        position += share[node.node_id]
    return stages


def _orders(nodes: list[_Node]) -> list[list[_Node]]:
    """The orders a chain at the model's cuts tries its nodes in, which is their order along the chain:
    as given, and largest first with each of the three largest in front (the head's embedding and the
    piece after it differ in size, so the largest node is not always best at the head); and each of
    these with its largest remaining node last, for the output head."""
    largest = sorted(nodes, key=lambda node: (-node.total, node.speed, node.node_id))
    fronts = [[front] + [node for node in largest if node is not front] for front in largest[:3]]
    orders = [nodes, *fronts, *(order[:1] + order[2:] + order[1:2] for order in fronts if len(order) > 2)]
    return list({tuple(node.node_id for node in order): order for order in orders}.values())


def _best_cut_chain(nodes: list[_Node], model: ModelSpec, hop: float) -> list[Stage] | None:
    """The cheapest of the chains over every layer cut only where the model allows, in each of `_orders`."""
    found = [chain for order in _orders(nodes) if (chain := _cut_chain(order, model, 0, model.n_layers, hop))]
    return min(found, key=lambda chain: chain[0])[1] if found else None


def _first_cut_chain(orders: list[list[_Node]], model: ModelSpec, start: int, end: int
                     ) -> tuple[float, list[Stage]] | None:
    """The chain of fewest stages over [start, end), cut only where the model allows, of each of `orders`."""
    found = [chain for order in orders if (chain := _cut_chain(order, model, start, end, 1.0, fewest=True))]
    return min(found, key=lambda chain: chain[0]) if found else None


# The most allowed cuts inside a range for which `_every_cover` tries every way of cutting it (2**8).
_EVERY_COVER_CUTS = 8


def _every_cover(nodes: list[_Node], model: ModelSpec, start: int, end: int) -> list[Stage] | None:
    """The fewest of `nodes` covering [start, end) at allowed cuts, trying every way of cutting it: what
    `_cut_chain`'s orders can miss (one node too large for the head and too small for the piece after it
    may be needed there), where the cuts are few enough to try them all; None where none covers it."""
    inner = model.points(start, end)[1:-1]
    if len(inner) > _EVERY_COVER_CUTS:
        return None
    by_size = sorted(nodes, key=lambda node: (node.total, node.speed, node.node_id))
    for count in range(min(len(inner), len(nodes) - 1) + 1):
        for chosen in itertools.combinations(inner, count):
            points = [start, *chosen, end]
            # the piece needing most takes the smallest node that holds it, and so on down
            pieces = sorted(zip(points, points[1:], strict=False), key=lambda piece: -model.stage_bytes(*piece))
            free, stages = list(by_size), []
            for piece in pieces:
                host = next((node for node in free if node.fits(model, *piece)), None)
                if host is None:
                    break
                free.remove(host)
                stages.append(Stage(host.node_id, *piece))
            else:
                return sorted(stages, key=lambda stage: stage.start)
    return None


def _cut_chain(nodes: list[_Node], model: ModelSpec, start: int, end: int, hop: float,
               fewest: bool = False) -> tuple[float, list[Stage]] | None:
    """(cost, stages) of the cheapest chain over [start, end) whose every stage starts and ends where
    the model may be cut, the nodes along the chain in the order given, each used at most once.

    A shortest path over the cut points, one node at a time (a 0/1 choice each, as `_best_chain`):
    dp[j] is the least cost of covering [start, points[j]), and a node takes [points[i], points[j])
    when its length is within what the node holds with those ends, every layer at the largest
    layer's size, so what it places fits. Cost: layers x seconds per layer + `hop` a stage; with
    `fewest`, `hop` a stage alone."""
    points = np.array(model.points(start, end), dtype=np.int64)
    m = len(points)
    length = points[None, :] - points[:, None]  # of the range [points[i], points[j])
    from_head = (points == 0)[:, None]  # the range starts at the model's first layer: the embedding
    to_tail = (points == model.n_layers)[None, :]  # ends at its last: the output head
    dp = np.full(m, np.inf)
    dp[0] = 0.0
    history: list[np.ndarray] = []  # per node: the point it took its range from, -1 where it took none
    for node in nodes:
        speed = 0.0 if fewest else node.speed
        caps = {(h, t): node.cap(model, h, t) for h in (False, True) for t in (False, True)}
        cap = np.where(from_head, np.where(to_tail, caps[True, True], caps[True, False]),
                       np.where(to_tail, caps[False, True], caps[False, False]))
        cost = np.where((length >= 1) & (length <= cap), dp[:, None] + length * speed + hop, np.inf)
        best = cost.argmin(axis=0)
        candidate = cost[best, np.arange(m)]
        better = candidate < dp
        history.append(np.where(better, best, -1))
        dp = np.where(better, candidate, dp)
    if not np.isfinite(dp[-1]):
        return None
    stages: list[Stage] = []
    position = m - 1
    for node, source in zip(reversed(nodes), reversed(history), strict=True):
        if position > 0 and source[position] >= 0:
            stages.append(Stage(node.node_id, int(points[source[position]]), int(points[position])))
            position = int(source[position])
    stages.reverse()
    return float(dp[-1]), stages


def _tiles(ranges: Counter[Range], start: int, end: int) -> bool:
    """Whether some of `ranges` meet end to end from `start` to `end`."""
    following: dict[int, list[int]] = defaultdict(list)
    for range_start, range_end in ranges:
        following[range_start].append(range_end)
    reached, frontier = {start}, [start]
    while frontier:
        for nxt in following.get(frontier.pop(), ()):
            if nxt == end:
                return True
            if nxt not in reached and nxt < end:
                reached.add(nxt)
                frontier.append(nxt)
    return start == end


def _covers(nodes: Sequence[NodeCapacity], model: ModelSpec, policy: AssignmentPolicy) -> bool:
    return _primary_chain(_usable(nodes, model), model, policy) is not None


def coverage_shortfall(
    nodes: Sequence[NodeCapacity], model: ModelSpec, policy: AssignmentPolicy = AssignmentPolicy()
) -> str | None:
    """Why `nodes` cannot cover `model` and which flag would change that, or None when they can."""
    nodes = _distinct(nodes)
    if nodes and _covers(nodes, model, policy):
        return None
    return _shortfall(nodes, model, policy)


def _shortfall(nodes: Sequence[NodeCapacity], model: ModelSpec, policy: AssignmentPolicy) -> str:
    """Memory needed (weights plus KV at the volunteers' session budget) against memory offered,
    what of the model that holds, and the smallest change of flags that would cover it."""
    if not nodes:
        return "no member volunteers the model"
    n = model.n_layers
    weights = n * model.bytes_per_layer + model.head_bytes + model.tail_bytes
    kv = n * model.kv_bytes_per_layer
    memories = sorted(node.memory_bytes for node in nodes)
    count = f"{len(nodes)} volunteer{'s' if len(nodes) != 1 else ''}"
    if memories[0] == memories[-1]:
        offered = f"{len(nodes)} × {_mib(memories[0])}" if len(nodes) > 1 else _mib(memories[0])
    else:
        offered = f"{_mib(sum(memories))} in all (the largest {_mib(memories[-1])})"
    tokens_text = f" ({model.kv_tokens:,} tokens a stage: --max-sessions × --session-tokens)" \
        if model.kv_tokens else ""
    kv_text = f" + {_mib(kv)} of KV{tokens_text}" if kv else ""
    layer = f"a layer takes {_mib(model.bytes_per_layer)}" + \
        (f" + {_mib(model.kv_bytes_per_layer)} of KV" if kv else "")
    need, total = weights + kv, sum(memories)
    if memories[-1] < model.layer_bytes:
        what = f", none of which holds one layer ({layer})"
    elif total < need:
        what = f" ({_mib(need - total)} short)"
    elif _layers_held(memories, model) < n:
        what = (f", which hold {_layers_held(memories, model)} of its {n} layers once the first stage takes the "
                f"token embedding ({_mib(model.head_bytes)}) and the last the output head "
                f"({_mib(model.tail_bytes)}); {layer}")
    elif memories[-1] < model.head_bytes + model.layer_bytes:
        what = f", none of which holds the first stage: the token embedding ({_mib(model.head_bytes)}) and a layer"
    elif len(memories) < 2 or memories[-2] < model.tail_bytes + model.layer_bytes:
        what = (f", and the one that holds the token embedding ({_mib(model.head_bytes)}) cannot hold the output "
                f"head too: no other holds the last stage ({_mib(model.tail_bytes)} and a layer)")
    else:
        what = f", which no arrangement fits ({layer}; the embedding {_mib(model.head_bytes)}, the output head " \
            f"{_mib(model.tail_bytes)})"
    if model.cuts is not None:
        rule = f"it may be cut only before layer{'s' if len(model.cuts) != 1 else ''} {_listing(model.cuts)}" \
            if model.cuts else "it may not be cut"
        start, end = min(model.pieces(), key=lambda piece: model.stage_bytes(*piece))
        smallest = model.stage_bytes(start, end)
        if memories[-1] < smallest:
            what = f", none of which holds the smallest piece it may be cut into (layers {start}:{end}, " \
                f"{_mib(smallest)}: {rule})"
        else:
            what += f"; {rule}"
    fixes = []
    memory = _memory_to_cover(nodes, model, policy)
    fixes.append(f"raise --memory to {_flag_size(memory)} on each volunteer")
    tokens = _kv_to_cover(nodes, model, policy)
    if tokens is not None:
        fixes.append(f"lower --max-sessions × --session-tokens to {tokens:,} tokens or fewer")
    fixes.append("add volunteers")
    return (f"the model needs {_mib(weights)} of weights{kv_text} but the {count} offer {offered}{what}; "
            + ", or ".join([", ".join(fixes[:-1]), fixes[-1]] if len(fixes) > 2 else fixes))


def _layers_held(memories: list[int], model: ModelSpec) -> int:
    """Layers the volunteers hold together, the largest taking the embedding and the next the output head."""
    extras = [model.head_bytes, model.tail_bytes]
    held = 0
    for memory in sorted(memories, reverse=True):
        extra = extras.pop(0) if extras else 0
        held += max(0, memory - extra) // max(1, model.layer_bytes)
    return held


def _memory_to_cover(nodes: Sequence[NodeCapacity], model: ModelSpec, policy: AssignmentPolicy) -> int:
    """The least --memory (in whole MiB) that, given to every volunteer with less, covers the model."""
    def covers_with(mib: int) -> bool:
        raised = [replace(node, memory_bytes=max(node.memory_bytes, mib << 20)) for node in nodes]
        return _covers(raised, model, policy)

    # One node with the whole model's bytes covers it on its own: the search is bounded.
    low, high = 0, -(-model.stage_bytes(0, model.n_layers) // (1 << 20))
    while low + 1 < high:
        middle = (low + high) // 2
        if covers_with(middle):
            high = middle
        else:
            low = middle
    return high << 20


def _kv_to_cover(nodes: Sequence[NodeCapacity], model: ModelSpec, policy: AssignmentPolicy) -> int | None:
    """The most KV tokens a stage can hold with the memory offered and the model covered;
    None when a smaller session budget would not help (no KV, or none fits even without KV)."""
    if model.kv_tokens < 1 or not _covers(nodes, model.with_kv_tokens(1), policy):
        return None
    low, high = 1, model.kv_tokens  # covers at `low`, not at `high`
    while low + 1 < high:
        middle = (low + high) // 2
        if _covers(nodes, model.with_kv_tokens(middle), policy):
            low = middle
        else:
            high = middle
    return low


def _listing(numbers: Sequence[int], most: int = 8) -> str:
    """`numbers` in words: "2, 5 and 7"; past `most`, the first of them, the last and how many."""
    if len(numbers) == 1:
        return str(numbers[0])
    if len(numbers) > most:
        return f"{', '.join(map(str, numbers[:most - 1]))}, … and {numbers[-1]} ({len(numbers)} in all)"
    return f"{', '.join(map(str, numbers[:-1]))} and {numbers[-1]}"


def _mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB" if size < 2**30 else f"{size / 2**30:,.1f} GiB"


def _flag_size(size: int) -> str:
    """A --memory value of at least `size`: whole MiB, or tenths of a GiB from 1 GiB on."""
    mib = -(-size // (1 << 20))
    return f"{mib}M" if mib < 1024 else f"{-(-mib * 10 // 1024) / 10:g}G"

