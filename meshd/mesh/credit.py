"""Credit where it is due: the ledger of served work each member keeps and weighs alone (sans-IO).

Every member holds the summaries of served work it has heard of (``wire.credit.WorkSummary``: the
asker's countersignature over the stage's own last receipt of an ask), checked as they come
(``check_summary``), and gossips digests of them (``Ledger.roots``, ``Ledger.ids``): a member pulls
what it lacks from a peer whose root differs, so every member ends up holding the same set, with
no coordinator. What a member's credit is follows from that set and from who the member's view
says is placed (meshd.mesh.authority), by one rule (``Ledger.standing``):

- **Work** of a summary: layers x tokens (prompt and generated, as the stage's receipt signs them),
  whole if a replica checked the range to the end, half if not (``UNCHECKED_WEIGHT``).
- **Once per asker per window.** The work one asker credits one stage is summed per hour
  (``WINDOW``) and capped there (``ASKER_WINDOW_CAP``): one asker, however busy, buys a stage at
  most one cap an hour, so credit says how many askers a member served, not how often one did.
- **Decay.** A window's work counts ``0.5 ** (age / HALF_LIFE)`` (a week). Summaries are held and
  gossiped for ``FOLD_AFTER`` (two days), then each member folds them into figures of its own per
  member (``Ledger.fold``), kept until ``HORIZON`` (eight weeks): credit lasts as long as its decay
  says, in a few floats a member rather than a summary an ask.
- **Payers.** Work counts only from an asker that is a placed volunteer (its placement signed by a
  tracker this node followed) or holds credit itself, and an asker that is not placed pays at most
  what it earned (its payments are scaled down to its earnings): credit moves among identities
  that serve no one placed, it is never minted there. A ring of free identities asking each other
  earns nothing; a stage countersigning itself through a second identity earns only what that
  identity earned elsewhere, and loses it there.
- **Balance** = earned - spent, where spent is the (capped, decayed) work the member asked of others.

A summary's asker must not be its stage, its receipt must verify and name the summary's model,
range and positions, and its time must not be far in the receiver's future nor in an hour already
folded. Bounded: at most ``MAX_SUMMARIES`` held, some 1 kB each (the ones of askers that do not pay go
first when full, then the oldest hour is folded early), at most ``ASKER_WINDOW_SUMMARIES`` per asker
and hour, and the folded figures of at most ``MAX_FOLDED`` members.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import sys
from collections import defaultdict, deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

import msgpack

from wire.credit import BUCKETS, IDS_PAGE, RECENT, LedgerIds, LedgerRoots, WorkSummary

WINDOW = 3600.0
HALF_LIFE = 7 * 86400.0
HORIZON = 8 * 7 * 86400.0
# summaries are held and gossiped this long, then folded into per-member figures (``Ledger.fold``)
FOLD_AFTER = 2 * 86400.0
# members whose folded figures a ledger keeps: the member table's order of size, a few floats each
MAX_FOLDED = 1 << 14
# work units (layers x tokens) one asker credits one stage per window: a 32-layer range over 2,048
# tokens; about ten ordinary asks (a few hundred tokens) of a whole small model
ASKER_WINDOW_CAP = 32.0 * 2048
UNCHECKED_WEIGHT = 0.5
# a summary dated this far past the receiver's clock is refused (clocks of volunteers drift)
MAX_FUTURE = 600.0
MAX_SUMMARIES = 1 << 16
# summaries one asker may put in the ledger per window: a busy asker's asks, not a flood
ASKER_WINDOW_SUMMARIES = 256
# a member with no credit (a newcomer) is still given this share of a stage's slots under contention
NEWCOMER_FLOOR = 0.25
# rounds of the payer fixed point: credit passes one hop of non-placed askers per round
PAYER_ROUNDS = 8

_EMPTY = hashlib.blake2b(b"meshd/ledger/empty", digest_size=16).digest()


class InvalidSummary(ValueError):
    """A summary that proves no work: a bad signature, a receipt of something else, a stage asking itself."""


def check_summary(summary: WorkSummary, now: float) -> str:
    """The stage's node id if `summary` holds at Unix time `now`; InvalidSummary otherwise."""
    head = summary.head
    if summary.layer_end <= summary.layer_begin:
        raise InvalidSummary("an empty layer range")
    if (head.model, head.layer_begin, head.layer_end) != (summary.model, summary.layer_begin, summary.layer_end):
        raise InvalidSummary("the stage's receipt is of another model or range than the summary")
    if head.pos + head.n_tokens != summary.prompt_tokens + summary.generated_tokens:
        raise InvalidSummary(f"the stage signed {head.pos + head.n_tokens} positions, the summary claims "
                             f"{summary.prompt_tokens + summary.generated_tokens}")
    if summary.at > now + MAX_FUTURE:
        raise InvalidSummary("a summary dated in the future")
    if summary.at < now - FOLD_AFTER:
        raise InvalidSummary("a summary older than the ledger holds (its hour is folded)")
    stage = head.node_id
    if stage == summary.asker:
        raise InvalidSummary("a stage cannot countersign its own work")
    if not summary.verify():
        raise InvalidSummary("the asker's signature does not hold")
    if not head.verify():
        raise InvalidSummary("the stage's receipt does not hold")
    return stage


