"""Lifeguard suspicion of other members, each accuser weighed (sans-IO; meshd.mesh.membership drives it).

A suspected member is declared dead when its suspicion runs out: after `max_timeout` if nobody
confirms it, sooner (down to `min_timeout`) the more independent accusers confirm it. Identities
are free, so a confirmation counts by its accuser's weight in this node's view (`Weigh`: meshd.mesh.
election's `weight_of`, the rule of meshd.mesh.authority): before any placement every accuser counts
one, as Lifeguard has it; once members weigh, a placed member counts one plus the extra votes its
served work earns it (meshd.mesh.credit.extra_votes) and a free identity nothing. So a crowd of free
identities cannot hurry an honest member's death: its suspicion runs its whole course and it
refutes in time. Any accuser may still start a suspicion (a member nobody placed sees deaths too),
within its share: one accuser starts or confirms a suspicion of one member at most `accusations`
times a burst (`Buckets`), the rest are dropped before they suspect anyone or travel on.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from meshd.mesh.swim_sets import Buckets

# An accuser's weight in this node's view: 0 counts for nothing (a free identity once members weigh).
Weigh = Callable[[str], int]


def everyone_once(node_id: str) -> int:
    return 1


@dataclass
class Suspicion:
    """One member's suspicion: the timeout falls from max to min as the accusers' weight confirms it."""

    incarnation: int
    start: float
    min_timeout: float
    max_timeout: float
    expected: int
    accusers: set[str]
    # the confirmers' weight so far (the first accuser's is not a confirmation)
    confirmed: int = 0
    deadline: float = 0.0

    def __post_init__(self) -> None:
        self._reschedule()

    def confirm(self, accuser: str, weight: int) -> bool:
        if accuser in self.accusers or weight <= 0 or self.confirmed >= self.expected:
            return False
        self.accusers.add(accuser)
        self.confirmed += weight
        self._reschedule()
        return True

    def _reschedule(self) -> None:
        if self.expected < 1:
            timeout = self.min_timeout
        else:
            fraction = math.log(min(self.confirmed, self.expected) + 1) / math.log(self.expected + 1)
            timeout = max(self.min_timeout, self.max_timeout - fraction * (self.max_timeout - self.min_timeout))
        self.deadline = self.start + timeout


@dataclass
class Suspicions:
    """The suspicions a node holds of others, by member, with their deadlines in order."""

    node_id: str
    # accusations one accuser may make of one member: a burst of `burst`, refilled at `rate` a second
    burst: int
    rate: float
    cap: int
    weigh: Weigh = everyone_once
    held: dict[str, Suspicion] = field(default_factory=dict)
    _heap: list[tuple[float, str]] = field(default_factory=list)
    _buckets: Buckets = field(init=False)

    def __post_init__(self) -> None:
        self._buckets = Buckets(self.burst, self.rate, self.cap)

    def accuse(self, now: float, node_id: str, incarnation: int, accuser: str,
               timeouts: tuple[float, float, int]) -> Literal["started", "confirmed"] | None:
        """`accuser` accuses `node_id` at `incarnation`: whether that started a suspicion or confirmed
        one (news to pass on), or None (nothing counted). `timeouts`: (min, max, confirmations
        expected) for a suspicion it starts."""
        suspicion = self.held.get(node_id)
        if suspicion is not None and suspicion.incarnation != incarnation:
            suspicion = None  # of an older version: this accusation starts a new one
        if suspicion is not None and accuser in suspicion.accusers:
            return None  # counted already: a copy from another gossiper costs its accuser nothing
        own = accuser == self.node_id
        if not own and not self._buckets.take((accuser, node_id), now):
            return None
        if suspicion is not None:
            # this node's own word counts at least once, whatever it weighs in its own view
            if not suspicion.confirm(accuser, max(1, self.weigh(accuser)) if own else self.weigh(accuser)):
                return None
            news: Literal["started", "confirmed"] = "confirmed"
        else:
            least, most, expected = timeouts
            suspicion = self.held[node_id] = Suspicion(incarnation, now, least, most, expected, {accuser})
            news = "started"
        heapq.heappush(self._heap, (suspicion.deadline, node_id))
        return news

    def end(self, node_id: str) -> None:
        # Its heap entry stays behind and is skipped when it comes up.
        self.held.pop(node_id, None)

    def due(self, now: float) -> list[tuple[str, int]]:
        """(member, incarnation) of each suspicion run out by `now`."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            deadline, node_id = heapq.heappop(self._heap)
            suspicion = self.held.get(node_id)
            if suspicion is not None and suspicion.deadline == deadline:
                out.append((node_id, suspicion.incarnation))
        return out

    def next_timer(self) -> float | None:
        return self._heap[0][0] if self._heap else None
