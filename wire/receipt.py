"""Signed step receipts and the fraud proofs built from them (schemas, signing bytes, hashes).

A stage that runs one step of a session (rows ``[pos, pos + n_tokens)``) signs
what it took in and what it put out, as hashes of the bytes as they travel:
the hidden states' tensor data, or (the head's input, the tail's output) the
int32 token ids. ``h_hist`` chains every input the session brought to the
stage so far, because a step's output depends on the whole KV behind it: two
stages of one model and range with the same ``h_hist`` must put out the same
bytes (the engine is deterministic and batch-invariant), whoever asked.

The receipts travel inside the activation they speak of (``Activation.receipts``:
one frame per hop), and the next stage checks ``h_out`` against the bytes it
received before it computes a row; the tail hands the asker the route's chain
inside the token it sampled (``Token.receipts``). ``h_prev`` is the hash
of the receipt before it in the chain (``receipt_hash``), so a stage's
signature covers the whole chain it took in: a stage checks only its
upstream's signature (an honest upstream checked the one before), and whoever
checks every signature (the asker) can say who signed over a forged receipt. The checks that turn
receipts into a verdict live in ``meshd.mesh.proofs``.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Annotated, Literal

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import Field

from wire.codec import Message, WireModel
from wire.identity import NodeIdentity, node_id_of
from wire.types import MAX_TOKENS, Digest, Epoch, Int32, Layer, NodeId, SessionId

HASH_BYTES = 16
Hash = Annotated[bytes, Field(min_length=HASH_BYTES, max_length=HASH_BYTES)]
PublicKey = Annotated[bytes, Field(min_length=32, max_length=32)]
# receipts one message may carry: one per stage of a route (routes are a few stages long)
MAX_CHAIN = 32
# a proof names one culprit and at most this many witnesses against it
MAX_WITNESSES = 4

_RECEIPT_DOMAIN = b"meshd/receipt/2\x00"
_HIST_DOMAIN = b"meshd/history/1\x00"
# the h_prev of a chain's first receipt
NO_PREV = bytes(HASH_BYTES)


def row_hash(data: bytes | memoryview) -> bytes:
    """The hash receipts use, over rows (or token ids) as they travel."""
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def history_start(model: str, layer_begin: int, layer_end: int, sampling: bytes = b"") -> bytes:
    """The history hash before a session's first step: what computes (model, range) and, at the
    tail, how it samples (its sampling parameters and where sampling begins)."""
    return row_hash(_HIST_DOMAIN + msgpack.packb([model, layer_begin, layer_end, sampling], use_bin_type=True))


def sampling_bytes(sampling: WireModel, prompt_len: int) -> bytes:
    """What decides a tail's output besides its input rows: how it samples (``wire.stage.Sampling``,
    whose messages carry receipts, so it is not imported here), and from where."""
    packed: bytes = msgpack.packb([sampling.model_dump(), prompt_len], use_bin_type=True)
    return packed


def receipt_hash(receipt: Receipt) -> bytes:
    """What the next receipt of a chain names as ``h_prev``: the whole receipt, signature included."""
    return row_hash(receipt.signing_bytes() + receipt.signature)


@lru_cache(maxsize=4096)
def _node_id(public_key: bytes) -> str:
    # a stage's key signs every step: its id is worked out once, not per receipt
    return node_id_of(public_key)


@lru_cache(maxsize=4096)
def _public_key(public_key: bytes) -> Ed25519PublicKey:
    # parsing a key costs a fifth of a verification: a route's few keys are parsed once
    return Ed25519PublicKey.from_public_bytes(public_key)


def history_next(hist: bytes, pos: int, n_tokens: int, h_in: bytes) -> bytes:
    """The history after one more step: which rows came in, where."""
    return row_hash(hist + pos.to_bytes(4, "little") + n_tokens.to_bytes(4, "little") + h_in)


class Receipt(WireModel):
    """One stage's signed account of one step of one session."""

    session: SessionId
    epoch: Epoch
    pos: Int32
    n_tokens: int = Field(ge=1, le=MAX_TOKENS)
    model: Digest
    layer_begin: Layer
    layer_end: Layer
    h_in: Hash
    h_out: Hash
    # every input of this session at this stage up to and including this step
    h_hist: Hash
    # the receipt before this one in its chain (``receipt_hash``; the first's: NO_PREV)
    h_prev: Hash
    # the signer's key rides along, so any node can check a receipt (and a proof) alone; the
    # node id is derived from it (a hash), so it does not travel
    public_key: PublicKey
    signature: Annotated[bytes, Field(max_length=64)] = b""

    @property
    def node_id(self) -> str:
        return _node_id(self.public_key)

    def signing_bytes(self) -> bytes:
        # the schema's field order, not the sender's: the encoding is canonical (the field values as
        # they are: what model_dump gives for these types, without its serializer's cost per receipt)
        values = self.__dict__
        packed: bytes = msgpack.packb({name: values[name] for name in _SIGNED}, use_bin_type=True)
        return _RECEIPT_DOMAIN + packed

    def signed(self, identity: NodeIdentity) -> Receipt:
        if identity.public_key != self.public_key:
            raise ValueError("only the stage a receipt names can sign it")
        return self.model_copy(update={"signature": identity.sign(self.signing_bytes())})

    def verify(self) -> bool:
        """Signed by the key it carries (whose hash is its node id)."""
        if not self.signature:
            return False
        try:
            _public_key(self.public_key).verify(self.signature, self.signing_bytes())
        except (InvalidSignature, ValueError):
            return False
        return True

    def same_step(self, other: Receipt) -> bool:
        """Both speak of the same computation: model, range, rows and the history behind them."""
        return (self.model, self.layer_begin, self.layer_end, self.pos, self.n_tokens, self.h_hist) == (
            other.model, other.layer_begin, other.layer_end, other.pos, other.n_tokens, other.h_hist)


_SIGNED = tuple(name for name in Receipt.model_fields if name != "signature")

Chain = Annotated[list[Receipt], Field(min_length=1, max_length=MAX_CHAIN)]


class Receipts(Message, tag="receipts"):
    """The receipts of one step that no token carries: from the tail to the asker for a prompt
    chunk before the last (the whole route's), and from a check session's replica to the asker."""

    session: SessionId
    epoch: Epoch
    chain: Chain


class Proof(WireModel):
    """Evidence against one stage that any node can check with the keys it carries.

    ``equivocation``: the culprit signed two receipts of the same step that disagree.
    ``divergence``: for the same step (model, range, rows, history) the culprit's output
    differs from the one that at least two other nodes signed.
    """

    kind: Literal["equivocation", "divergence"]
    culprit: Receipt
    witnesses: list[Receipt] = Field(min_length=1, max_length=MAX_WITNESSES)


class ProofGossip(Message, tag="proof"):
    """A proof passed from node to node (the tracker excludes its culprit)."""

    proof: Proof


class ProofAccepted(Message, tag="proof_accepted"):
    """The answer to a ``ProofGossip`` that held: whether its culprit was news to the node."""

    culprit: NodeId
    news: bool
