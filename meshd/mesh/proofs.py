"""What receipts prove: the checks a stage, the asker and the tracker make of them (sans-IO).

Every honest stage checks the chain of receipts that comes with an activation
before it computes a row (its links by hash, its sender's signature), and
forwards only a chain it checked. So when a
chain goes wrong, the node that handed it over is the one that broke it:
``check_chain`` says what is wrong, and its caller blames its authenticated
sender. That blame is one node's word (good enough to route around the
sender); a ``Proof`` is evidence anyone can check alone, and only a proof gets
a node excluded mesh-wide (``check_proof``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

from wire.receipt import NO_PREV, PackedChain, Proof


class InvalidProof(ValueError):
    """A proof that does not prove what it says (a bad signature, receipts of different steps...)."""


class BrokenChain(ValueError):
    """A chain of receipts that an honest sender would not have forwarded. ``culprit``: where the
    checker can say better than "the sender", the index in the chain of the receipt whose signer
    signed over a forged one."""

    def __init__(self, reason: str, culprit: int | None = None) -> None:
        super().__init__(reason)
        self.culprit = culprit


# Whether a node serves a model's layer range as far as the checker knows (the tracker: its own
# assignment). Witnesses that do not are not counted, so made-up identities cannot outvote a stage.
Serves = Callable[[str, str, int, int], bool]


# What a member's word weighs as a witness, or against a witness as a culprit: 1 plus the extra votes
# its served work earns it (meshd.mesh.credit.extra_votes, as the election has them).
Weight = Callable[[str], int]


def _anyone(node_id: str, model: str, begin: int, end: int) -> bool:
    return True


def _once(node_id: str) -> int:
    return 1


def check_proof(proof: Proof, serves: Serves = _anyone, weight: Weight = _once) -> str:
    """The culprit's node id if ``proof`` holds; raises InvalidProof otherwise. A divergence's
    witnesses, each placed on the range (``serves``), must together weigh more than the culprit
    (``weight``): two placed identities that served nobody convict a stage that served nobody either,
    and framing one that served takes witnesses that served too (meshd.mesh.authority)."""
    culprit = proof.culprit
    for receipt in (culprit, *proof.witnesses):
        if not receipt.verify():
            raise InvalidProof(f"a receipt signed as {receipt.node_id[:16]} has a bad signature")
        if not receipt.same_step(culprit):
            raise InvalidProof("the receipts speak of different steps")
    if proof.kind == "equivocation":
        other = proof.witnesses[0]
        if len(proof.witnesses) != 1 or other.node_id != culprit.node_id:
            raise InvalidProof("an equivocation is two receipts of one signer")
        if other.h_out == culprit.h_out:
            raise InvalidProof("the two receipts agree")
        return culprit.node_id
    signers = {w.node_id for w in proof.witnesses}
    if culprit.node_id in signers:
        raise InvalidProof("the culprit cannot witness against itself")
    if len(signers) != len(proof.witnesses) or len(signers) < 2:
        raise InvalidProof("a divergence needs at least two distinct witnesses")
    if len({w.h_out for w in proof.witnesses}) != 1:
        raise InvalidProof("the witnesses disagree among themselves")
    if proof.witnesses[0].h_out == culprit.h_out:
        raise InvalidProof("the culprit agrees with its witnesses")
    for w in proof.witnesses:
        if not serves(w.node_id, w.model, w.layer_begin, w.layer_end):
            raise InvalidProof(f"witness {w.node_id[:16]} does not serve layers [{w.layer_begin}, {w.layer_end})")
    witnessed, accused = sum(max(0, weight(w.node_id)) for w in proof.witnesses), weight(culprit.node_id)
    if witnessed <= accused:
        raise InvalidProof(f"the witnesses weigh {witnessed} against the culprit's {accused}: a stage that served "
                           f"more than its accusers is convicted only by witnesses that served more")
    return culprit.node_id


class Step(NamedTuple):
    """What the receiver of a chain knows of the step it comes with (a tuple: one is made per step
    and stage, where a frozen dataclass's constructor costs several times as much)."""

    session: str
    epoch: int
    pos: int
    n_tokens: int
    # the layer the chain must reach: where the receiver's range begins (the asker: n_layer)
    until: int
    # the authenticated sender, whose receipt comes last
    sender: str
    # the hash of the rows (or token ids) the sender's receipt must say it put out
    h_out: bytes
    # rows fed by the ring (past the prompt): the chain must start with the tail's receipt of the token
    decode: bool


def check_chain(chain: PackedChain, step: Step, signatures: Literal["sender", "all", "later"] = "all") -> None:
    """Raises BrokenChain unless ``chain`` is every stage's signed receipt of ``step``, head first:
    consecutive ranges from layer 0, each one's output the next one's input and its ``h_prev`` the
    hash of the one before, the sender's last.

    A step fed by the ring may start with the tail's receipt of the step before, whose output
    (the sampled token) is the head's input: then the head cannot take in another token
    unseen, and a tail that signs one token to the asker and another to the head has signed
    two receipts of one step (an equivocation).

    The checks read the chain's fields and hash its bytes as they came (``PackedChain``): no
    receipt is built. ``signatures``: a stage checks only its sender's (``"sender"``): each
    receipt's signature covers the one before it by hash, and an honest sender checked its own
    upstream's; ``"all"`` checks them all; the asker (``"later"``) none: only where a receipt
    becomes evidence (``check_signatures``, ``Audit.answerable``). Every link is checked by hash
    before any signature (they cost most)."""
    links = chain.links
    if (chain.session, chain.epoch) != (step.session, step.epoch):
        raise BrokenChain(f"receipts of another session or epoch ({chain.epoch})")
    first = 0
    if step.decode:
        # a decode step's chain starts with the tail's receipt of the step that sampled its token
        # the tail's receipt starts past layer 0, but on a route of one stage, where it covers every layer
        if not links or (links[0].layer_begin == 0 and links[0].layer_end != step.until):
            raise BrokenChain("a step fed by the ring without the tail's receipt of its token")
        ring = links[0]
        if ring.pos + ring.n_tokens != step.pos:
            raise BrokenChain("the tail's receipt before the chain is of another step")
        if len(links) < 2 or links[1].h_in != ring.h_out:
            raise BrokenChain("the head took in another token than the tail's receipt signs")
        first = 1
    if len(links) <= first:
        raise BrokenChain("no receipts")
    layer = 0
    h_out = b""
    for k in range(first, len(links)):
        r = links[k]
        if r.pos != step.pos or r.n_tokens != step.n_tokens:
            raise BrokenChain(f"receipt {k - first} is of another step ({r.pos}+{r.n_tokens})")
        if r.layer_begin != layer or r.layer_end <= r.layer_begin:
            raise BrokenChain(f"receipt {k - first} covers layers [{r.layer_begin}, {r.layer_end}), "
                              f"expected from {layer}")
        if k > first and r.h_in != h_out:
            raise BrokenChain(f"receipt {k - first} took in other rows than receipt {k - first - 1} put out")
        layer, h_out = r.layer_end, r.h_out
    if not step.decode and links[0].h_prev != NO_PREV:
        raise BrokenChain("receipt 0 does not follow the receipt before it")
    for k in range(1, len(links)):
        if links[k].h_prev != chain.hash(k - 1):
            raise BrokenChain(f"receipt {k} does not follow the receipt before it")
    last = links[-1]
    if layer != step.until:
        raise BrokenChain(f"the receipts end at layer {layer}, not {step.until}")
    if last.node_id != step.sender:
        raise BrokenChain("the last receipt is not the sender's")
    if last.h_out != step.h_out:
        raise BrokenChain("the rows are not the ones the sender's receipt signs")
    if signatures != "later":
        check_signatures(chain, everyone=signatures == "all")


def check_signatures(chain: PackedChain, everyone: bool = True) -> None:
    """Raises BrokenChain naming who signed over a receipt whose signature does not hold (None: the
    sender, whose own is bad). ``everyone`` False: the sender's alone."""
    # from the sender's back: the first bad one was signed over by the (checked) receipt after it
    last = len(chain) - 1
    for k in range(last, -1 if everyone else last - 1, -1):
        if not chain.verify(k):
            raise BrokenChain(f"receipt {k} has a bad signature", None if k == last else k + 1)
