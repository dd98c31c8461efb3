"""The tracker's stage probes, sans-IO: which stage to time next, and what its timing says.

Routes must not take a member's word for its speed (a member signing 1e-9 s/layer
would buy every route), so the tracker times each stage it placed itself: the
shell opens a check session on the stage (the kind an asker's spot check
opens: fed by its opener, no next stage, one receipt back per step), sends it
a few one-row steps, and times each from the row sent to the receipt back. The
link's round trip, timed on the same link just before (one metrics request),
is taken off; what is left, per layer, feeds the `SpeedBook`, whose figure
routes and placements count in place of whatever the member says (until a
stage is timed, it counts at a conservative default: `routing.believe`).

Why a real step and not a report: a stage that sleeps per step, or whose
engine is slower than it says, is slow at the probe as well. A probe that runs
out of time counts as a step that took the whole time (a stage that never
answers is at least that slow); one refused or broken off counts as nothing
(a restart, a full stage: the next probe tells).

What a probe costs the stage is bounded: one at a time mesh-wide, each stage
at most once per `interval` (a stage newly placed at once), `steps` rows of
compute, and never on a stage that holds sessions (its metrics say so before
the session opens): a probe must not take a slot, or evict, a user's session.
A stage that is always busy keeps the figure it was last measured at.

Driven like every sans-IO core here: `due(now, stages)` returns the probes to
start (`StageProbe`), the shell reports each with `finished`; `next_timer`
says when the next one falls due.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from meshd.mesh.routing import SpeedBook


@dataclass(frozen=True)
class ProbeConfig:
    # each stage is timed at most once this often
    interval: float = 30.0
    # a stage that was busy (or refused) is tried again this much sooner than `interval`
    retry: float = 5.0
    # probes in flight at once, mesh-wide (the tracker's own cost, and the stages')
    concurrent: int = 1
    # one-row steps per probe: the median of them is the probe's one sample
    steps: int = 3
    # the whole probe's time (open, steps); past it the step under way counts as this slow
    timeout: float = 10.0


@dataclass(frozen=True)
class StageProbe:
    """Time layers [start, end) of `model` at `node_id`; answer with `Prober.finished`."""

    node_id: str
    model: str
    start: int
    end: int

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ProbeResult:
    """What the shell timed: the link's round trip and each step's, from row sent to receipt back.
    `timed_out`: the probe ran out of time during a step (its time so far is the last of `steps`)."""

    rtt: float
    steps: tuple[float, ...]
    timed_out: bool = False


class Prober:
    """When to time which stage, and the `SpeedBook` it feeds. Bounded: it keeps state only for
    the stages it is given (those placed and served now) and at most `concurrent` in flight."""

    def __init__(self, speeds: SpeedBook, config: ProbeConfig = ProbeConfig()) -> None:
        self.speeds = speeds
        self.config = config
        self._next: dict[StageProbe, float] = {}  # when each known stage is due
        # probes started and not yet reported, with when they are given up on (a shell task lost)
        self._in_flight: dict[StageProbe, float] = {}

    def due(self, now: float, stages: Iterable[StageProbe]) -> list[StageProbe]:
        """The probes to start now, among `stages` (every stage the tracker placed that serves)."""
        current = set(stages)
        for gone in [s for s in self._next if s not in current]:
            del self._next[gone]
        for lost in [s for s, until in self._in_flight.items() if now >= until or s not in current]:
            del self._in_flight[lost]
        for stage in current:
            self._next.setdefault(stage, now)  # newly placed: timed at once
        started = []
        # the longest overdue first, so that no stage starves behind others
        for stage in sorted(self._next, key=lambda s: (self._next[s], s.node_id, s.start)):
            if len(self._in_flight) >= self.config.concurrent or self._next[stage] > now:
                break
            if stage in self._in_flight:
                continue
            self._in_flight[stage] = now + 2 * self.config.timeout
            started.append(stage)
        return started

    def next_timer(self) -> float | None:
        waiting = [t for s, t in self._next.items() if s not in self._in_flight]
        if len(self._in_flight) >= self.config.concurrent:
            waiting = []  # nothing starts before one in flight ends (or is given up on)
        return min([*waiting, *self._in_flight.values()], default=None)

    def finished(self, now: float, probe: StageProbe, result: ProbeResult | None) -> None:
        """The shell's report of `probe`; None: refused, busy or broken off (no sample)."""
        if self._in_flight.pop(probe, None) is None:
            return  # given up on already, or of a stage no longer placed
        if probe in self._next:
            self._next[probe] = now + (self.config.interval if result is not None else self.config.retry)
        if result is None:
            return
        sample = probe_seconds(result)
        if sample is not None:
            self.speeds.observe(probe.node_id, probe.layers, sample)


def probe_seconds(result: ProbeResult) -> float | None:
    """One probe's compute time per step: the median step less the link's round trip (never below 0:
    at loopback speeds the two are of one size, and noise must not make a stage look free)."""
    steps = [s for s in result.steps if math.isfinite(s) and s >= 0.0]
    if not steps or not math.isfinite(result.rtt) or result.rtt < 0.0:
        return None
    if result.timed_out:
        # the step the time ran out in took at least that long: a stage that stalls is slow
        return max(steps)
    return max(0.0, statistics.median(steps) - result.rtt)
