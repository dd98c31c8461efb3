"""Route planning: the cheapest chain of served stages that carries a token through every layer.

A route uses each stage for its whole range, and consecutive stages must meet
exactly (one ends at the layer where the next starts), so a route tiles
[0, n_layers). Its cost is what one decoded token pays: each stage's compute
time, (end - start) x seconds per layer x (1 + load), plus the round-trip time
of every link it crosses, from the asker to the head and between stages.

The search is Dijkstra over (layer boundary, node we arrived from): the link
cost of the next hop depends on where the previous stage runs. Any node can
plan a route from the records in its own membership view.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from meshd.mesh.records import CapabilityRecord

# RTT in seconds between two nodes; the first is None for an asker that did not say who it is.
Rtt = Callable[[str | None, str], float]


@dataclass(frozen=True)
class StageOption:
    """A node serving layers [start, end) of the model, as a route may use it."""

    node_id: str
    start: int
    end: int
    seconds_per_layer: float
    load: float = 0.0

    @property
    def compute_seconds(self) -> float:
        return (self.end - self.start) * self.seconds_per_layer * (1.0 + self.load)


@dataclass(frozen=True)
class Route:
    stages: tuple[StageOption, ...]
    seconds: float  # estimated cost of one token along the route

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(stage.node_id for stage in self.stages)


class NoRouteError(LookupError):
    """No chain of the offered stages covers every layer."""


def no_rtt(a: str | None, b: str) -> float:
    return 0.0


# What a hop between two stages costs at least, when nothing measured says more.
STAGE_HOP_FLOOR = 0.001


def stage_hop_seconds(rtt_a: float | None, rtt_b: float | None) -> float:
    """A hop between stages a and b, from the planner's own RTTs to each: the triangle's lower
    bound |rtt(a) - rtt(b)| (a replica far from the mesh costs its distance; two stages in one far
    room cost little). No member can make it smaller: its RTT to the planner is first-hand, and a
    probe cannot be answered before it arrives. What the stages say of their own links is not used."""
    if rtt_a is None or rtt_b is None:
        return STAGE_HOP_FLOOR
    return max(STAGE_HOP_FLOOR, abs(rtt_a - rtt_b))


# What a member not timed yet counts at, at least (and any member where nothing is timed): its own
# word never makes it faster (a member saying 1e-9 s/layer must not buy a route or a placement).
# Where members are timed, one not timed yet counts slower than the slowest of them (`believe`).
DEFAULT_SECONDS_PER_LAYER = 1e-3

# Where the seconds per layer a route counts for a member came from (`Believed.source`):
PROBED = "probe"  # this node's own probes timed it (as tracker: meshd.mesh.probes)
OWN = "own"  # this node itself: its own figure, the default if it has none (it does not probe itself)
DEFAULT = "default"  # not timed yet: the conservative default
DECLARED = "declared"  # not timed yet and, by its own word, slower than that default (a word against itself)
TRAFFIC = "traffic"  # what askers saw on real asks, far slower than any other figure (meshd.mesh.traffic)

# A traffic figure counts only where it is this many times the stage's figure from elsewhere: the
# asker's token time holds what no probe's does (the fast path's hops, sampling, a loaded machine's
# scheduling), which the probe figures of the others do not take off (past the allowance there,
# meshd.mesh.traffic.TRAFFIC_ALLOWANCE), so an honest stage's traffic figure may run above its probe
# figure. Measured on this 2-core box under the other tests' load: SmolLM2 whole on one stage probed
# at 1.58 ms a layer (47 ms a step) while `meshd ask` over it ran 14-39 tokens/s (26-71 ms a token),
# which counts it at 0.6 ms a layer at most. A stage slow for users is slower by its whole wait.
# Below the ratio nothing moves: no route follows the noise of asks.
TRAFFIC_RATIO = 3.0


@dataclass(frozen=True)
class Believed:
    """The seconds per layer routes count for a member, where that figure came from (one of the
    sources above), and how many probes' samples it is the median of (from traffic: how many
    reporters'; 0: none)."""

    seconds_per_layer: float
    source: str
    samples: int = 0


class Figures(Protocol):
    """Figures this node did not time itself, but counts where they are far slower (meshd.mesh.traffic)."""

    def measured(self, node_id: str) -> tuple[float, int] | None: ...


