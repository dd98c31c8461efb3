"""Served work and the credit it earns: the asker's countersigned summaries, vouchers, ledger gossip.

When an ask ends, the asker countersigns one ``WorkSummary`` per stage of its route: the model, the
range, the tokens (prompt and generated), whether a replica checked the range to the end, and the
stage's own last signed receipt of the session (``head``). Each receipt's ``h_hist`` chains every
input the session brought to the stage, and its positions say how many rows the stage ran, so the
summary claims no tokens the stage did not sign, and nobody mints one without both signatures. The
stage keeps it, and members gossip the summaries they hold (``LedgerRoots``, ``LedgerIds``,
``LedgerFetch``) so that each can weigh every member's credit alone (meshd.mesh.credit).

A ``Voucher`` lets an identity the member made for one command (``meshd ask``, the HTTP front
door: they dial from identities of their own) ask on the member's credit: the member signs that
node id, until a time, and a stage reads the opener's priority off the member the voucher names,
scaled by the voucher's ``share``: a front door gives each API key's asks the share of its member's
priority that the key's own use leaves it (meshd.mesh.credit.key_share).
"""

from __future__ import annotations

from typing import Annotated

import msgpack
from pydantic import Field

from wire.identity import NodeIdentity, node_id_of, verify
from wire.message import Message, WireModel
from wire.receipt import Hash, PublicKey, Receipt, row_hash
from wire.types import Count, Digest, Int32, Layer, NodeId

_SUMMARY_DOMAIN = b"meshd/work-summary/1\x00"
_VOUCHER_DOMAIN = b"meshd/voucher/1\x00"
Signature = Annotated[bytes, Field(max_length=64)]

# summaries one give or fetch carries: some 700 bytes each, well inside a mesh message (4 MiB)
MAX_SUMMARIES_PER_MESSAGE = 64
# the ledger's summaries fall in this many buckets by their id's first byte; a digest is one hash each
BUCKETS = 256
# ids one page of a bucket carries
IDS_PAGE = 1024
# members one page of `meshd credits` lists
CREDITS_PAGE = 512
# ids of the summaries a ledger took last, sent with roots that differ: what a member in step lacks
RECENT = 64
# a voucher's share of its payer's priority, in parts of this
SHARE_WHOLE = 1 << 16
Share = Annotated[int, Field(ge=0, le=SHARE_WHOLE)]


class WorkSummary(WireModel):
    """The asker's countersigned account of what one stage of its route served it in one ask."""

    asker: NodeId
    asker_key: PublicKey
    model: Digest
    layer_begin: Layer
    layer_end: Layer
    prompt_tokens: Int32
    generated_tokens: Int32
    # a replica checked the range's steps to the end of the answer, and they matched
    checked: bool
    # when the ask ended, in the asker's Unix seconds (the receiver refuses one far in its future)
    at: Count
    # the stage's last signed receipt of the session: its signer is the stage
    head: Receipt
    signature: Signature = b""

    @property
    def stage(self) -> str:
        return self.head.node_id

    @classmethod
    def create(cls, identity: NodeIdentity, model: str, layer_begin: int, layer_end: int, prompt_tokens: int,
               generated_tokens: int, checked: bool, at: int, head: Receipt) -> WorkSummary:
        unsigned = cls(asker=identity.node_id, asker_key=identity.public_key, model=model, layer_begin=layer_begin,
                       layer_end=layer_end, prompt_tokens=prompt_tokens, generated_tokens=generated_tokens,
                       checked=checked, at=at, head=head)
        return unsigned.model_copy(update={"signature": identity.sign(unsigned.signing_bytes())})

    def signing_bytes(self) -> bytes:
        fields = self.model_dump(exclude={"signature", "head"})
        # the receipt signs itself; the summary signs the receipt whole, by its hash (signature included)
        packed: bytes = msgpack.packb([fields, self.head.hash], use_bin_type=True)
        return _SUMMARY_DOMAIN + packed

    def verify(self) -> bool:
        """Signed by the asker's key, which hashes to the asker's id."""
        return node_id_of(self.asker_key) == self.asker and verify(self.asker_key, self.signing_bytes(),
                                                                   self.signature)

    @property
    def id(self) -> bytes:
        """What the ledger knows the summary by: a hash of all of it."""
        return row_hash(self.signing_bytes() + self.signature)


