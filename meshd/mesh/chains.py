"""The chain search placement runs: the cheapest chain of hosts over a model's layers (an exact
knapsack over the most promising nodes), a greedy cover of one segment by small nodes, and, for a
model that may be cut only at some layers, the search over its cut points."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from meshd.mesh.assignment import AssignmentPolicy, ModelSpec, NodeCapacity, Range, Stage, stage_fits


@dataclass(frozen=True)
class Host:
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



def distinct(nodes: Sequence[NodeCapacity]) -> list[NodeCapacity]:
    return list({node.node_id: node for node in nodes}.values())


def usable_hosts(nodes: Sequence[NodeCapacity], model: ModelSpec) -> list[Host]:
    """The nodes that can hold a layer, fastest first."""
    measured = [node.seconds_per_layer for node in nodes if node.seconds_per_layer > 0]
    # An unmeasured node is taken to be typical of the mesh, neither favoured nor shunned.
    default_speed = statistics.median(measured) if measured else 1e-3
    candidates = (
        Host(node.node_id, node.memory_bytes, node.seconds_per_layer or default_speed,
              node.gpu_memory_bytes, node.gpu_layers, node.holds)
        for node in nodes
    )
    return sorted(
        (node for node in candidates if _holds_a_piece(node, model)),
        key=lambda node: (node.speed, -node.total, node.node_id),
    )


def _holds_a_piece(node: Host, model: ModelSpec) -> bool:
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


def primary_chain(usable: list[Host], model: ModelSpec, policy: AssignmentPolicy) -> list[Stage] | None:
    if model.cuts is not None:
        return best_cut_chain(_candidates(usable, policy.candidates), model, policy.hop_seconds) or \
            greedy_cover(sorted(usable, key=lambda node: (-node.total, node.speed)), model, 0, model.n_layers)
    chain = best_chain(_candidates(usable, policy.candidates), model, policy.hop_seconds)
    if chain is None:
        # The candidates alone fall short (many small nodes): take everyone, largest first.
        chain = greedy_cover(
            sorted(usable, key=lambda node: (-node.total, node.speed)), model, 0, model.n_layers
        )
    return chain


def _candidates(usable: list[Host], count: int) -> list[Host]:
    """The fastest and the largest nodes: the only ones a cheapest chain is likely to use."""
    largest = sorted(usable, key=lambda node: (-node.total, node.speed, node.node_id))[:count]
    chosen = {node.node_id: node for node in usable[:count]}  # usable is sorted fastest first
    chosen.update((node.node_id, node) for node in largest)
    return sorted(chosen.values(), key=lambda node: (node.speed, -node.total, node.node_id))


_MID, _HEAD, _TAIL = 0, 1, 2


def best_chain(nodes: list[Host], model: ModelSpec, hop: float) -> list[Stage] | None:
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
    placed: list[tuple[int, Host, int]] = []
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


def greedy_cover(nodes: list[Host], model: ModelSpec, start: int, end: int) -> list[Stage] | None:
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
    chosen: list[tuple[Host, int]] = []  # (node, layers it can hold in its role)
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


def _orders(nodes: list[Host]) -> list[list[Host]]:
    """The orders a chain at the model's cuts tries its nodes in, which is their order along the chain:
    as given, and largest first with each of the three largest in front (the head's embedding and the
    piece after it differ in size, so the largest node is not always best at the head); and each of
    these with its largest remaining node last, for the output head."""
    largest = sorted(nodes, key=lambda node: (-node.total, node.speed, node.node_id))
    fronts = [[front] + [node for node in largest if node is not front] for front in largest[:3]]
    orders = [nodes, *fronts, *(order[:1] + order[2:] + order[1:2] for order in fronts if len(order) > 2)]
    return list({tuple(node.node_id for node in order): order for order in orders}.values())


def best_cut_chain(nodes: list[Host], model: ModelSpec, hop: float) -> list[Stage] | None:
    """The cheapest of the chains over every layer cut only where the model allows, in each of `_orders`."""
    found = [chain for order in _orders(nodes) if (chain := _cut_chain(order, model, 0, model.n_layers, hop))]
    return min(found, key=lambda chain: chain[0])[1] if found else None


def _first_cut_chain(orders: list[list[Host]], model: ModelSpec, start: int, end: int
                     ) -> tuple[float, list[Stage]] | None:
    """The chain of fewest stages over [start, end), cut only where the model allows, of each of `orders`."""
    found = [chain for order in orders if (chain := _cut_chain(order, model, start, end, 1.0, fewest=True))]
    return min(found, key=lambda chain: chain[0]) if found else None


# The most allowed cuts inside a range for which `_every_cover` tries every way of cutting it (2**8).
_EVERY_COVER_CUTS = 8


def _every_cover(nodes: list[Host], model: ModelSpec, start: int, end: int) -> list[Stage] | None:
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


def _cut_chain(nodes: list[Host], model: ModelSpec, start: int, end: int, hop: float,
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


def tiles(ranges: Counter[Range], start: int, end: int) -> bool:
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