class SpeedBook:
    """What this node measured of members' speeds: seconds per layer of stage steps it timed itself.

    The shell feeds `observe` with a step it timed at one stage (its round trip less the link's
    measured RTT); `measured` is the median of a member's last `samples`, so one slow step (a
    hiccup, a queue) does not move it. Nothing here comes from the member: a measured figure wins
    over anything it says. Bounded: at most `members` members (the longest unobserved goes first)."""

    def __init__(self, samples: int = 8, members: int = 4096) -> None:
        self._samples = samples
        self._members = members
        self._steps: dict[str, deque[float]] = {}
        # what real asks say of members (as tracker: meshd.mesh.traffic), beside what it timed
        self.traffic: Figures | None = None

    def observe(self, node_id: str, layers: int, seconds: float) -> None:
        if layers <= 0 or not math.isfinite(seconds) or seconds < 0.0:
            return
        steps = self._steps.pop(node_id, None)  # re-inserted last: the dict's order is recency
        if steps is None:
            steps = deque(maxlen=self._samples)
            if len(self._steps) >= self._members:
                del self._steps[next(iter(self._steps))]
        steps.append(seconds / layers)
        self._steps[node_id] = steps

    def measured(self, node_id: str) -> float | None:
        steps = self._steps.get(node_id)
        return statistics.median(steps) if steps else None

    def samples(self, node_id: str) -> int:
        return len(self._steps.get(node_id, ()))


def believed_speeds(records: Iterable[CapabilityRecord], model: str, default_seconds_per_layer: float,
                    speeds: SpeedBook | None = None, own: str | None = None) -> dict[str, Believed]:
    """The seconds per layer routes count for each member serving `model` (see `believe`)."""
    reported = {record.node_id: record.seconds_per_layer for record in records
                if any(s.model == model for s in record.served)}
    return believe(reported, speeds, default_seconds_per_layer, own)


def believe(reported: Mapping[str, float], speeds: SpeedBook | None = None,
            default: float = DEFAULT_SECONDS_PER_LAYER, own: str | None = None,
            traffic: bool = True) -> dict[str, Believed]:
    """The seconds per layer to count for each member, from what this node timed of it (`speeds`)
    and what it `reported` (its word; 0: it said nothing).

    A member this node timed counts at the time measured, whatever it says. One not timed yet
    counts at the conservative default: `default`, or the slowest timed member's figure plus the
    route margin where that is slower, so an untimed member never even ties a timed one (nor does a
    route through it take over a timed route on noise); its word counts only where it says it is
    slower still. This node (`own`) counts at its own figure: it does not probe itself.

    Whatever the figure, where real asks (`speeds.traffic`) saw a member `TRAFFIC_RATIO` times
    slower, it counts at that: a stage fast for probes and slow for users is as slow as users see
    (`traffic` False: not, for the figures a traffic report is weighed against)."""
    timed = {node_id: Believed(seen, PROBED, speeds.samples(node_id)) for node_id in reported
             if speeds is not None and (seen := speeds.measured(node_id)) is not None}
    unmeasured = max([default, *((1.0 + ROUTE_MARGIN) * b.seconds_per_layer for b in timed.values())])
    out = {}
    for node_id, report in reported.items():
        if node_id in timed:
            out[node_id] = timed[node_id]
        elif node_id == own:
            out[node_id] = Believed(report or default, OWN)
        elif report > unmeasured:
            out[node_id] = Believed(report, DECLARED)
        else:
            out[node_id] = Believed(unmeasured, DEFAULT)
        asked = speeds.traffic.measured(node_id) if traffic and speeds is not None and speeds.traffic else None
        if asked is not None and asked[0] > TRAFFIC_RATIO * out[node_id].seconds_per_layer:
            out[node_id] = Believed(asked[0], TRAFFIC, asked[1])
    return out


def stage_options(
    records: Iterable[CapabilityRecord],
    model: str,
    default_seconds_per_layer: float = DEFAULT_SECONDS_PER_LAYER,
    assigned: Mapping[str, Collection[tuple[int, int]]] | None = None,
    speeds: SpeedBook | None = None,
    own: str | None = None,
) -> list[StageOption]:
    """The stages of `model` that the given (live) members say they serve.

    With `assigned` (the tracker's placement: node id to its ranges), only ranges placed there count:
    a member declaring a range it was not given gets no route through it. Speeds are
    `believed_speeds`: what this node (`own`) measured (`speeds`), never faster by a member's word."""
    live = [record for record in records if not record.leaving]
    believed = believed_speeds(live, model, default_seconds_per_layer, speeds, own)
    options = []
    for record in live:
        for served in record.served:
            if served.model != model:
                continue
            if assigned is not None and (served.start, served.end) not in assigned.get(record.node_id, ()):
                continue
            options.append(StageOption(record.node_id, served.start, served.end,
                                       believed[record.node_id].seconds_per_layer,
                                       record.load))
    return options


# A route in use is kept while it costs at most this much more than the cheapest: measured speeds
# and RTTs are noisy, and a route that moved between replicas of one speed at each sample would
# spread sessions (and KV) over both for nothing. A really faster route (or a slow stage) moves it.
# Why 25%: two replicas of one speed, each counted at the median of its last 8 probes (SpeedBook),
# each probe off by up to ±20%, differ by 6% in half of all draws and by over 23% in 1 of 100
# (a simulation of uniform noise): the route moves about once in a hundred re-timings, not at each,
# while a replica a third faster, or a stage timed at several times its word, moves it at once.
ROUTE_MARGIN = 0.25