class Voucher(WireModel):
    """Member `payer` lets node `opener` ask on its credit until Unix second `until`."""

    payer: NodeId
    payer_key: PublicKey
    opener: NodeId
    until: Count
    # the part of the payer's priority (of SHARE_WHOLE) the opener's sessions rank with
    share: Share = SHARE_WHOLE
    signature: Signature = b""

    @classmethod
    def create(cls, identity: NodeIdentity, opener: str, until: int, share: float = 1.0) -> Voucher:
        """`share`: the fraction of `identity`'s priority the opener's sessions rank with (0 to 1)."""
        part = round(min(1.0, max(0.0, share)) * SHARE_WHOLE)
        unsigned = cls(payer=identity.node_id, payer_key=identity.public_key, opener=opener, until=until, share=part)
        return unsigned.model_copy(update={"signature": identity.sign(unsigned.signing_bytes())})

    def signing_bytes(self) -> bytes:
        packed: bytes = msgpack.packb(self.model_dump(exclude={"signature"}), use_bin_type=True)
        return _VOUCHER_DOMAIN + packed

    def valid_for(self, opener: str, now: float) -> bool:
        """Signed by the payer, for `opener`, and not run out at Unix time `now`."""
        return (self.opener == opener and now <= self.until and node_id_of(self.payer_key) == self.payer
                and verify(self.payer_key, self.signing_bytes(), self.signature))

    def ranked(self, priority: float) -> float:
        """The opener's rank, of its payer's `priority`: the voucher's share of it."""
        return priority * self.share / SHARE_WHOLE


class WorkGive(Message, tag="work_give"):
    """Summaries for the receiver's ledger: an asker's to the stages it countersigned them for, or a
    fetch's answer."""

    summaries: list[WorkSummary] = Field(max_length=MAX_SUMMARIES_PER_MESSAGE)


class WorkTaken(Message, tag="work_taken"):
    """How many of the summaries given were news to the ledger (the others: known, or refused)."""

    taken: Count
    refused: Count = 0


class LedgerRootsRequest(Message, tag="ledger_roots_request"):
    """The asker's ledger root. Where the roots differ the answer carries the ids the answering ledger
    took last (what a member in step lacks, new since its last pull), and with `walk` the bucket
    digests too (a member that fell behind walks the buckets that differ)."""

    root: Hash
    walk: bool = False


class LedgerRoots(Message, tag="ledger_roots"):
    root: Hash
    count: Count
    # the ids taken last, newest last, where the roots differ
    recent: list[Hash] = Field(default_factory=list, max_length=RECENT)
    # one digest per bucket (BUCKETS of them) where the roots differ and the asker walks; else none
    buckets: list[Hash] = Field(default_factory=list, max_length=BUCKETS)


class LedgerIdsRequest(Message, tag="ledger_ids_request"):
    bucket: Annotated[int, Field(ge=0, lt=BUCKETS)]
    offset: Count = 0


class LedgerIds(Message, tag="ledger_ids"):
    """A page of the ids in one bucket, in order, and how many the bucket holds."""

    bucket: Annotated[int, Field(ge=0, lt=BUCKETS)]
    ids: list[Hash] = Field(max_length=IDS_PAGE)
    total: Count


class LedgerFetch(Message, tag="ledger_fetch"):
    """The summaries of these ids (answered with a `WorkGive` of those the node holds)."""

    ids: list[Hash] = Field(max_length=MAX_SUMMARIES_PER_MESSAGE)


class PeerCredit(WireModel):
    """What one member served and asked, as the answering node's ledger counts it (work units:
    layers x tokens, decayed)."""

    node_id: NodeId
    balance: float = Field(allow_inf_nan=False)
    earned: float = Field(ge=0.0, allow_inf_nan=False)
    spent: float = Field(ge=0.0, allow_inf_nan=False)
    # the work it served the answering node, and the answering node asked of it
    served_us: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    asked_us: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    placed: bool = False


class CreditsRequest(Message, tag="credits_request"):
    """The answering node's ledger: its own standing, and every member's from `offset` on."""

    offset: Count = 0


class CreditsReply(Message, tag="credits"):
    node_id: NodeId
    own: PeerCredit
    members: list[PeerCredit] = Field(max_length=CREDITS_PAGE)
    total_members: Count
    summaries: Count
    root: Hash
    # the work a newcomer with no credit is still served (the floor's share of slots), for people
    floor: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)


class VoucherRequest(Message, tag="voucher_request"):
    """To the local daemon: a voucher for `opener` (an identity of `meshd ask`'s own)."""

    opener: NodeId


class VoucherReply(Message, tag="voucher"):
    voucher: Voucher


class CountersignRequest(Message, tag="countersign_request"):
    """To the local daemon: countersign these unsigned summaries of an ask it made through an identity
    of its own and give each to its stage. Their asker fields are the daemon's to fill."""

    summaries: list[WorkSummary] = Field(max_length=MAX_SUMMARIES_PER_MESSAGE)

