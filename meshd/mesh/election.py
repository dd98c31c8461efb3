"""Tracker election over the membership view, as a sans-IO state machine.

A tracker claim is the `tracker_term` field of the claimant's own signed
capability record, so it spreads (and is rebuilt after a restart) like any
other record, cannot be forged for someone else, and the tracker's heartbeat
is its SWIM liveness. Everyone follows the highest live (term, node id).

When no live tracker has been seen for the election timeout, candidates claim
term + 1 in order of merit (directly reachable, longest uptime, lowest node
id): the best one in a node's view after one timeout, the next after two, and
so on, so a best candidate that is gone without being detected yet does not
stall the election. Two claims racing (or two trackers meeting when a
partition heals) resolve to the higher (term, id); the other steps down.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshd.mesh.records import ROLE_CLIENT, CapabilityRecord

_REACHABILITY_RANK = {"public": 0, "unknown": 1, "nat": 2}
# Records bound terms below 2**63. A node that claimed the last term keeps it; nobody can outbid it.
_LAST_TERM = 2**63 - 1


@dataclass(frozen=True)
class ElectionConfig:
    election_timeout: float = 3.0


@dataclass(frozen=True, order=True)
class Tracker:
    term: int
    node_id: str


def eligible(record: CapabilityRecord) -> bool:
    """Light clients and departing nodes never run for tracker."""
    return ROLE_CLIENT not in record.roles and not record.leaving


def candidate_key(record: CapabilityRecord) -> tuple[int, float, str]:
    """Smaller is better: directly reachable first, then longest uptime, then lowest node id."""
    return (_REACHABILITY_RANK[record.reachability], record.started_at, record.node_id)


class Election:
    """One node's view of who the tracker is, and whether this node should claim the role.

    Feed it every record this node learns with `observe` (live: alive or suspect),
    and call `handle_timer` when `next_timer()` has passed. `claim` is the
    tracker term this node's own record must carry (0: none).
    """

    def __init__(self, node_id: str, now: float, config: ElectionConfig = ElectionConfig()) -> None:
        self._node_id = node_id
        self._config = config
        self._live: dict[str, CapabilityRecord] = {}
        self._claims: dict[str, int] = {}  # other live members claiming a term
        self._highest_term = 0
        self._claim = 0
        self._tracker: Tracker | None = None
        self._vacant_since: float | None = now
        self._deadline: float | None = now + config.election_timeout

    @property
    def tracker(self) -> Tracker | None:
        return self._tracker

    @property
    def claim(self) -> int:
        return self._claim

    def observe(self, now: float, record: CapabilityRecord, live: bool) -> None:
        node_id = record.node_id
        self._highest_term = max(self._highest_term, record.tracker_term)
        if live:
            self._live[node_id] = record
        else:
            self._live.pop(node_id, None)
        # Our own claim is `_claim`; the record echoing it may lag behind a step-down.
        if node_id != self._node_id:
            if live and record.tracker_term > 0:
                self._claims[node_id] = record.tracker_term
            else:
                self._claims.pop(node_id, None)
        self._refresh(now)

    def handle_timer(self, now: float, joined: bool) -> None:
        if self._deadline is None or now < self._deadline or self._vacant_since is None:
            return
        if self._highest_term >= _LAST_TERM:
            self._deadline = None
            return
        own = self._live.get(self._node_id)
        # A node still joining has not seen the mesh yet; claiming now would unseat its tracker.
        if not joined or own is None or not eligible(own):
            self._deadline = now + self._config.election_timeout
            return
        key = candidate_key(own)
        rank = sum(1 for record in self._live.values() if eligible(record) and candidate_key(record) < key)
        due = self._vacant_since + self._config.election_timeout * (1 + rank)
        if now < due:
            # Better candidates may die meanwhile and lower our rank: look again a timeout from now.
            self._deadline = min(due, now + self._config.election_timeout)
            return
        self._highest_term += 1
        self._claim = self._highest_term
        self._refresh(now)

    def next_timer(self) -> float | None:
        return self._deadline

    def _refresh(self, now: float) -> None:
        best = max((Tracker(term, node_id) for node_id, term in self._claims.items()), default=None)
        if self._claim:
            own = Tracker(self._claim, self._node_id)
            if best is None or own > best:
                best = own
            else:
                self._claim = 0  # a higher claim is live: step down
        self._tracker = best
        if best is not None:
            self._vacant_since = None
            self._deadline = None
        elif self._vacant_since is None:
            self._vacant_since = now
            self._deadline = now + self._config.election_timeout
