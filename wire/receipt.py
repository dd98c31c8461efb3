"""Signed step receipts and the fraud proofs built from them (schemas, signing bytes, hashes).

A stage that runs one step of a session (rows ``[pos, pos + n_tokens)``) signs
what it took in and what it put out, as hashes of the bytes as they travel:
the hidden states' tensor data, or (the head's input, the tail's output) the
int32 token ids. ``h_hist`` chains every input the session brought to the
stage so far, because a step's output depends on the whole KV behind it: two
stages of one model and range with the same ``h_hist`` must put out the same
bytes (the engine is deterministic and batch-invariant), whoever asked.

The receipts travel inside the activation they speak of (``Activation.receipts``:
one frame per hop), packed (``pack_chain``: fixed-width, without what the
receiver knows), and the next stage checks ``h_out`` against the bytes it
received before it computes a row; the tail hands the asker the route's chain
inside the token it sampled (``Token.receipts``). Stages and the asker read
a chain off its bytes (``read_chain``: fields, links and signatures checked
without a ``Receipt`` built) and forward it as it came; a full ``Receipt``
is built only where one becomes evidence (a spot check, a proof). ``h_prev`` is the hash
of the receipt before it in the chain (``Receipt.hash``), so a stage's
signature covers the whole chain it took in: a stage checks only its
upstream's signature (an honest upstream checked the one before), and whoever
checks every signature (the asker) can say who signed over a forged receipt. The checks that turn
receipts into a verdict live in ``meshd.mesh.proofs``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Annotated, Literal, NamedTuple

import msgpack
from nacl.bindings import crypto_sign_open
from nacl.exceptions import CryptoError
from pydantic import Field

from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity, node_id_of
from wire.message import Message, WireModel
from wire.types import MAX_LAYERS, MAX_TOKENS, Digest, Epoch, Int32, Layer, NodeId, SessionId

HASH_BYTES = 16
Hash = Annotated[bytes, Field(min_length=HASH_BYTES, max_length=HASH_BYTES)]
PublicKey = Annotated[bytes, Field(min_length=32, max_length=32)]
# receipts one message may carry: one per stage of a route (routes are a few stages long)
MAX_CHAIN = 32
# a proof names one culprit and at most this many witnesses against it
MAX_WITNESSES = 4
# On the fast path a receipt covers a span of positions of its session, not one engine step
# (meshd.engine.spans; ``span_end`` cuts them). Each goes to the asker in a message of its own, about
# 240 bytes: a 3-stage route's cost it 85 bytes per decode token at 16 positions a span
# (tools/bench_verify.py, 32-token answers, the prompt's spans included), where the daemons' path's
# chain per step cost 698. A replica replays every position anyway (it needs the KV), so a longer span
# costs no check; it only makes a lie's catch come up to a span later, and (the asker hands a token to
# its client once its span's receipts agree) the answer's text come in pieces of up to a span.
SPAN = 32


def span_end(pos: int, prompt_len: int, span: int = SPAN) -> int:
    """Where the span that starts at ``pos`` ends: at the next multiple of ``span``, or sooner where
    the prompt ends (its last row's token, the answer's first, is then signed as soon as sampled).

    Why no shorter spans after it, which would hand the client the answer's next tokens sooner: each
    is a receipt from every stage, and with 1, 2, 4, 8 and 16 positions after the prompt a 3-stage
    route's receipts cost 100 bytes a token over 64-token answers (tools/bench_verify.py), where the
    issue's bound is 64; cut at the prompt and every 32 positions alone they are about 56."""
    end = (pos // span + 1) * span
    return min(end, prompt_len) if pos < prompt_len else end

# 3: the signed bytes are a fixed layout after the session's (``_BODY``), not a msgpack map; 4: with ``t_us``
_RECEIPT_DOMAIN = b"meshd/receipt/4\x00"
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


# What a receipt signs after its session's ``_context``: pos, n_tokens, layer_begin, layer_end, t_us, h_in,
# h_out, h_hist, h_prev, public_key, little-endian and fixed in width (every field's bounds fit), so packing
# it is one call, not a map built and packed per receipt
_BODY = struct.Struct("<IIIII16s16s16s16s32s")
SIGNATURE_BYTES = 64
# a receipt as it travels in a chain (``pack_chain``): its body, then its signature; the session,
# epoch and model are the receiver's own (every receipt of a chain speaks of the session it comes in)
WIRE_BYTES = _BODY.size + SIGNATURE_BYTES
_INT32_MAX = (1 << 31) - 1
# a receipt's ``t_us``: any u32 (some 71 minutes; a span's time is seconds at most)
UInt32 = Annotated[int, Field(ge=0, le=(1 << 32) - 1)]


@lru_cache(maxsize=1024)
def _context(session: str, epoch: int, model: str) -> bytes:
    # the same for every receipt of a session at a stage: packed once
    packed: bytes = msgpack.packb([session, epoch, model], use_bin_type=True)
    return _RECEIPT_DOMAIN + packed


@lru_cache(maxsize=4096)
def _node_id(public_key: bytes) -> str:
    # a stage's key signs every step: its id is worked out once, not per receipt
    return node_id_of(public_key)


def _verified(public_key: bytes, signing: bytes, signature: bytes) -> bool:
    """``signature`` is ``public_key``'s over ``signing``: libsodium's Ed25519 (RFC 8032, the signatures
    NodeIdentity makes), called without pynacl's key and message objects (every stage verifies a
    receipt per step: a verification takes half of OpenSSL's time through ``cryptography``)."""
    # libsodium reads a key and a signature of these lengths whatever it is handed
    if len(public_key) != 32 or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        crypto_sign_open(signature + signing, public_key)
    except CryptoError:
        return False
    return True


def history_next(hist: bytes, pos: int, n_tokens: int, h_in: bytes) -> bytes:
    """The history after one more step: which rows came in, where."""
    return row_hash(hist + pos.to_bytes(4, "little") + n_tokens.to_bytes(4, "little") + h_in)


class Receipt(WireModel):
    """One stage's signed account of one step of one session.

    Immutable, so its signed bytes, its hash and its packed form are worked out once (where it is
    signed or unpacked, else when first asked for) and kept beside its fields (slots: not fields, so
    neither compared nor encoded; ``model_copy`` leaves them unset, so a copy with other fields works
    them out anew)."""

    __slots__ = ("_signing", "_hash", "_wire")
    if TYPE_CHECKING:
        _signing: bytes
        _hash: bytes
        _wire: bytes

    session: SessionId
    epoch: Epoch
    pos: Int32
    n_tokens: int = Field(ge=1, le=MAX_TOKENS)
    model: Digest
    layer_begin: Layer
    layer_end: Layer
    # the stage's own time on these rows, in µs: from each step's rows coming whole to its output's send,
    # summed (a fast session's span, as its worker timed it; 0: not timed, a step on the daemons' path).
    # Its own word, signed so that it is one: the tracker charges a stage what an ask saw past the others'
    # words (meshd.mesh.traffic), so saying less than it took moves its wait onto the route, not off it
    t_us: UInt32 = 0
    h_in: Hash
    h_out: Hash
    # every input of this session at this stage up to and including this step
    h_hist: Hash
    # the receipt before this one in its chain (its ``hash``; the first's: NO_PREV)
    h_prev: Hash
    # the signer's key rides along, so any node can check a receipt (and a proof) alone; the
    # node id is derived from it (a hash), so it does not travel
    public_key: PublicKey
    signature: Annotated[bytes, Field(max_length=64)] = b""

    @property
    def node_id(self) -> str:
        return _node_id(self.public_key)

    @classmethod
    def build(cls, session: str, epoch: int, pos: int, n_tokens: int, model: str, layer_begin: int, layer_end: int,
              h_in: bytes, h_out: bytes, h_hist: bytes, h_prev: bytes, public_key: bytes,
              signer: NodeIdentity | None = None, t_us: int = 0) -> Receipt:
        """A receipt of local values, unvalidated (the receiver validates), signed by ``signer`` (whose
        key must be ``public_key``) if given: its signed bytes are packed once, for the signature and
        for whoever asks later."""
        receipt = cls.unvalidated({
            "session": session, "epoch": epoch, "pos": pos, "n_tokens": n_tokens, "model": model,
            "layer_begin": layer_begin, "layer_end": layer_end, "t_us": t_us, "h_in": h_in, "h_out": h_out,
            "h_hist": h_hist, "h_prev": h_prev, "public_key": public_key, "signature": b""})
        signing = receipt.signing_bytes()
        if signer is not None:
            signature = signer.sign(signing)
            receipt.__dict__["signature"] = signature
            # what the next receipt names as h_prev, and the bytes it travels as: needed for every
            # receipt signed, worked out here rather than looked for later
            object.__setattr__(receipt, "_hash", row_hash(signing + signature))
            object.__setattr__(receipt, "_wire", signing[-_BODY.size:] + signature)
        return receipt

    def signing_bytes(self) -> bytes:
        try:
            return self._signing
        except AttributeError:
            pass
        v = self.__dict__
        signing = _context(v["session"], v["epoch"], v["model"]) + _BODY.pack(
            v["pos"], v["n_tokens"], v["layer_begin"], v["layer_end"], v["t_us"], v["h_in"], v["h_out"],
            v["h_hist"], v["h_prev"], v["public_key"])
        object.__setattr__(self, "_signing", signing)
        return signing

    @property
    def hash(self) -> bytes:
        """The whole receipt's hash, signature included: what the next receipt of a chain names as ``h_prev``."""
        try:
            return self._hash
        except AttributeError:
            pass
        h = row_hash(self.signing_bytes() + self.signature)
        object.__setattr__(self, "_hash", h)
        return h

    @property
    def wire(self) -> bytes:
        """The receipt as a chain carries it (``pack_chain``)."""
        try:
            return self._wire
        except AttributeError:
            pass
        if len(self.signature) != SIGNATURE_BYTES:
            raise ValueError("only a signed receipt travels in a chain")
        wire = self.signing_bytes()[-_BODY.size:] + self.signature
        object.__setattr__(self, "_wire", wire)
        return wire

    def signed(self, identity: NodeIdentity) -> Receipt:
        if identity.public_key != self.public_key:
            raise ValueError("only the stage a receipt names can sign it")
        signing = self.signing_bytes()
        receipt = Receipt.unvalidated({**self.__dict__, "signature": identity.sign(signing)})
        object.__setattr__(receipt, "_signing", signing)
        return receipt

    def verify(self) -> bool:
        """Signed by the key it carries (whose hash is its node id)."""
        return _verified(self.public_key, self.signing_bytes(), self.signature)

    def same_step(self, other: Receipt) -> bool:
        """Both speak of the same computation: model, range, rows and the history behind them."""
        return (self.model, self.layer_begin, self.layer_end, self.pos, self.n_tokens, self.h_hist) == (
            other.model, other.layer_begin, other.layer_end, other.pos, other.n_tokens, other.h_hist)


# a chain as activations, tokens and ``Receipts`` carry it: its receipts' ``wire`` bytes, head first
Chain = Annotated[bytes, Field(min_length=WIRE_BYTES, max_length=MAX_CHAIN * WIRE_BYTES)]


def pack_chain(chain: Sequence[Receipt]) -> bytes:
    """What a message carries of ``chain``: fixed-width receipts one after the other."""
    return b"".join([r.wire for r in chain])


# a receipt as a chain carries it: its body's fields, then its signature
_WIRE = struct.Struct("<IIIII16s16s16s16s32s64s")
assert _WIRE.size == WIRE_BYTES


class Link(NamedTuple):
    """One receipt of a chain as it came, its fields read straight off its bytes (``read_chain``): what
    a stage and the asker check of every step (positions, layers, hashes) without building a
    ``Receipt``. Its session, epoch and model are its chain's."""

    pos: int
    n_tokens: int
    layer_begin: int
    layer_end: int
    t_us: int
    h_in: bytes
    h_out: bytes
    h_hist: bytes
    h_prev: bytes
    public_key: bytes
    signature: bytes

    @property
    def node_id(self) -> str:
        return _node_id(self.public_key)


class PackedChain:
    """A chain of receipts as a message brought it (``pack_chain``), read as ``Link``s of the receiver's
    session, epoch and model: a receipt's hash, signature check and full ``Receipt`` (evidence) are
    worked out from its bytes only where they are asked for, and the chain is forwarded as it came."""

    __slots__ = ("data", "session", "epoch", "model", "links", "_context")

    def __init__(self, data: bytes, session: str, epoch: int, model: str, links: list[Link]) -> None:
        self.data = data
        self.session = session
        self.epoch = epoch
        self.model = model
        self.links = links
        self._context = _context(session, epoch, model)

    def __len__(self) -> int:
        return len(self.links)

    def wire(self, k: int) -> bytes:
        """Receipt ``k`` (from the end where negative) as it travels."""
        start = (k % len(self.links)) * WIRE_BYTES
        return self.data[start:start + WIRE_BYTES]

    def hash(self, k: int) -> bytes:
        """What the receipt after receipt ``k`` names as its ``h_prev`` (``Receipt.hash``)."""
        return row_hash(self._context + self.wire(k))

    def verify(self, k: int) -> bool:
        """Receipt ``k`` is signed by the key it carries."""
        link = self.links[k]
        return _verified(link.public_key, self._context + self.wire(k)[:_BODY.size], link.signature)

    def receipt(self, k: int) -> Receipt:
        """Receipt ``k`` in full, as proofs carry it: its signed bytes, hash and wire the ones it came as."""
        link, wire = self.links[k], self.wire(k)
        receipt = Receipt.unvalidated({
            "session": self.session, "epoch": self.epoch, "pos": link.pos, "n_tokens": link.n_tokens,
            "model": self.model, "layer_begin": link.layer_begin, "layer_end": link.layer_end, "t_us": link.t_us,
            "h_in": link.h_in,
            "h_out": link.h_out, "h_hist": link.h_hist, "h_prev": link.h_prev, "public_key": link.public_key,
            "signature": link.signature})
        signing = self._context + wire[:_BODY.size]
        object.__setattr__(receipt, "_signing", signing)
        object.__setattr__(receipt, "_wire", wire)
        object.__setattr__(receipt, "_hash", row_hash(self._context + wire))
        return receipt


def read_chain(data: bytes, session: str, epoch: int, model: str) -> PackedChain:
    """The receipts a message brings (``pack_chain``), of the ``session`` and ``epoch`` it came in and the
    receiver's ``model``: PAYLOAD_CORRUPT unless ``data`` is 1 to MAX_CHAIN receipts whose every field
    is within its schema's bounds (fixed widths hold the rest), so a sender's garbage fails only its
    session. A receipt signed with another session, epoch or model does not verify."""
    count, rest = divmod(len(data), WIRE_BYTES)
    if rest or not 1 <= count <= MAX_CHAIN:
        raise ProtocolError(ErrorCode.PAYLOAD_CORRUPT, f"a chain of receipts is 1 to {MAX_CHAIN} of {WIRE_BYTES} "
                                                       f"bytes each, not {len(data)} bytes")
    links = list(map(Link._make, _WIRE.iter_unpack(data)))
    for k, link in enumerate(links):
        if (link.pos > _INT32_MAX or not 1 <= link.n_tokens <= MAX_TOKENS or link.layer_begin > MAX_LAYERS
                or link.layer_end > MAX_LAYERS):
            raise ProtocolError(ErrorCode.PAYLOAD_CORRUPT, f"receipt {k} of the chain is out of bounds: "
                                                           f"{link.pos}+{link.n_tokens}, "
                                                           f"[{link.layer_begin}, {link.layer_end})")
    return PackedChain(bytes(data), session, epoch, model, links)


def unpack_chain(data: bytes, session: str, epoch: int, model: str) -> tuple[Receipt, ...]:
    """The receipts of ``read_chain`` in full (``Receipt``), for where each becomes evidence."""
    chain = read_chain(data, session, epoch, model)
    return tuple(chain.receipt(k) for k in range(len(chain)))


def signed_wire(identity: NodeIdentity, session: str, epoch: int, model: str, pos: int, n_tokens: int,
                layer_begin: int, layer_end: int, h_in: bytes, h_out: bytes, h_hist: bytes, h_prev: bytes,
                public_key: bytes, t_us: int = 0) -> bytes:
    """A receipt of local values signed by ``identity`` (whose key must be ``public_key``), as it travels
    in a chain (``pack_chain``): a stage signs one per step and forwards it packed, building no ``Receipt``."""
    body = _BODY.pack(pos, n_tokens, layer_begin, layer_end, t_us, h_in, h_out, h_hist, h_prev, public_key)
    return body + identity.sign(_context(session, epoch, model) + body)


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
