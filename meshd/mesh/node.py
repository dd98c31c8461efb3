"""A node's sans-IO mesh core: SWIM membership with the tracker election on top.

This is the one object `MeshDuty` (meshd/mesh/duty.py) drives for the daemon:

    node = MeshNode(identity, record, now)
    node.join(now, [seed_node_id])                # after dialling the seed
    loop:
        wait for a message or until node.next_timer()
        node.handle_message(now, src, msg)  or  node.handle_timer(now)
        for dest, msg in node.messages_to_send(): send msg to dest
        for event in node.events(): react (MemberEvent, TrackerChanged)
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from meshd.mesh.election import Election, ElectionConfig, Tracker
from meshd.mesh.membership import MemberEvent, Membership, SwimConfig, SwimMessage
from meshd.mesh.records import CapabilityRecord
from wire.identity import NodeIdentity

_LIVE_EVENTS = frozenset({"joined", "alive", "updated", "suspect"})


@dataclass(frozen=True)
class TrackerChanged:
    tracker: Tracker | None


MeshEvent = MemberEvent | TrackerChanged


def earliest(*deadlines: float | None) -> float | None:
    """The first of some `next_timer()` deadlines; None when none is set."""
    return min((d for d in deadlines if d is not None), default=None)


class MeshNode:
    """Membership and election of one node, driven as one state machine.

    `record` is the node's own signed record; start its version above any it used
    before (the wall clock in milliseconds does), so it supersedes its previous life.
    """

    def __init__(
        self,
        identity: NodeIdentity,
        record: CapabilityRecord,
        now: float,
        swim: SwimConfig = SwimConfig(),
        election: ElectionConfig = ElectionConfig(),
        rng: random.Random | None = None,
    ) -> None:
        # an accuser's confirmation counts by its weight in the election's view (meshd.mesh.suspicion); read
        # through `self`, as a test's attacker puts an election of its own in place
        self.membership = Membership(identity, record, now, swim, rng, weigh=lambda node_id: self.election.weight_of(node_id))
        # as tracker, the node signs the placements it gives (meshd.mesh.authority)
        self.identity = identity
        self.election = Election(record.node_id, now, election)
        self.election.observe(now, record, live=True)
        self._own_version = record.version
        self._joined = False  # told the election yet that this node joined
        self._tracker: Tracker | None = None
        self._left = False
        self._events: list[MeshEvent] = []

    @property
    def node_id(self) -> str:
        return self.membership.node_id

    @property
    def record(self) -> CapabilityRecord:
        return self.membership.record

    @property
    def tracker(self) -> Tracker | None:
        return self._tracker

    @property
    def left_announced(self) -> bool:
        """After `leave`: the news is out (see `Membership.leave_announced`)."""
        return self.membership.leave_announced

    def join(self, now: float, seeds: Iterable[str]) -> None:
        seeds = list(seeds)
        self.membership.join(now, seeds)
        self.election.anchor(now, seeds)
        self._settle(now)

    def leave(self, now: float) -> None:
        """Leave gracefully; keep driving the node until `left_announced`, so that the news spreads."""
        self.membership.leave(now)
        self._left = True

    def update_record(self, now: float, **changes: object) -> CapabilityRecord:
        """Publish a new version of this node's record (served ranges, load, models, ...).

        Each version is gossiped to every member: publish load changes at a measured pace,
        not per request. `tracker_term` and the vote belong to the election and are set here by themselves.

        After `leave` nothing new is published: the last record said the node is leaving, and what changes
        while the news spreads (a relay's reservation lost as the relay stops too, the load) is moot; the smoke
        soak's volunteers ended their graceful leave in a traceback for it."""
        if self._left:
            return self.membership.record
        self.membership.update_record(now, **changes)
        self._settle(now)
        return self.membership.record

    def handle_message(self, now: float, src: str, message: SwimMessage) -> None:
        self.membership.handle_message(now, src, message)
        self._observe_members(now)
        # `src` is the authenticated sender: a member heard from first-hand, who counts in the election
        if self.membership.first_hand(src):
            self.election.vouch(now, src)
        self._settle(now)

    def handle_timer(self, now: float) -> None:
        self.membership.handle_timer(now)
        self._observe_members(now)
        self.election.handle_timer(now, self.membership.joined)
        self._settle(now)

    def next_timer(self) -> float | None:
        return earliest(self.membership.next_timer(), self.election.next_timer())

    def messages_to_send(self) -> list[tuple[str, SwimMessage]]:
        return self.membership.messages_to_send()

    def events(self) -> list[MeshEvent]:
        out, self._events = self._events, []
        return out

    def _observe_members(self, now: float) -> None:
        for event in self.membership.events():
            vouched = self.membership.first_hand(event.node_id)
            self.election.observe(now, event.record, event.kind in _LIVE_EVENTS, vouched)
            self._events.append(event)

    def _settle(self, now: float) -> None:
        """Bring the election up to date and this node's record in line with its claim."""
        self._observe_members(now)
        if self._left:
            return
        membership, election = self.membership, self.election
        if not self._joined and membership.joined:
            self._joined = True
            election.joined(now)
        vote = election.vote
        vote_term, vote_for = (vote.term, vote.node_id) if vote is not None else (0, "")
        own = membership.record
        if (own.tracker_term, own.vote_term, own.vote_for) != (election.claim, vote_term, vote_for):
            membership.update_record(now, tracker_term=election.claim, vote_term=vote_term, vote_for=vote_for)
        if membership.record.version != self._own_version:
            self._own_version = membership.record.version
            election.observe(now, membership.record, live=True)
        if election.tracker != self._tracker:
            self._tracker = election.tracker
            self._events.append(TrackerChanged(self._tracker))
