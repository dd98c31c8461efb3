"""Authority that costs something: whose votes and witness receipts count, and how long an exclusion lasts (sans-IO).

Identities are free, so a count of identities is no authority: three extra keys, each a real link,
once outvoted a three-member mesh for the tracker role, and two keys whose own records claimed a
range once framed an honest stage. The floor of the rule is *placed-and-measured*; on top of it a
placed member weighs once more per doubling of the work it served in the ledger of served work
(meshd.mesh.credit.extra_votes: a window cap's worth earned gives one more, at most four), in votes,
as a proof's witness and as an accuser (``Election.weight_of``), so placed identities that served
nobody need up to five times the honest members' count to take the tracker, and framing a stage
that served takes witnesses that served more:

- **Placed.** The tracker signs each range it assigns (`wire.swim.Placement`: tracker, term,
  member, model, range) and the member carries that signature in its own record, so every member
  can check who the tracker placed, with no word of the member's own. A member *weighs* in this
  node's view if its record carries a placement signed by a tracker this node followed (the one
  it follows now or the one before: `FOLLOWED_KEPT`), at the term it followed it in. The
  followed tracker weighs too (it won its term). A member once seen so placed keeps its weight
  for `EARNED_FOR` while it is gone and after (a partition: each side's new tracker re-places its
  side, and when the sides meet each still counts the other's members, so one tracker remains).
- **Measured.** The tracker's probe timings (meshd.mesh.probes) stay on the tracker, so other
  members cannot see them. What they see is the placement, which the tracker gives only to a
  member that volunteers memory for a range, holds or fetches its layers, and keeps answering
  SWIM; the tracker then times each placed stage at once and places anew a member far slower than
  it said. The weight is therefore the tracker's judgement, signed, not the member's word.

What counts:

- **Elections** (meshd.mesh.election): once any live member weighs, the electorate is the members
  that weigh, and a claim is carried by the votes of more than half of them; identities with no
  placement neither vote nor count toward the majority. Before any placement (a fresh mesh, or
  every placed member gone) the election counts every live member heard from first-hand, as it
  always did, so a mesh can still bootstrap. Only a member that weighs is backed for tracker: a
  free identity around longer than anyone would otherwise win the honest votes of a vacancy. A
  newcomer has no placement to weigh anyone by until it follows a tracker, so until members
  weigh in its view it follows only the claim its seed backs (`Election.anchor`), on the seed's
  word: counting heads, it would follow whatever claim enough free identities back, or drop its
  seed's when they outnumber the members it has heard from first-hand.
- **Witnesses** (meshd.mesh.proofs, `MeshDuty.accept_proof`): a divergence proof counts only with
  witnesses placed on exactly that model and range (the tracker: by its own assignment; any other
  node: by the placements it knows, never by a witness's own `served`), whose weights (1 + extra
  votes each) together exceed the culprit's. A node never accepts a proof against itself
  (`ProofAgainstSelf`, refused and not passed on).
- **Accusations** (meshd.mesh.suspicion): a Lifeguard confirmation of a suspicion counts by its
  accuser's weight, so free identities cannot hurry an honest member's death.
- **Exclusions expire** (`Exclusions`): a proven culprit is kept out of placements and routes for
  `EXCLUSION_SECONDS`, then judged again; a new proof (another lie, not the same one replayed)
  renews it. While excluded, a culprit weighs nothing in the election (`Election.disown`),
  whatever placement its record still carries.

What an attacker needs, for a mesh of H honest members, all placed (spare capacity becomes
replicas), and a model cut into S segments of W bytes (weights and KV) each; S comes from the
model and the members' memory, not from H:

=================  ==========================================  ==========================================
honest members H    take the tracker (honest with 8 caps of     frame an honest stage (an hour out)
                    work each weigh 5, fresh ones 1)
=================  ==========================================  ==========================================
10                  51 placed identities (11 against fresh       victim that served nothing: 2 identities
                    members, or 11 that served each other 8      placed on its segment (about 2 S placed to
                    caps: an hour, 5.8 M layer x tokens)         steer two there); victim at weight 5: 6
100                 501 (101; 101 in an hour, 53 M)              such, or 2 that served 2 caps each
1,000               5,001 (1,001; 1,001 in an hour, 525 M)       (262,144 layer x tokens), any H
=================  ==========================================  ==========================================

Free identities count for nothing in either column, however many. A placed attacker with A
identities of weight w against H weighing members of weight v carries a claim only if
2 A w > A w + H v, so A > H v / w: with no served work (w = 1) against members that served
(v = 5), five times the mesh, of volunteers the honest tracker chose to place: each directly
dialable, offering a segment's memory, holding or fetching its layers, answering the tracker's
probes at the speed it claims and the spot checks of every route it serves (a lie caught there is
a proof, and an hour out). The limits: placed identities are payers, so a ring of them that serve
each other earns weight 5 in ceil(8 / (A - 1)) hours, and credit then adds nothing over the floor
(/tmp/proposals/credit.md names the candidates); before the first placement (a fresh mesh's first
seconds) H + 1 first-hand identities take the tracker, as before; two placed identities on one
segment, with enough served work to outweigh its members, can frame them and renew that with a
fresh receipt of the victim every half hour; and a liar that earned weight 5 is convicted mesh-wide
only by witnesses weighing 6 (its askers still route around it at once).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

from meshd.mesh.proofs import InvalidProof
from wire.receipt import Proof
from wire.swim import CapabilityRecord, Placement

# Trackers whose placements weigh: the one followed now and the one before it, so the members a
# new tracker has not re-placed yet (their asks a gossip round away) keep their weight meanwhile.
FOLLOWED_KEPT = 2
# How long a member seen placed by a followed tracker keeps its weight while its placement is not
# one this node follows (it was away, or a partition's other side re-placed it): an hour covers a
# partition that heals and a restart, and is long enough that holding weight means having served.
EARNED_FOR = 3600.0
# Members whose earned weight a node remembers: the member table's own order of size.
MAX_EARNED = 4096
# How long a proof keeps its culprit out of placements and routes. Proofs carry no clock, so an
# exclusion that never ended would hold a framing (or a fault since fixed) forever: an hour lets
# the mesh judge the member again at the cost of one more caught lie if it still lies.
EXCLUSION_SECONDS = 3600.0
# A culprit's exclusion is renewed (and the new proof passed on) at most once per this much: a
# stream of fresh proofs of one culprit costs each node one fan-out per half hour, not one each.
RENEW_AFTER = EXCLUSION_SECONDS / 2
# Proofs whose exclusion ran out, remembered so that replaying one does not exclude again.
MAX_SPENT = 4096


class ProofAgainstSelf(InvalidProof):
    """A proof naming this node as its culprit: a node never takes one (it would exclude itself on
    anyone's word, and pass that on)."""


def placement_of(record: CapabilityRecord, trackers: Collection[tuple[int, str]]) -> Placement | None:
    """`record`'s placement if it names `record`'s own node, was signed by one of `trackers`
    ((term, node id) pairs) at that term, and its signature holds; None otherwise."""
    placed = record.placement
    if placed is None or placed.node_id != record.node_id or (placed.term, placed.tracker) not in trackers:
        return None
    return placed if placed.verify() else None


def placed_on(record: CapabilityRecord, trackers: Collection[tuple[int, str]], model: str, start: int,
              end: int) -> bool:
    """Whether a tracker of `trackers` placed `record`'s node on exactly [start, end) of `model`."""
    placed = placement_of(record, trackers)
    return placed is not None and (placed.model, placed.start, placed.end) == (model, start, end)


@dataclass
class _Exclusion:
    proof: Proof
    since: float
    until: float


def _key(proof: Proof) -> bytes:
    # a culprit's receipt is signed once per lie: its signature names the lie
    return proof.culprit.signature


class Exclusions:
    """The proven liars a node keeps out of placements and routes, each until its exclusion expires.

    `proofs` is the live view (culprit: the proof that excluded it), for the callers that only ask
    who is out. Bounded: at most `most` culprits (OVERLOADED past them: `Full`), and `MAX_SPENT`
    expired proofs remembered."""

    class Full(Exception):
        """As many culprits are held as the node keeps."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.proofs: dict[str, Proof] = {}
        self._held: dict[str, _Exclusion] = {}
        self._spent: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._held

    def until(self, node_id: str) -> float | None:
        held = self._held.get(node_id)
        return held.until if held is not None else None

    def add(self, now: float, culprit: str, proof: Proof) -> bool:
        """Excludes `culprit` by `proof` (already checked); True if that is news to pass on: a new
        exclusion, or a renewal by another proof. InvalidProof for a proof whose exclusion already
        ran out (a replay is not a new lie)."""
        key = _key(proof)
        if key in self._spent:
            raise InvalidProof("this proof's exclusion has run out: excluding again takes a new lie")
        held = self._held.get(culprit)
        if held is not None:
            if _key(held.proof) == key or now < held.since + RENEW_AFTER:
                return False
        elif len(self._held) >= self.most:
            raise Exclusions.Full()
        self._held[culprit] = _Exclusion(proof, now, now + EXCLUSION_SECONDS)
        self.proofs[culprit] = proof
        return True

    def expire(self, now: float) -> list[str]:
        """Ends the exclusions due by `now`; returns their culprits."""
        ended = [node_id for node_id, held in self._held.items() if held.until <= now]
        for node_id in ended:
            held = self._held.pop(node_id)
            del self.proofs[node_id]
            self._spent[_key(held.proof)] = None
            if len(self._spent) > MAX_SPENT:
                self._spent.popitem(last=False)
        return ended

    def next_timer(self) -> float | None:
        return min((held.until for held in self._held.values()), default=None)
