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
3. Given the current assignment, nodes keep their ranges (only departed hosts
   are replaced and newcomers become replicas) unless a fresh plan would be
   faster by a clear margin: a layer range is expensive to move.

A node's memory must hold its weights and the KV cache of its layers for the
planned context and sessions. Each volunteer moves to its new range itself,
loading it before it releases the old one, so sessions in flight keep a route.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from meshd.mesh.records import ROLE_CLIENT, CapabilityRecord, ModelInfo
from meshd.mesh.routing import StageOption, plan_route

Range = tuple[int, int]


@dataclass(frozen=True)
class ModelSpec:
    """What placement needs to know of a model, with the KV budget already chosen."""

    digest: str
    n_layers: int
    bytes_per_layer: int
    kv_bytes_per_layer: int = 0  # KV cache of one layer for the planned context x sessions
    head_bytes: int = 0  # token embedding, at the stage owning layer 0
    tail_bytes: int = 0  # output norm and LM head, at the stage owning the last layer

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
        )

    @property
    def layer_bytes(self) -> int:
        return self.bytes_per_layer + self.kv_bytes_per_layer

    def stage_bytes(self, start: int, end: int) -> int:
        """Memory a stage serving layers [start, end) needs."""
        size = (end - start) * self.layer_bytes
        if start == 0:
            size += self.head_bytes
        if end == self.n_layers:
            size += self.tail_bytes
        return size


@dataclass(frozen=True)
class NodeCapacity:
    node_id: str
    memory_bytes: int
    seconds_per_layer: float  # 0 when not measured yet


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
    # Keep the current placement unless a fresh one costs at most this fraction of it.
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
    """The nodes that can serve `digest`: they hold the file, stay, and are not light clients."""
    return [
        NodeCapacity(record.node_id, record.memory_bytes, record.seconds_per_layer)
        for record in records
        if not record.leaving and ROLE_CLIENT not in record.roles and record.model(digest) is not None
    ]


@dataclass(frozen=True)
class _Node:
    node_id: str
    memory: int
    speed: float  # seconds per layer, unmeasured ones estimated


def assign(
    nodes: Sequence[NodeCapacity],
    model: ModelSpec,
    policy: AssignmentPolicy = AssignmentPolicy(),
    current: Assignment | None = None,
) -> Assignment:
    """Place `model` on `nodes`; with `current`, move as little as is worth it.

    Raises CoverageError when the nodes cannot hold every layer."""
    # One entry per node (the last wins), or a node could be given two ranges.
    nodes = list({node.node_id: node for node in nodes}.values())
    measured = [node.seconds_per_layer for node in nodes if node.seconds_per_layer > 0]
    # An unmeasured node is taken to be typical of the mesh, neither favoured nor shunned.
    default_speed = statistics.median(measured) if measured else 1e-3
    usable = sorted(
        (
            _Node(node.node_id, node.memory_bytes, node.seconds_per_layer or default_speed)
            for node in nodes
            if node.memory_bytes >= model.layer_bytes
        ),
        key=lambda node: (node.speed, -node.memory, node.node_id),
    )
    kept = None
    if current is not None and current.model == model.digest and current.n_layers == model.n_layers:
        kept = _repair(current, usable, model, policy)
    try:
        fresh = _fresh(usable, nodes, model, policy)
    except CoverageError:
        if kept is None:
            raise
        return kept
    if kept is None or fresh.seconds_per_token < policy.keep_ratio * kept.seconds_per_token:
        return fresh
    return kept


def _fresh(
    usable: list[_Node], nodes: Sequence[NodeCapacity], model: ModelSpec, policy: AssignmentPolicy
) -> Assignment:
    chain = _best_chain(_candidates(usable, policy.candidates), model, policy.hop_seconds)
    if chain is None:
        # The candidates alone fall short (many small nodes): take everyone, largest first.
        chain = _greedy_cover(
            sorted(usable, key=lambda node: (-node.memory, node.speed)), model, 0, model.n_layers
        )
    if chain is None:
        raise CoverageError(_shortfall(nodes, model))
    boundaries = (0,) + tuple(stage.end for stage in chain)
    used = {stage.node_id for stage in chain}
    spare = [node for node in usable if node.node_id not in used]
    stages = _replicate(chain, boundaries, spare, model, _speeds(usable))
    return _finish(model, boundaries, stages, usable, policy)


