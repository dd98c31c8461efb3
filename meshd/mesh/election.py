"""Tracker election over the membership view, as a sans-IO state machine.

A tracker claim is the `tracker_term` field of the claimant's own signed
capability record, and a vote is the `vote_term`/`vote_for` pair of the
voter's own signed record: both spread (and are rebuilt after a restart) like
any other record and cannot be forged for someone else. A claim is the
tracker only once the votes of a majority of live members carry it, so one
member cannot make itself tracker by saying so.

Members are strangers, so a claim counts only when it is believable:

- its term is at most one above the highest term seen (a carried claim's term
  counts as seen), so a claim of 2**63-1 is ignored rather than followed, and
  nobody is locked out above it;
- its candidate is eligible (no light client, no departing node);
- once the mesh has placed anyone, its candidate weighs (meshd.mesh.authority);
- a voter grants it only while no carried tracker is live (a live tracker is
  not unseated by a newcomer's claim), once per term, and only once the
  candidate's rank in the voter's own view has come due;
- uptime is what this node observed (when it first saw the member live), not
  the `started_at` a member says of itself;
- the electorate is the members this node has heard from first-hand (`vouch`:
  a message over an authenticated link from the member itself): a record that
  someone else's Sync planted counts for nothing, so ten thousand planted
  members can neither outvote the mesh nor leave every claim short of a majority;
- for the tracker a node follows, a newcomer (in the electorate under a
  timeout) whose vote is older than that tracker's term does not count yet:
  its vote takes a gossip round to come, and a tracker that lapsed at each
  join would refuse the newcomer's first assignment ask. After a timeout it
  counts like any member, and newcomers beyond the tracker's votes count at
  once (a forming mesh outgrows the few that carried its first claim). A
  claim not yet followed gets no such grace, so a fresh mesh's newcomers
  cannot make a rushing claimant tracker by not voting.

Whose votes count once the mesh has placed anyone is meshd.mesh.authority's rule: the members
that weigh (placed by a tracker this node followed, or the followed tracker itself) are then the
whole electorate, and free identities count for nothing however many links they hold; before any
placement, every live member heard from first-hand counts, so a fresh mesh bootstraps. A member that
weighs counts as one vote plus the extra votes its credit earns it (`credit`:
meshd.mesh.credit.extra_votes, up to four for served work), in the tally and in the electorate the
majority is reckoned of.

When no carried tracker is live for the election timeout, candidates claim
term + 1 in order of merit (directly reachable, longest observed uptime,
lowest node id): the best one in a node's view after one timeout, the next
after two, and so on, so a best candidate that is gone without being
detected yet does not stall the election. A claim not carried within a
timeout (votes split) is renewed at the next term by the best claimant;
a candidate steps down when it votes for another claim, or another tracker
is carried.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from meshd.mesh.authority import EARNED_FOR, FOLLOWED_KEPT, MAX_EARNED, placement_of
from meshd.mesh.records import ROLE_CLIENT, CapabilityRecord

_REACHABILITY_RANK = {"public": 0, "unknown": 1, "nat": 2}
# The largest term a record can carry; a claim is capped there rather than overflowing.
_LAST_TERM = 2**63 - 1
# A member's weight in the electorate (meshd.mesh.authority): none, as a followed tracker, as placed.
_NONE, _TRACKER, _PLACED = 0, 1, 2


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


def candidate_key(record: CapabilityRecord, first_seen: float) -> tuple[int, float, str]:
    """Smaller is better: directly reachable first, then longest observed uptime, then lowest node id."""
    return (_REACHABILITY_RANK[record.reachability], first_seen, record.node_id)


def _says(record: CapabilityRecord) -> tuple[object, ...]:
    """What the election reads of a record."""
    return (record.tracker_term, record.vote_term, record.vote_for, record.reachability, eligible(record),
            record.placement)


def believable_terms(terms: Iterable[int], highest: int) -> int:
    """The highest term reachable from `highest` by claims each at most one above the last."""
    for term in sorted(terms):
        if term > highest + 1:
            break
        highest = max(highest, term)
    return highest


class Election:
    """One node's view of who the tracker is, whom it votes for, and whether it should claim the role.

    Feed it every record this node learns with `observe` (live: alive or suspect),
    and call `handle_timer` when `next_timer()` has passed. `claim` is the
    tracker term this node's own record must carry (0: none), `vote` the
    (term, candidate) its record must name (None: none yet).
    """

    def __init__(self, node_id: str, now: float, config: ElectionConfig = ElectionConfig()) -> None:
        self._node_id = node_id
        self._config = config
        # the electorate: live members heard from first-hand (and this node); `_heard` holds the
        # live records of the others, until they speak for themselves
        self._live: dict[str, CapabilityRecord] = {}
        self._heard: dict[str, CapabilityRecord] = {}
        self._vouched: set[str] = {node_id}
        # the others that entered the electorate under a timeout ago, with when, oldest first
        self._newcomers: dict[str, float] = {}
        # Kept as records come and go, so that a record costs O(claims), not O(members): the claims
        # of other live eligible members, and every live member's vote with their tally.
        self._claiming: dict[str, int] = {}
        self._votes_of: dict[str, Tracker] = {}
        self._tally: Counter[Tracker] = Counter()
        # meshd.mesh.authority's electorate: the trackers followed (oldest first), the other live
        # members that weigh, their votes' tally, whether this node weighs, and when each member
        # was last seen placed by a followed tracker (its earned weight)
        self._followed: list[Tracker] = []
        self._weighing: set[str] = set()
        self._placed: set[str] = set()  # those of `_weighing` that weigh by a placement, not as a tracker
        self._weighted: Counter[Tracker] = Counter()
        self._self_weighs = False
        self._placed_self = False
        self._earned: dict[str, float] = {}
        # members proven to lie (MeshDuty's exclusions): they weigh nothing while excluded
        self._disowned: frozenset[str] = frozenset()
        # the extra votes a weighing member's credit earns it (meshd.mesh.credit.extra_votes), and the
        # weight each weighing voter's vote was counted with in `_weighted` (and the electorate's total)
        self._extra: dict[str, int] = {}
        self._counted: dict[str, int] = {}
        self._weighing_weight = 0
        # the seeds this node joined through: until members weigh here, it follows theirs (see `anchor`)
        self._anchors: list[str] = []
        # When this node first saw each live member live: the uptime the election trusts.
        self._first_seen: dict[str, float] = {node_id: now}
        self._highest_term = 0
        self._claim = 0
        self._claimed_at = 0.0
        self._vote: Tracker | None = None
        self._voted_at = 0.0
        self._tracker: Tracker | None = None
        self._vacant_since: float | None = now
        self._deadline: float | None = now + config.election_timeout

    @property
    def tracker(self) -> Tracker | None:
        return self._tracker

    @property
    def claim(self) -> int:
        return self._claim

    @property
    def vote(self) -> Tracker | None:
        return self._vote

    @property
    def highest_term(self) -> int:
        return self._highest_term

    @property
    def followed(self) -> list[tuple[int, str]]:
        """The trackers whose placements weigh in this node's view, as (term, node id): the one
        followed now (or last) and the one before it."""
        return [(t.term, t.node_id) for t in self._followed]

    @property
    def weighing(self) -> bool:
        """Whether the placed-and-measured electorate applies (some live member weighs by placement)."""
        return self._placed_self or bool(self._placed)

    def observe(self, now: float, record: CapabilityRecord, live: bool, vouched: bool = True) -> None:
        """`vouched`: this node has heard from the member first-hand (see `vouch`); a record known
        only second-hand is kept aside until then."""
        node_id = record.node_id
        if vouched:
            self._vouched.add(node_id)
        if node_id not in self._vouched:
            if live:
                self._heard[node_id] = record
                self._first_seen.setdefault(node_id, now)
            else:
                self._heard.pop(node_id, None)
                self._first_seen.pop(node_id, None)
            return
        # heard from first-hand with news (not through `vouch`): the copy kept aside is stale, and a
        # stale copy would answer for the member in `_backed` once it is gone
        self._heard.pop(node_id, None)
        held = self._live.get(node_id)
        if live and held is not None and _says(held) == _says(record):
            self._live[node_id] = record  # a new version saying nothing new to the election: most are
            return
        if held is not None:
            self._placed_until(now, held)
        weight = self._weight(now, record) if live else _NONE
        if node_id != self._node_id:
            self._count_vote(node_id, Tracker(record.vote_term, record.vote_for) if live and record.vote_term else None,
                             weight)
            if live and record.tracker_term > 0 and eligible(record):
                self._claiming[node_id] = record.tracker_term
            else:
                self._claiming.pop(node_id, None)
        else:
            self._weigh_self(weight)
        if live:
            if node_id not in self._live and node_id != self._node_id:
                self._newcomers[node_id] = now
            self._live[node_id] = record
            self._first_seen.setdefault(node_id, now)
        else:
            self._live.pop(node_id, None)
            self._newcomers.pop(node_id, None)
            if node_id != self._node_id:
                # A member that comes back starts its observed uptime afresh, once heard from again.
                self._first_seen.pop(node_id, None)
                self._vouched.discard(node_id)
        self._refresh(now)

    def vouch(self, now: float, node_id: str) -> None:
        """`node_id` has spoken to this node first-hand: from now on its record counts."""
        if node_id in self._vouched:
            return
        self._vouched.add(node_id)
        record = self._heard.pop(node_id, None)
        if record is not None:
            self.observe(now, record, live=True)

    def anchor(self, now: float, seeds: Iterable[str]) -> None:
        """This node joins through `seeds`. Until members weigh in its view, the claim a seed backs
        (its record's vote, for a claim its claimant still makes) is the only one it follows, and
        that claim's placements are the ones that weigh: a newcomer has no placement to go by yet,
        and counting heads it would follow whatever claim enough free identities back. It is carried
        on the seed's word, once its claimant is heard first-hand, not by a head count: free
        identities heard before any placed member would otherwise outnumber its backers and drop it.
        The seed is the one member its operator chose to trust; with no seed backing a claim (no
        vote, or one its claimant no longer makes), heads count."""
        self._anchors = list(seeds)
        self._refresh(now)

    def disown(self, now: float, liars: Iterable[str]) -> None:
        """`liars` are proven to lie (and excluded) from now on, in place of those before: a placement
        a liar still carries gives it no vote."""
        disowned = frozenset(liars)
        if disowned == self._disowned:
            return
        changed, self._disowned = disowned ^ self._disowned, disowned
        for node_id in changed & self._live.keys():
            record = self._live[node_id]
            if node_id == self._node_id:
                self._weigh_self(self._weight(now, record))
            else:
                self._count_vote(node_id, self._votes_of.get(node_id), self._weight(now, record))
        self._refresh(now)

    def credit(self, now: float, extra: dict[str, int]) -> None:
        """Each member's extra votes for its credit (meshd.mesh.credit.extra_votes), in place of those
        before: a member that weighs counts as 1 + its extra votes, in the tally and the electorate."""
        if extra == self._extra:
            return
        changed = {n for n in extra.keys() | self._extra.keys() if extra.get(n, 0) != self._extra.get(n, 0)}
        self._extra = dict(extra)
        for node_id in changed & self._weighing:
            self._count_vote(node_id, self._votes_of.get(node_id), _PLACED if node_id in self._placed else _TRACKER)
        self._refresh(now)

    def weight_of(self, node_id: str) -> int:
        """What `node_id`'s word weighs in this node's view, as an accuser (meshd.mesh.suspicion) or a
        witness (meshd.mesh.proofs): before any placement every member one; once members weigh, one that
        weighs its vote's weight (1 + its extra votes for credit) and any other nothing."""
        if not self.weighing:
            return 1
        return self._own_weight() if node_id == self._node_id else self._counted.get(node_id, 0)

    def extra_votes(self, node_id: str) -> int:
        """The extra votes `node_id`'s credit earns it (meshd.mesh.credit.extra_votes), as last given."""
        return self._extra.get(node_id, 0)

    def _count_vote(self, voter: str, vote: Tracker | None, weight: int) -> None:
        old = self._votes_of.pop(voter, None)
        counted = self._counted.pop(voter, 0)
        self._weighing_weight -= counted
        if old is not None:
            _drop(self._tally, old)
            if counted:
                _drop(self._weighted, old, counted)
        self._weighing.discard(voter)
        self._placed.discard(voter)
        if weight != _NONE:
            self._weighing.add(voter)
            counted = self._counted[voter] = 1 + self._extra.get(voter, 0)
            self._weighing_weight += counted
        if weight == _PLACED:
            self._placed.add(voter)
        if vote is not None:
            self._votes_of[voter] = vote
            self._tally[vote] += 1
            if weight != _NONE:
                self._weighted[vote] += counted

    # ----- meshd.mesh.authority's electorate

    def _tracker_ids(self) -> set[str]:
        return {t.node_id for t in self._followed}

    def _placed_until(self, now: float, record: CapabilityRecord) -> bool:
        """Whether `record` carries a placement by a followed tracker; if so, its member has earned
        its weight until `now` (it is about to go, or to carry another placement)."""
        if placement_of(record, self.followed) is None:
            return False
        node_id = record.node_id
        self._earned.pop(node_id, None)
        self._earned[node_id] = now  # last in order: the oldest are forgotten first
        if len(self._earned) > MAX_EARNED:
            del self._earned[next(iter(self._earned))]
        return True

    def _weight(self, now: float, record: CapabilityRecord) -> int:
        """Whether `record`'s member weighs in this node's view, and why (see meshd.mesh.authority):
        `_PLACED` (by a placement, now or earned), `_TRACKER` (a followed tracker), or `_NONE`."""
        node_id = record.node_id
        if node_id in self._disowned:
            return _NONE
        if self._placed_until(now, record):
            return _PLACED
        earned = self._earned.get(node_id)
        if earned is not None and now - earned < EARNED_FOR:
            return _PLACED
        return _TRACKER if node_id in self._tracker_ids() else _NONE

    def _weigh_self(self, weight: int) -> None:
        self._self_weighs = weight != _NONE
        self._placed_self = weight == _PLACED

    def _follow(self, now: float, tracker: Tracker) -> None:
        """`tracker` is carried: its placements weigh from now on, and every member's weight is reckoned again."""
        if self._followed and self._followed[-1] == tracker:
            return
        for record in self._live.values():
            self._placed_until(now, record)  # placements by a tracker about to drop out earn until now
        self._followed = [*(t for t in self._followed if t != tracker), tracker][-FOLLOWED_KEPT:]
        for node_id, record in self._live.items():
            if node_id == self._node_id:
                self._weigh_self(self._weight(now, record))
            else:
                self._count_vote(node_id, self._votes_of.get(node_id), self._weight(now, record))

    def _backed(self) -> Tracker | None:
        """The live claim a seed of this node's backs (see `anchor`), if any. A claimant not heard of
        yet is taken on the seed's word (free identities that speak first must not leave heads to count
        until its record comes); it is carried only once heard from first-hand."""
        for seed in self._anchors:
            record = self._live.get(seed) or self._heard.get(seed)
            if record is None or not record.vote_term:
                continue
            claimant = self._live.get(record.vote_for) or self._heard.get(record.vote_for)
            if claimant is None or (claimant.tracker_term == record.vote_term and eligible(claimant)):
                return Tracker(record.vote_term, record.vote_for)
        return None

    def _may_lead(self, node_id: str) -> bool:
        """Whether `node_id` may be backed for tracker: once members weigh, only one that weighs (a
        free identity that has been around longest would otherwise win the honest votes)."""
        if not self.weighing:
            return True
        return self._self_weighs if node_id == self._node_id else node_id in self._weighing

    def _electorate(self) -> int:
        """How many live members a majority is reckoned of."""
        if not self.weighing:
            return len(self._live)
        return self._weighing_weight + (self._own_weight() if self._node_id in self._live else 0)

    def _own_weight(self) -> int:
        return 1 + self._extra.get(self._node_id, 0) if self._self_weighs else 0

    def joined(self, now: float) -> None:
        """This node has joined the mesh (or founded it): its own uptime counts from now, as the
        others observe it from about now. Counted from its start, every joiner would rank itself
        ahead of the members it has only just heard of."""
        self._first_seen[self._node_id] = now
        self._refresh(now)

    def handle_timer(self, now: float, joined: bool) -> None:
        if self._deadline is None or now < self._deadline:
            return
        self._deadline = None
        self._refresh(now)
        if self._vacant_since is None:
            return
        own = self._live.get(self._node_id)
        # A node still joining has not seen the mesh yet; claiming now would unseat its tracker.
        if not joined or own is None or not eligible(own) or not self._may_lead(self._node_id):
            self._wait(now + self._config.election_timeout)
            return
        timeout = self._config.election_timeout
        if self._claim:
            if now < self._claimed_at + timeout:
                self._wait(self._claimed_at + timeout)
                return
            # Not carried within a timeout: the votes split. The claimant with the most votes
            # (then the lowest node id: something every view agrees on) renews, the others withdraw.
            claims, _ = self._claims(now)
            best = min(claims, key=lambda node_id: (-self._votes(Tracker(claims[node_id], node_id)), node_id))
            if best != self._node_id:
                self._claim = 0
                self._wait(now + timeout)
                self._refresh(now)
                return
        else:
            vote = self._vote
            if vote is not None and self._claims(now)[0].get(vote.node_id) == vote.term \
                    and now < self._voted_at + timeout:
                # We back someone's live claim: give its votes a timeout to gather before running.
                self._wait(self._voted_at + timeout)
                return
            due = self._vacant_since + timeout * (1 + self._rank(self._node_id))
            if now < due:
                # Better candidates may die meanwhile and lower our rank: look again a timeout from now.
                self._wait(min(due, now + timeout))
                return
        self._claim = min(self._highest_term + 1, _LAST_TERM)
        self._claimed_at = now
        self._vote = Tracker(self._claim, self._node_id)
        self._wait(now + timeout)
        self._refresh(now)

    def next_timer(self) -> float | None:
        return self._deadline

    # ----- the view

    def _key(self, node_id: str) -> tuple[int, float, str]:
        return candidate_key(self._live[node_id], self._first_seen.get(node_id, float("inf")))

    def _rank(self, node_id: str) -> int:
        """How many eligible live members are better candidates than `node_id`, in this node's view."""
        key = self._key(node_id)
        return sum(1 for other, record in self._live.items()
                   if eligible(record) and self._may_lead(other) and self._key(other) < key)

    def _outranked(self, node_id: str) -> bool:
        """Whether some eligible live member is clearly a better candidate than `node_id`: better
        reachable, or seen live at least a timeout longer. Views differ by gossip delays, so a
        voter holds back only for candidates that are better beyond doubt."""
        reach = _REACHABILITY_RANK[self._live[node_id].reachability]
        seen = self._first_seen.get(node_id, float("inf")) - self._config.election_timeout
        for other, record in self._live.items():
            if other == node_id or not eligible(record) or not self._may_lead(other):
                continue
            other_reach = _REACHABILITY_RANK[record.reachability]
            if other_reach < reach or (other_reach == reach and self._first_seen.get(other, seen) < seen):
                return True
        return False

    def _claims(self, now: float, backed: Tracker | None = None) -> tuple[dict[str, int], list[Tracker]]:
        """Believable claims of live eligible members, this node's own (`_claim`) included, and
        the carried ones. A carried claim is believed at any term: a majority of live members
        backs it (which is how a newcomer learns the term), and voters back only believable ones.
        `backed`: the claim a seed backs while no member weighs here (see `anchor`), carried by the
        seed's word alone once its claimant is heard first-hand."""
        claims = dict(self._claiming)
        if self._claim:
            claims[self._node_id] = self._claim  # our record may lag behind a step-down
        live = self._electorate()
        followed = self._tracker
        carried = [claim for claim in (Tracker(term, node_id) for node_id, term in claims.items())
                   if claim == backed
                   or 2 * self._votes(claim) > live - (self._excused(now, claim) if claim == followed else 0)]
        highest = max((claim.term for claim in carried), default=0)
        self._highest_term = believable_terms(claims.values(), max(self._highest_term, highest))
        believable = {node_id: term for node_id, term in claims.items() if term <= self._highest_term}
        return believable, carried

    def _excused(self, now: float, tracker: Tracker) -> int:
        """How many live members the followed `tracker`'s majority leaves out: the newcomers that have
        not voted at its term or above yet (see the module's docstring), but never more than its votes,
        so a crowd of newcomers (a mesh forming) still unseats a claim that only a few carried."""
        return min(self._quiet_newcomers(now, tracker), self._votes(tracker))

    def _quiet_newcomers(self, now: float, tracker: Tracker) -> int:
        """How many newcomers have not voted at `tracker`'s term or above yet; forgets those that
        came a timeout or more ago."""
        while self._newcomers:
            node_id, since = next(iter(self._newcomers.items()))
            if since + self._config.election_timeout > now:  # as the timer for it reckons, to the bit
                break
            del self._newcomers[node_id]
        # bound once: the refresh after each member's news runs this over every newcomer
        live, counted, term = self._live, self._counted, tracker.term
        weighs = self._weighing if self.weighing else None
        return sum(counted.get(node_id, 1) for node_id in self._newcomers
                   if live[node_id].vote_term < term and (weighs is None or node_id in weighs))

    def _votes(self, claim: Tracker) -> int:
        own = self._node_id in self._live and self._vote == claim
        if self.weighing:
            return self._weighted[claim] + (self._own_weight() if own else 0)
        return self._tally[claim] + own

    def _wait(self, deadline: float) -> None:
        self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)

    def _refresh(self, now: float) -> None:
        backed = self._backed() if self._anchors and not self.weighing else None
        if backed is not None:
            self._follow(now, backed)
            if self.weighing:
                backed = None  # its placements weigh: majorities go by weight from now on
        claims, carried = self._claims(now, backed)
        if backed is not None:
            carried = [claim for claim in carried if claim == backed]
        tracker = max(carried, default=None)
        if tracker is not None:
            self._follow(now, tracker)
        if self._claim:
            own = Tracker(self._claim, self._node_id)
            # Another tracker is carried, or we voted for a better claim (`_cast` backs a higher one
            # only once its candidate's turn has come, so a newcomer's higher claims unseat nobody).
            if (tracker is not None and tracker != own) or self._vote != own:
                self._claim = 0
        if tracker is not None:
            # Endorse the tracker we follow, so it keeps a majority as the mesh grows.
            self._vote = tracker
        else:
            self._cast(now, claims)
        self._tracker = tracker
        if tracker is not None:
            self._vacant_since = None
            self._deadline = None
            if backed is None and self._newcomers and 2 * self._votes(tracker) <= self._electorate():
                # carried thanks to newcomers yet to vote: look again when the oldest one's grace ends. With
                # none left there is no grace to wait out: following a tracker newly carried weighs every
                # member again (`_follow`), which can leave it half the new weights with no newcomer among
                # them (an attacker's run of CI raised StopIteration here)
                self._wait(next(iter(self._newcomers.values())) + self._config.election_timeout)
        elif self._vacant_since is None:
            self._vacant_since = now
            self._deadline = None
            self._wait(now + self._config.election_timeout)

    def _cast(self, now: float, claims: dict[str, int]) -> None:
        """With no tracker carried: vote for the best candidate's believable claim above our last
        vote. A candidate some member clearly outranks is backed only two timeouts into the
        vacancy, after the best candidates have claimed (one timeout in): a newcomer rushing to
        claim, at however high a term, is not backed while its elders run."""
        voted = self._vote.term if self._vote is not None else 0
        vacant_since = self._vacant_since if self._vacant_since is not None else now
        timeout = self._config.election_timeout
        best: tuple[tuple[int, float, str], int] | None = None
        pending: float | None = None
        for node_id, term in claims.items():
            if term <= voted or not self._may_lead(node_id):
                continue
            due = vacant_since + 2 * timeout if self._outranked(node_id) else now
            if now < due:
                pending = due if pending is None else min(pending, due)
                continue
            option = (self._key(node_id), -term)
            if best is None or option < best:
                best = option
        if best is not None:
            self._vote = Tracker(-best[1], best[0][2])
            self._voted_at = now
        elif pending is not None:
            self._wait(pending)


def _drop(tally: Counter[Tracker], vote: Tracker, weight: int = 1) -> None:
    tally[vote] -= weight
    if not tally[vote]:
        del tally[vote]