def work_of(summary: WorkSummary) -> float:
    """Layers x tokens, halved where no replica checked the range to the end."""
    return work(summary.layer_end - summary.layer_begin, summary.prompt_tokens + summary.generated_tokens,
                summary.checked)


def work(layers: int, tokens: int, checked: bool) -> float:
    return float(layers * tokens) * (1.0 if checked else UNCHECKED_WEIGHT)


@dataclass
class Standing:
    """One member's credit in one node's view (work units, decayed)."""

    earned: float = 0.0
    spent: float = 0.0
    placed: bool = False

    @property
    def balance(self) -> float:
        return self.earned - self.spent


@dataclass
class Ledger:
    """The summaries a node holds, their digests, and the credit they give each member.

    A summary is held packed (667 bytes, where the decoded model took some 4 kB) beside the few
    figures the rule reads of it (``Fact``); it is decoded again only to be given to a peer."""

    most: int = MAX_SUMMARIES
    # the work one asker credits one stage per window (ASKER_WINDOW_CAP: a test mesh's is smaller, so it
    # earns a cap's worth in a few asks; every member of a mesh must hold the same)
    cap: float = ASKER_WINDOW_CAP
    _held: dict[bytes, Fact] = field(default_factory=dict)
    _packed: dict[bytes, bytes] = field(default_factory=dict)
    _buckets: list[set[bytes]] = field(default_factory=lambda: [set() for _ in range(BUCKETS)])
    _digests: list[bytes | None] = field(default_factory=lambda: [None] * BUCKETS)
    _root: bytes | None = None
    # (at, id) of every summary held, oldest first (lazily: ids evicted stay until popped)
    _ages: list[tuple[int, bytes]] = field(default_factory=list)
    _per_window: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))
    # the askers that pay, with the share of their payments that counts (1 for the placed), as the rule
    # last found them: their summaries go last when the ledger is full, and fold at that share
    _payers: Mapping[str, float] = field(default_factory=dict)
    # per member: (earned, spent, Unix time they hold at) of the summaries folded (see `fold`)
    _folded: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    # the hours before this Unix time are folded: a summary of them is refused (it may be counted already)
    _folded_until: float = 0.0
    # the ids taken last (sent with roots that differ)
    _recent: deque[bytes] = field(default_factory=lambda: deque(maxlen=RECENT))
    # bumped at each change: what a cached standing was worked out from
    version: int = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, summary_id: object) -> bool:
        return summary_id in self._held

    def add(self, now: float, summary: WorkSummary) -> bool:
        """Checks and keeps `summary`; True if it was news. InvalidSummary for one that does not
        hold or is over its asker's share."""
        summary_id = summary.id
        if summary_id in self._held:
            return False
        window = (summary.asker, int(summary.at // WINDOW))
        # the cheap refusal before the signatures are checked (two Ed25519 verifications a summary)
        if self._per_window.get(window, 0) >= ASKER_WINDOW_SUMMARIES:
            raise InvalidSummary(f"asker {summary.asker[:16]} has put {ASKER_WINDOW_SUMMARIES} summaries in "
                                 f"this hour's ledger already")
        if summary.at < self._folded_until:
            raise InvalidSummary("a summary of an hour this ledger has folded")
        check_summary(summary, now)
        if len(self._held) >= self.most and not self._make_room(now, summary):
            raise InvalidSummary("the ledger is full of summaries that count for more")
        self._per_window[window] += 1
        # node ids interned: a member's id is held once, however many summaries name it
        self._held[summary_id] = (summary_id, summary.head.hash, sys.intern(summary.stage), sys.intern(summary.asker),
                                  summary.at, work_of(summary))
        self._packed[summary_id] = msgpack.packb(summary.model_dump(), use_bin_type=True)
        heapq.heappush(self._ages, (summary.at, summary_id))
        self._recent.append(summary_id)
        self._touch(summary_id, add=True)
        return True

    def expire(self, now: float) -> int:
        """Folds the summaries of the hours that ended ``FOLD_AFTER`` ago (see `fold`), and forgets the
        folded figures past the horizon; returns how many summaries folded."""
        folded = self.fold(now, (now - FOLD_AFTER) // WINDOW * WINDOW)
        for member, (_, _, at) in list(self._folded.items()):
            if at < now - HORIZON:
                del self._folded[member]
        return folded

    def fold(self, now: float, until: float) -> int:
        """Folds every summary of the hour windows ended by Unix time `until` into per-member figures
        (earned, spent: as the rule would count them now, each asker's hour capped and its payments
        at the share the rule last found for it) and drops them from the ledger and its digests.

        Summaries are held, gossiped and audited for ``FOLD_AFTER`` (two days: some 43,000 at 1,000
        members), while credit halves weekly: past that, a member keeps only what it made of them
        itself, a few floats a member, and refuses them from anyone (``check_summary``), so a folded
        summary is never counted twice. A member that joins later sees the last two days whole and
        nothing older: the members' standings differ by what they folded, never by what they hold."""
        pairs: dict[tuple[str, str, int], float] = defaultdict(float)
        folded = 0
        self._folded_until = max(self._folded_until, until)
        while self._ages and (self._ages[0][0] // WINDOW + 1) * WINDOW <= until:
            _, summary_id = heapq.heappop(self._ages)
            fact = self._held.get(summary_id)
            if fact is None:
                continue
            _, _, stage, asker, at, work = fact
            pairs[(stage, asker, int(at // WINDOW))] += work
            self._drop(summary_id)
            folded += 1
        for (stage, asker, window), work in pairs.items():
            counted = min(work, self.cap) * 0.5 ** (max(0.0, now - (window + 1) * WINDOW) / HALF_LIFE)
            self._fold_into(asker, now, 0.0, counted)
            if asker in self._payers:
                self._fold_into(stage, now, counted * self._payers[asker], 0.0)
        return folded

    def _fold_into(self, member: str, now: float, earned: float, spent: float) -> None:
        held_earned, held_spent, at = self._folded.pop(member, (0.0, 0.0, now))
        decay = 0.5 ** (max(0.0, now - at) / HALF_LIFE)
        self._folded[member] = (held_earned * decay + earned, held_spent * decay + spent, now)
        if len(self._folded) > MAX_FOLDED:
            # the member whose figures changed longest ago goes (what is left of them is the least)
            del self._folded[next(iter(self._folded))]

    def _make_room(self, now: float, incoming: WorkSummary) -> bool:
        """Frees one place for `incoming`: the oldest summary of an asker that does not pay, else (if
        `incoming`'s asker pays) the oldest hour's summaries, folded."""
        unpaid = [(fact[4], i) for i, fact in self._held.items() if fact[3] not in self._payers]
        if unpaid:
            self._drop(min(unpaid)[1])
            return True
        if incoming.asker not in self._payers:
            return False
        while self._ages and self._ages[0][1] not in self._held:
            heapq.heappop(self._ages)
        return bool(self._ages) and self.fold(now, (self._ages[0][0] // WINDOW + 1) * WINDOW) > 0

    def _drop(self, summary_id: bytes) -> None:
        fact = self._held.pop(summary_id)
        del self._packed[summary_id]
        window = (fact[3], int(fact[4] // WINDOW))
        self._per_window[window] -= 1
        if self._per_window[window] <= 0:
            del self._per_window[window]
        self._touch(summary_id, add=False)

    def _touch(self, summary_id: bytes, add: bool) -> None:
        bucket = summary_id[0]
        (self._buckets[bucket].add if add else self._buckets[bucket].discard)(summary_id)
        self._digests[bucket] = None
        self._root = None
        self.version += 1

    # ----- digests, for gossip

    def digest(self, bucket: int) -> bytes:
        held = self._digests[bucket]
        if held is None:
            ids = sorted(self._buckets[bucket])
            held = self._digests[bucket] = hashlib.blake2b(b"".join(ids), digest_size=16).digest() if ids else _EMPTY
        return held

    @property
    def root(self) -> bytes:
        if self._root is None:
            self._root = hashlib.blake2b(b"".join(self.digest(b) for b in range(BUCKETS)), digest_size=16).digest()
        return self._root

    def roots(self, theirs: bytes, walk: bool = False) -> LedgerRoots:
        """The answer to a peer whose root is `theirs`: where they differ, the ids taken last, and with
        `walk` the bucket digests."""
        root = self.root
        if theirs == root:
            return LedgerRoots(root=root, count=len(self._held))
        return LedgerRoots(root=root, count=len(self._held), recent=[i for i in self._recent if i in self._held],
                           buckets=[self.digest(b) for b in range(BUCKETS)] if walk else [])

    def ids(self, bucket: int, offset: int) -> LedgerIds:
        ids = sorted(self._buckets[bucket])
        return LedgerIds(bucket=bucket, ids=ids[offset:offset + IDS_PAGE], total=len(ids))

    def differing(self, theirs: LedgerRoots) -> list[int]:
        """The buckets whose digests differ from a peer's (none if its answer has no digests)."""
        return [b for b, d in enumerate(theirs.buckets) if d != self.digest(b)] if len(theirs.buckets) == BUCKETS \
            else []

    def missing(self, ids: Iterable[bytes]) -> list[bytes]:
        return [i for i in ids if i not in self._held]

    def fetch(self, ids: Iterable[bytes]) -> list[WorkSummary]:
        return [WorkSummary.model_validate(msgpack.unpackb(self._packed[i], raw=False)) for i in ids if i in self._packed]

    # ----- credit

    def standing(self, now: float, placed: Collection[str]) -> dict[str, Standing]:
        """Every member's credit at Unix time `now`, with `placed` the members this node's view says
        are placed (and the tracker it follows): see the module's rule."""
        standing, payers = standing_of(self.facts(), now, placed, self.folded(), self.cap)
        self.paying(payers)
        return standing

    def facts(self) -> list[Fact]:
        """What the rule reads of each summary held, taken at once (the rule may then run in a thread
        while the ledger takes more)."""
        return list(self._held.values())

    def folded(self) -> dict[str, tuple[float, float, float]]:
        """Per member, (earned, spent, when) of the summaries folded, taken at once as `facts` is."""
        return dict(self._folded)

    def paying(self, payers: Mapping[str, float]) -> None:
        """The askers that pay and the share of their payments that counts, as the rule last found them."""
        self._payers = payers

    def between(self, me: str, now: float) -> dict[str, tuple[float, float]]:
        """Per peer: (the work it served `me`, the work `me` served it), decayed, uncapped, of the
        summaries held."""
        out: dict[str, tuple[float, float]] = {}
        for _, _, stage, asker, at, work in self._held.values():
            decay = 0.5 ** (max(0.0, now - at) / HALF_LIFE)
            if asker == me:
                served, asked = out.get(stage, (0.0, 0.0))
                out[stage] = (served + work * decay, asked)
            elif stage == me:
                served, asked = out.get(asker, (0.0, 0.0))
                out[asker] = (served, asked + work * decay)
        return out


# (stage, asker) -> hour window (Unix seconds // WINDOW) -> the work the asker countersigned the stage
Windows = dict[tuple[str, str], dict[int, float]]
# what the rule reads of one summary: its id, its receipt's hash, stage, asker, time and work
Fact = tuple[bytes, bytes, str, str, int, float]
# per member: (earned, spent, the Unix time they hold at) of the summaries a ledger folded
Folded = Mapping[str, tuple[float, float, float]]


def standing_of(facts: Iterable[Fact], now: float, placed: Collection[str], folded: Folded | None = None,
                cap: float = ASKER_WINDOW_CAP) -> tuple[dict[str, Standing], dict[str, float]]:
    """The rule over a ledger's `facts` (and what it `folded`): a receipt countersigned twice (by another
    asker too) counts once, the same one everywhere (the least summary id); then ``credit_standing``."""
    by_head: dict[bytes, Fact] = {}
    for fact in facts:
        held = by_head.get(fact[1])
        if held is None or fact[0] < held[0]:
            by_head[fact[1]] = fact
    windows: Windows = defaultdict(lambda: defaultdict(float))
    for _, _, stage, asker, at, work in by_head.values():
        windows[(stage, asker)][int(at // WINDOW)] += work
    return credit_standing(windows, now, placed, folded, cap)


def credit_standing(windows: Windows, now: float, placed: Collection[str], folded: Folded | None = None,
                    cap: float = ASKER_WINDOW_CAP) -> tuple[dict[str, Standing], dict[str, float]]:
    """The rule (see the module): every member's standing from the work each asker countersigned each
    stage per window (up to `cap`) (and what a ledger folded of older ones), and the askers that pay with the share
    of their payments that counts. The simulation (tools/sim_credit.py) runs this too."""
    pair: dict[tuple[str, str], float] = {}
    for stage_asker, by_window in windows.items():
        pair[stage_asker] = sum(min(work, cap) * 0.5 ** (max(0.0, now - (w + 1) * WINDOW) / HALF_LIFE)
                                for w, work in by_window.items())
    paid: dict[str, float] = defaultdict(float)
    for (_, asker), work in pair.items():
        paid[asker] += work
    old_earned: dict[str, float] = {}
    old_spent: dict[str, float] = {}
    for member, (earned_then, spent_then, at) in (folded or {}).items():
        decay = 0.5 ** (max(0.0, now - at) / HALF_LIFE)
        old_earned[member], old_spent[member] = earned_then * decay, spent_then * decay
    placed_set = frozenset(placed)
    payers = set(placed_set)
    scale = dict.fromkeys(placed_set, 1.0)
    earned: dict[str, float] = {}
    for _ in range(PAYER_ROUNDS):
        earned = defaultdict(float, old_earned)
        for (stage, asker), work in pair.items():
            if asker in payers:
                earned[stage] += work * scale[asker]
        grown = {m for m, e in earned.items() if e > 0.0} | placed_set
        scale = {a: 1.0 if a in placed_set or not paid[a] else min(1.0, earned.get(a, 0.0) / paid[a]) for a in grown}
        if grown == payers:
            break
        payers = grown
    standing: dict[str, Standing] = defaultdict(Standing)
    for member, work in earned.items():
        standing[member].earned = work
    for asker in paid.keys() | old_spent.keys():
        standing[asker].spent = paid.get(asker, 0.0) + old_spent.get(asker, 0.0)
    for member in placed_set:
        standing[member].placed = True
    return dict(standing), {a: scale[a] for a in payers}


# A weighing member's extra votes for the work it served (meshd.mesh.election.credit), of what it earned:
# one for a window cap's worth (one asker's most in an hour), one more per doubling, at most MAX_EXTRA_VOTES.
# Coarse on purpose: members' ledgers differ for a gossip round or two, and a vote's weight should not.
MAX_EXTRA_VOTES = 4
# how often a member gives its election each member's extra votes again (meshd.daemon.credit): rarely, as
# ledgers agree a round or two late (a test mesh sets seconds, not to wait a minute for the first weighing)
VOTES_EVERY = 60.0


def extra_votes(earned: float, cap: float = ASKER_WINDOW_CAP) -> int:
    if not math.isfinite(earned) or earned < cap:
        return 0
    return min(MAX_EXTRA_VOTES, int(math.log2(earned / cap)) + 1)


# What being placed (a volunteer serving a range now) adds to a member's rank: above every member that
# serves nothing, below any real balance (one layer of one token). tools/sim_credit.py: without it, the
# placed volunteers that asked more than they served shared the newcomers' floor with the free-riders,
# who then got 27% of the service (200 members, a day) against a floor of 25%.
PLACED_PRIORITY = 1.0


def priority(balance: float, placed: bool = False) -> float:
    """A session's rank under contention: its asker's balance, with every member at or below zero ranked
    alike at zero, and a placed volunteer (one that serves now) above those that serve nothing."""
    return (max(0.0, balance) if math.isfinite(balance) else 0.0) + (PLACED_PRIORITY if placed else 0.0)


# API keys whose use a front door keeps (the key file's 64 KiB holds about this many short keys); past
# it the key used longest ago is forgotten, as if it had spent nothing
MAX_KEYS = 4096


def key_share(member: Standing | None, placed: bool, spent: float, keys: int) -> float:
    """The share of its member's rank (``priority``) the asks of one of a front door's `keys` API keys
    carry, where that key's own asks have spent `spent` (decayed as credit is). Each key has a balance
    of its own: an equal part of what the member earned, less what the key spent, and never more than
    the member's balance. So a key that spent its part ranks as a member with nothing left (placed or
    not, as the member is) whatever the others left unspent, and one key's use never takes another's
    part of the member's priority. One key (or none: the door is open to its loopback) is the member."""
    balance = member.balance if member is not None else 0.0
    whole = priority(balance, placed)
    if keys <= 1 or whole <= 0.0:
        return 1.0
    earned = member.earned if member is not None else 0.0
    return priority(min(balance, earned / keys - spent), placed) / whole


@dataclass
class KeyShares:
    """What each of a front door's API keys spent of its member's credit (work units, halving each
    ``HALF_LIFE`` as credit does), by the label the door knows a key by."""

    most: int = MAX_KEYS
    # label: (work, Unix time it was reckoned at), the one used longest ago first
    _spent: dict[str, tuple[float, float]] = field(default_factory=dict)

    def spend(self, key: str, work: float, now: float) -> None:
        self._spent[key] = (self.spent(key, now) + max(0.0, work), now)
        if len(self._spent) > self.most:
            del self._spent[next(iter(self._spent))]

    def spent(self, key: str, now: float) -> float:
        held = self._spent.pop(key, None)
        if held is None:
            return 0.0
        spent: float = held[0] * 0.5 ** (max(0.0, now - held[1]) / HALF_LIFE)
        self._spent[key] = (spent, now)  # last in order: used just now
        return spent