def _repair(
    current: Assignment, usable: list[_Node], model: ModelSpec, policy: AssignmentPolicy
) -> Assignment | None:
    present = {node.node_id: node for node in usable}
    boundaries = current.boundaries
    segments = list(zip(boundaries, boundaries[1:], strict=False))
    kept = [
        stage
        for stage in current.stages
        if stage.node_id in present
        and model.stage_bytes(stage.start, stage.end) <= present[stage.node_id].memory
        and any(start <= stage.start and stage.end <= end for start, end in segments)
    ]
    used = {stage.node_id for stage in kept}
    spare = [node for node in usable if node.node_id not in used]
    for start, end in segments:
        inside = [(stage.start, stage.end) for stage in kept if start <= stage.start and stage.end <= end]
        if _tiles(Counter(inside), start, end):
            continue
        group = _host_segment(spare, model, start, end)
        if group is None:
            return None
        kept.extend(group)
        taken = {stage.node_id for stage in group}
        spare = [node for node in spare if node.node_id not in taken]
    return _finish(
        model, boundaries, _replicate(kept, boundaries, spare, model, _speeds(usable)), usable, policy
    )


def _host_segment(spare: list[_Node], model: ModelSpec, start: int, end: int) -> list[Stage] | None:
    """The fastest spare node that holds the whole segment, or else a group of them."""
    need = model.stage_bytes(start, end)
    for node in spare:  # fastest first
        if node.memory >= need:
            return [Stage(node.node_id, start, end)]
    return _greedy_cover(sorted(spare, key=lambda node: (-node.memory, node.speed)), model, start, end)


def _replicate(
    stages: list[Stage],
    boundaries: tuple[int, ...],
    spare: list[_Node],
    model: ModelSpec,
    speed: Mapping[str, float],
) -> list[Stage]:
    """Give each spare node (fastest first) a replica of the weakest segment it can hold."""
    stages = list(stages)
    segments = list(zip(boundaries, boundaries[1:], strict=False))
    strength = [0.0] * len(segments)

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
        fits = [i for i in by_need if need[i] <= node.memory]
        if not fits:
            leftover.append(node)
            continue
        index = min(fits, key=lambda i: (strength[i], i))
        start, end = segments[index]
        stages.append(Stage(node.node_id, start, end))
        strength[index] += 1.0 / ((end - start) * node.speed)
    # Nodes too small for any segment on their own cover one together, weakest segment first.
    leftover.sort(key=lambda node: (-node.memory, node.speed))
    open_segments = set(range(len(segments)))
    while leftover and open_segments:
        index = min(open_segments, key=lambda i: (strength[i], i))
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
    largest = sorted(usable, key=lambda node: (-node.memory, node.speed, node.node_id))[:count]
    chosen = {node.node_id: node for node in usable[:count]}  # usable is sorted fastest first
    chosen.update((node.node_id, node) for node in largest)
    return sorted(chosen.values(), key=lambda node: (node.speed, -node.memory, node.node_id))


_MID, _HEAD, _TAIL = 0, 1, 2


def _best_chain(nodes: list[_Node], model: ModelSpec, hop: float) -> list[Stage] | None:
    """The chain over [0, n) of least compute + hop cost, each node used at most once.

    0/1 knapsack over layer counts: state (has head, has tail, layers placed);
    a node hosts l layers as the head, the tail or a middle stage, at cost
    l x speed + hop. Positions come afterwards: head, middles, tail."""
    n = model.n_layers
    per_layer = model.layer_bytes
    best_single = None
    for node in nodes:
        if node.memory >= model.stage_bytes(0, n):
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
            _MID: node.memory // per_layer,
            _HEAD: (node.memory - model.head_bytes) // per_layer,
            _TAIL: (node.memory - model.tail_bytes) // per_layer,
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
    largest the output head if it ends at the last layer."""
    need_head, need_tail = start == 0, end == model.n_layers
    length = end - start
    if nodes and nodes[0].memory >= model.stage_bytes(start, end):
        return [Stage(nodes[0].node_id, start, end)]
    chosen: list[tuple[_Node, int]] = []  # (node, layers it can hold in its role)
    total = 0
    for node in nodes:
        extra = 0
        if need_head and not chosen:
            extra = model.head_bytes
        elif need_tail and len(chosen) == (1 if need_head else 0):
            extra = model.tail_bytes
        cap = min((node.memory - extra) // model.layer_bytes, length)
        if cap < 1:
            if extra:
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


def _shortfall(nodes: Sequence[NodeCapacity], model: ModelSpec) -> str:
    need = model.stage_bytes(0, model.n_layers)
    total = sum(node.memory_bytes for node in nodes)
    if not nodes:
        return f"no member holds model {model.digest}"
    held_by = f"the {len(nodes)} node(s) holding it offer {_gib(total)}"
    if total < need:
        return (
            f"model {model.digest} cannot be covered: its {model.n_layers} layers need {_gib(need)} "
            f"(weights + KV + embedding and output head), {held_by}"
        )
    largest = max(node.memory_bytes for node in nodes)
    return (
        f"model {model.digest} cannot be covered: {held_by} but no arrangement fits "
        f"(largest node {_gib(largest)}; a layer needs {_gib(model.layer_bytes)}, "
        f"the head {_gib(model.head_bytes)}, the tail {_gib(model.tail_bytes)})"
    )


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
