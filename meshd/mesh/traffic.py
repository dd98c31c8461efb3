"""Stage speeds from real traffic: what askers saw of the routes they were given, sans-IO.

The tracker times the stages it placed itself (meshd.mesh.probes), but a probe is a check session,
which a stage can tell from a user's: a stage may run the probes at full speed and sleep at every
user's step. So each ask a member made (its `meshd ask`'s or its front door's) is reported to the
tracker: the route it took and the seconds per token its asker saw over the decode. The tracker
turns that into a figure for each stage of the route.

A verified fast ask knows more: each stage's signed span receipts carry its own time on the rows
(``Receipt.t_us``: from each step's rows coming whole to its output's send), and the report carries
each stage's per token (`TimedStage.own`). Then (`attribute_own`) each stage is charged its own word,
and what the asker waited past all of them, the links and an allowance (the residual) is charged to
every stage of the route as well. So:
- a stage that says what it took (an honest stage, or a slow one whose daemon is honest: its worker
  sleeps, its daemon times it) is charged that, and its honest neighbour only its own: the slow one
  loses the route, the neighbour keeps its figure;
- a stage saying less than it took cannot lower its figure: what it hid is the residual, charged to
  it too (its figure is at least what the asker's clock leaves it, less the allowance);
- nor raise an honest neighbour's past what the asker's clock allows: the neighbour is charged its
  own word plus the residual, at most the token's time less the links (what a route's time charged a
  stage before receipts were timed).
Why the residual is charged to every stage, not the one that hid it: on a ring every stage (and the
asker) sees one period per token, the whole loop, each on its own clock. A stage can time only its
own hold; what a neighbour sees of it (the time from sending its rows to the next token's coming
back) is the whole loop less the neighbour's hold, so a stage that shrinks its hold and grows its
wait to match says exactly what an honest stage beside it says: no one ask, nor its receipts, can
say which of the two hid the time. Asks over other routes can: a reporter's figure is the median of
its last asks, so an honest stage whose later asks go over routes without the liar sheds the charge,
where the liar carries it on every route it is on.

Without timed receipts (an unverified ask, the daemons' path: `attribute`) a stage is charged what
is left of a token once the links, the allowance and every other stage at the figures the tracker
measured itself are taken off: every stage of a slow route is charged its wait, a stage beside the
slow one too, until its figure ages out.

Why the asker's clock, and no stage's, bounds a stage: what a stage says of itself counts only as far
as the others and the asker's wait bear it out (a slow stage would say it is fast), and only the
asker, and the tracker that planned the route, know the whole route.

Whose word counts (`TrafficBook`):
- a stage's report about itself never;
- a member's only where the mesh sees weight behind it (the tracker placed it, or it has credit:
  the shell's `weighs`), so free identities report nothing that counts;
- a reporter's figure for a stage is the median of its last `samples` reports, and the stage's the
  lower median over reporters, counted once `quorum` reporters (2) say something: one reporter,
  however many reports it sends, moves no figure, whether it says a stage is slow (framing an honest
  one) or fast (shielding a slow one). Of two the lower counts: framing takes both (as it takes two
  of three, or three of four, since the lower median is never an upper outlier), and one can shield
  a slow stage only until a third reports, where a quorum of three counted nothing at all before it:
  so a mesh whose members ask through two weighted members (beside the tracker) has figures too.
  The tracker's own asks are first-hand, as its probes are: its figure counts alone and wins;
- reports are rate-limited per reporter (a token bucket), and every book is bounded (oldest out);
- a figure ages out `ttl` after its last report: a stage that routes now avoid gets no reports, and
  counts at its probe figure again after that (a stage briefly slow, or framed, is not out for good).

Where a figure counts is `routing.believe`: only where it is `TRAFFIC_RATIO` times its probe figure.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from wire.meshrpc import TrafficReport

# What a token may cost beyond its stages' compute and its links before any stage is charged with it: an
# ask's token time holds what no probe times (sampling, the fast path's hops, the receipts' hold of a
# verified ask, a loaded machine's scheduling). Where layers are light (the tiny test models, about a
# millisecond a stage) that is most of a token, and a stage charged with it would lose its routes to
# its replicas, which the next asks charge in turn: routes would move at every ask. A stage that sleeps
# at each user's step is charged all past this.
TRAFFIC_ALLOWANCE = 0.05
# The fewest tokens a report may time a decode by: a shorter answer is mostly its first token's wait
MIN_TRAFFIC_TOKENS = 4


@dataclass(frozen=True)
class TrafficConfig:
    # reports of one stage by one reporter whose median is that reporter's figure
    samples: int = 8
    # reporters (other than the tracker itself) a stage's figure needs (their lower median counts)
    quorum: int = 2
    # a reporter's figure is forgotten this long after its last report
    ttl: float = 600.0
    # reports a reporter may send: `rate` a second, `burst` at once (an ask makes one)
    rate: float = 0.5
    burst: float = 20.0
    # bounds: reporters whose buckets are kept, stages with figures, reporters kept per stage
    reporters: int = 1024
    stages: int = 4096
    per_stage: int = 32


class _Reported:
    """One reporter's last reports of one stage."""

    __slots__ = ("samples", "at")

    def __init__(self, samples: int) -> None:
        self.samples: deque[float] = deque(maxlen=samples)
        self.at = 0.0