# A route as its planner keeps it between asks: (node id, start, end) of each stage.
RouteKey = tuple[tuple[str, int, int], ...]


def route_key(route: Route) -> RouteKey:
    return tuple((s.node_id, s.start, s.end) for s in route.stages)


def route_cost(stages: Iterable[StageOption], rtt: Rtt = no_rtt, asker: str | None = None) -> float:
    """What one token costs along `stages`, counted as `plan_route` counts it."""
    cost, at = 0.0, asker
    for stage in stages:
        cost += (0.0 if at == stage.node_id else rtt(at, stage.node_id)) + stage.compute_seconds
        at = stage.node_id
    return cost


def plan_route(
    stages: Iterable[StageOption],
    n_layers: int,
    rtt: Rtt = no_rtt,
    asker: str | None = None,
    exclude: Collection[str] = (),
    max_arrivals: int = 16,
    keep: RouteKey | None = None,
    margin: float = ROUTE_MARGIN,
) -> Route:
    """The cheapest route through `stages` over layers [0, n_layers), avoiding `exclude`d nodes.

    With many replicas of the same ranges, each layer boundary is left only from its
    `max_arrivals` cheapest arrivals: that bounds the work at O(arrivals x stages), and
    misses the optimum only when a costlier arrival has a much shorter next link.

    `keep` is the route in use (hysteresis): while every stage of it is still offered and not
    excluded, and it costs (at today's figures) at most `margin` more than the cheapest, it stays.
    """
    stages = list(stages)
    best = _cheapest(stages, n_layers, rtt, asker, exclude, max_arrivals)
    if keep is None or route_key(best) == keep:
        return best
    offered = {(s.node_id, s.start, s.end): s for s in stages if s.node_id not in exclude}
    kept = [offered.get(key) for key in keep]
    if any(s is None for s in kept) or not _tiles(keep, n_layers):
        return best
    held = tuple(s for s in kept if s is not None)
    cost = route_cost(held, rtt, asker)
    return Route(held, cost) if cost <= best.seconds * (1.0 + margin) else best


def _tiles(key: RouteKey, n_layers: int) -> bool:
    at = 0
    for _, start, end in key:
        if start != at or end <= start:
            return False
        at = end
    return at == n_layers


def _cheapest(stages: list[StageOption], n_layers: int, rtt: Rtt, asker: str | None, exclude: Collection[str],
              max_arrivals: int) -> Route:
    starting: dict[int, list[StageOption]] = defaultdict(list)
    excluded = set(exclude)
    for stage in stages:
        if stage.node_id not in excluded and 0 <= stage.start < stage.end <= n_layers:
            starting[stage.start].append(stage)
    for options in starting.values():
        options.sort(key=lambda stage: (stage.compute_seconds, stage.node_id))

    # Heap entries: (cost, tie, boundary, node we are at, index of the path entry that got us here).
    paths: list[tuple[StageOption, int]] = []  # (stage, index of previous entry or -1)
    heap: list[tuple[float, int, int, str | None, int]] = [(0.0, 0, 0, asker, -1)]
    best: dict[tuple[int, str | None], float] = {(0, asker): 0.0}
    expanded: dict[int, int] = defaultdict(int)
    tie = 1
    while heap:
        cost, _, boundary, at, path = heapq.heappop(heap)
        if best.get((boundary, at), float("inf")) < cost:
            continue
        if boundary == n_layers:
            return Route(_unwind(paths, path), cost)
        if expanded[boundary] >= max_arrivals:
            continue
        expanded[boundary] += 1
        for stage in starting.get(boundary, ()):
            link = 0.0 if at == stage.node_id else rtt(at, stage.node_id)
            total = cost + link + stage.compute_seconds
            key = (stage.end, stage.node_id)
            if total < best.get(key, float("inf")):
                best[key] = total
                paths.append((stage, path))
                heapq.heappush(heap, (total, tie, stage.end, stage.node_id, len(paths) - 1))
                tie += 1
    raise NoRouteError(_gap_message(starting, n_layers, excluded))


def _unwind(paths: list[tuple[StageOption, int]], index: int) -> tuple[StageOption, ...]:
    stages = []
    while index >= 0:
        stage, index = paths[index]
        stages.append(stage)
    return tuple(reversed(stages))


def _gap_message(starting: dict[int, list[StageOption]], n_layers: int, excluded: set[str]) -> str:
    # The first layer no chain from layer 0 can reach says where coverage breaks.
    reached = {0}
    frontier = [0]
    while frontier:
        boundary = frontier.pop()
        for stage in starting.get(boundary, ()):
            if stage.end not in reached:
                reached.add(stage.end)
                frontier.append(stage.end)
    gap = max(reached)
    without = f" without {len(excluded)} excluded node(s)" if excluded else ""
    return f"no route covers all {n_layers} layers{without}: nothing served continues from layer {gap}"