class TrafficBook:
    """Stage figures (seconds per layer) from reporters' asks; `first_hand` is the tracker's own id."""

    def __init__(self, first_hand: str, config: TrafficConfig = TrafficConfig()) -> None:
        self.first_hand = first_hand
        self.config = config
        self._buckets: dict[str, tuple[float, float]] = {}  # reporter: (tokens left, when counted)
        self._stages: dict[str, dict[str, _Reported]] = {}  # stage: reporter: its reports
        # when the oldest report ages out (None: none kept): the timers between cost nothing
        self._due: float | None = None

    def admit(self, now: float, reporter: str) -> bool:
        """Whether `reporter` may report now (one report spends one token of its bucket)."""
        c = self.config
        tokens, at = self._buckets.pop(reporter, (c.burst, now))
        tokens = min(c.burst, tokens + max(0.0, now - at) * c.rate)
        if len(self._buckets) >= c.reporters:
            del self._buckets[next(iter(self._buckets))]  # the longest quiet goes first
        self._buckets[reporter] = (tokens - 1.0 if tokens >= 1.0 else tokens, now)
        return tokens >= 1.0

    def observe(self, now: float, reporter: str, node_id: str, seconds_per_layer: float) -> None:
        """One report's figure for stage `node_id` by `reporter` (a stage's of itself is dropped)."""
        if reporter == node_id or not math.isfinite(seconds_per_layer) or seconds_per_layer < 0.0:
            return
        c = self.config
        by = self._stages.pop(node_id, None)  # re-inserted last: the dict's order is recency
        if by is None:
            by = {}
            if len(self._stages) >= c.stages:
                del self._stages[next(iter(self._stages))]
        seen = by.pop(reporter, None)
        if seen is None:
            seen = _Reported(c.samples)
            if len(by) >= c.per_stage:
                del by[next(iter(by))]
        seen.samples.append(seconds_per_layer)
        seen.at = now
        if self._due is None:
            self._due = now + c.ttl
        by[reporter] = seen
        self._stages[node_id] = by

    def measured(self, node_id: str) -> tuple[float, int] | None:
        """The stage's figure and how many reporters it is the median of; None where it has none that
        counts (fewer than `quorum` reporters, and none first-hand)."""
        by = self._stages.get(node_id)
        if not by:
            return None
        own = by.get(self.first_hand)
        if own is not None:
            return statistics.median(own.samples), 1
        if len(by) < self.config.quorum:
            return None
        return statistics.median_low([statistics.median(r.samples) for r in by.values()]), len(by)

    def expire(self, now: float) -> bool:
        """Forgets reports older than `ttl`; whether any figure changed."""
        if self._due is None or now < self._due:
            return False
        changed = False
        for node_id in list(self._stages):
            by = self._stages[node_id]
            for reporter in [r for r, seen in by.items() if now - seen.at >= self.config.ttl]:
                del by[reporter]
                changed = True
            if not by:
                del self._stages[node_id]
        self._due = min((seen.at + self.config.ttl for by in self._stages.values() for seen in by.values()),
                        default=None)
        return changed

    def next_timer(self) -> float | None:
        return self._due


def attribute(stages: Sequence[tuple[str, int]], seconds_per_token: float, links: float,
              reference: Callable[[str], float]) -> dict[str, float]:
    """Each stage's seconds per layer as one report of its route says: of `seconds_per_token` (the
    asker's), what is left once `links` (the route's link time) and every other stage's compute at
    its `reference` seconds per layer (the tracker's own figures) are taken off, over its layers.
    `stages`: (node id, layers) in route order. Where the others' figures already explain the whole
    token, a stage is charged nothing; it is never charged what the links took."""
    compute = {node_id: layers * reference(node_id) for node_id, layers in stages}
    total = sum(compute.values())
    out = {}
    for node_id, layers in stages:
        if layers > 0:
            left = seconds_per_token - links - (total - compute[node_id])
            out[node_id] = max(0.0, left) / layers
    return out


def attribute_own(stages: Sequence[tuple[str, int, float]], seconds_per_token: float, links: float,
                  allowance: float) -> dict[str, float]:
    """Each stage's seconds per layer as one report of its route says where every stage's own time is in:
    its own seconds per token, plus what the token took past every stage's own, the `links` and the
    `allowance` (the residual, charged to each stage: one ask cannot say whose it was), at most what
    the token took less the links, over its layers. `stages`: (node id, layers, own seconds per token)
    in route order."""
    left = max(0.0, seconds_per_token - links)
    residual = max(0.0, left - allowance - sum(own for _, _, own in stages))
    return {node_id: min(own + residual, left) / layers for node_id, layers, own in stages if layers > 0}


def route_charges(report: TrafficReport, placed: Mapping[str, Collection[tuple[int, int]]] | None, n_layers: int,
                  hop: Callable[[str, str], float], reference: Callable[[str], float]) -> dict[str, float] | None:
    """Each stage's seconds per layer by one report (`attribute_own` where every stage's own time is in,
    else `attribute`), its links every hop of the ring (the tail's token to the head included) at
    `hop`'s cost, plus `TRAFFIC_ALLOWANCE`; None where the report's stages are no route over `n_layers`
    of ranges `placed` (node id: its placed ranges)."""
    at, nodes = 0, []
    for s in report.stages:
        if placed is None or s.start != at or (s.start, s.end) not in placed.get(s.node_id, ()):
            return None
        at = s.end
        nodes.append(s.node_id)
    if at != n_layers or len(set(nodes)) != len(nodes):
        return None
    links = sum(hop(a, b) for a, b in zip(nodes, nodes[1:] + nodes[:1], strict=True)) if len(nodes) > 1 else 0.0
    owns = [s.own for s in report.stages]
    if all(own is not None for own in owns):
        return attribute_own([(s.node_id, s.end - s.start, s.own or 0.0) for s in report.stages],
                             report.seconds_per_token, links, TRAFFIC_ALLOWANCE)
    return attribute([(s.node_id, s.end - s.start) for s in report.stages], report.seconds_per_token,
                     links + TRAFFIC_ALLOWANCE, reference)
