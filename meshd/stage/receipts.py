"""A stage's receipts (sans-IO): signing each step of a session, and checking the chain its input brings.

The service hands ``SessionReceipts`` the bytes of each step's input and output
as they travel. On a hop (or ring) stream with receipts on, each activation
carries the receipts of its step (``Activation.receipts``): the chain is checked
(``meshd.mesh.proofs``) before a byte of the rows is decoded, and before the
step is queued, so only a checked chain is ever extended and forwarded. A
chain that does not hold fails the session as PAYLOAD_CORRUPT, which the asker
reads as the sender's fault: an honest sender checked what it forwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshd.mesh.proofs import BrokenChain, Step, check_chain
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.receipt import NO_PREV, PackedChain, Receipt, Receipts, history_next, history_start, read_chain, signed_wire
from wire.tensors import Activation


@dataclass
class Signer:
    """One node's identity, with its id and key worked out once (the id is a hash of the key)."""

    identity: NodeIdentity
    node_id: str = ""
    public_key: bytes = b""

    def __post_init__(self) -> None:
        self.public_key = self.identity.public_key
        self.node_id = self.identity.node_id


@dataclass
class SessionReceipts:
    """The receipts one stage signs for one session, step by step in the order they run."""

    signer: Signer
    session: str
    epoch: int
    model: str
    layer_begin: int
    layer_end: int
    # at the tail: the sampling parameters and where sampling begins, as bytes (they decide the output)
    sampling: bytes = b""
    hist: bytes = field(default=b"")

    def sign_wire(self, pos: int, n_tokens: int, h_in: bytes, h_out: bytes, h_prev: bytes = NO_PREV,
                  t_us: int = 0) -> bytes:
        """This step's receipt as it travels (``pack_chain``), after the receipt whose hash is ``h_prev``
        (the last of the checked chain it extends; the first of a chain names NO_PREV), ``t_us`` this
        stage's own time on its rows (0: not timed)."""
        if not self.hist:
            self.hist = history_start(self.model, self.layer_begin, self.layer_end, self.sampling)
        self.hist = history_next(self.hist, pos, n_tokens, h_in)
        s = self.signer
        return signed_wire(s.identity, self.session, self.epoch, self.model, pos, n_tokens, self.layer_begin,
                           self.layer_end, h_in, h_out, self.hist, h_prev, s.public_key, t_us)

    def extend(self, chain: PackedChain | None, pos: int, n_tokens: int, h_in: bytes, h_out: bytes,
               ) -> tuple[bytes, bytes]:
        """This step's receipt after ``chain`` (the checked one its input came with; None: it starts
        one), and the chain with it, both as they travel."""
        if chain is None:
            mine = self.sign_wire(pos, n_tokens, h_in, h_out)
            return mine, mine
        mine = self.sign_wire(pos, n_tokens, h_in, h_out, chain.hash(-1))
        return mine, chain.data + mine

    def sign(self, pos: int, n_tokens: int, h_in: bytes, h_out: bytes, prev: Receipt | None = None) -> Receipt:
        """``sign_wire`` as a full receipt, after ``prev``: where a receipt is evidence, not forwarded."""
        wire = self.sign_wire(pos, n_tokens, h_in, h_out, NO_PREV if prev is None else prev.hash)
        return read_chain(wire, self.session, self.epoch, self.model).receipt(0)


def chain_of(msg: Activation, wanted: bool, sender: str) -> tuple[str, bytes] | None:
    """The packed chain an activation brings, with who sent it (None with receipts off)."""
    if not wanted:
        if msg.receipts is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "receipts on a session that did not ask for them")
        return None
    if msg.receipts is None:
        raise ProtocolError(ErrorCode.PAYLOAD_CORRUPT, "an activation without its receipts")
    return sender, msg.receipts


def check_incoming(held: tuple[str, bytes], msg: Activation, until: int, h_rows: bytes, ring: bool,
                   prompt_len: int, model: str) -> PackedChain:
    """The chain, read as receipts of the activation's session and epoch and this stage's
    ``model`` (fields off its bytes, no receipt built), and checked against the activation;
    PAYLOAD_CORRUPT if it does not hold.

    On a hop, every receipt is of the activation's step, the chain reaches this stage's first
    layer, and only the sender's signature is checked (it checked its own upstream's, and
    signed over that one by hash). On the ring comes the tail's receipt alone, of the step it
    sampled this token in: it ends where this activation begins and covers the model's last
    layer; the chain behind it is the asker's to check (it gets every receipt)."""
    sender, packed = held
    chain = read_chain(packed, msg.session, msg.epoch, model)
    try:
        if ring:
            check_ring(chain, msg, until, sender, h_rows)
        else:
            step = Step(msg.session, msg.epoch, msg.pos, msg.n_tokens, until, sender, h_rows, msg.pos >= prompt_len)
            check_chain(chain, step, signatures="sender")
    except BrokenChain as exc:
        raise ProtocolError(ErrorCode.PAYLOAD_CORRUPT, f"receipts from the upstream stage: {exc}") from None
    # the head's step starts its own chain with the tail's receipt of the token it takes in
    return chain


def check_ring(chain: PackedChain, msg: Activation, n_layer: int, sender: str, h_tokens: bytes) -> None:
    if len(chain) != 1:
        raise BrokenChain("the ring brings the tail's receipt alone")
    # read as of the activation's session and epoch: a receipt of another does not verify
    tail = chain.links[0]
    if tail.pos + tail.n_tokens != msg.pos:
        raise BrokenChain(f"the tail's receipt ends at {tail.pos + tail.n_tokens}, the token is at {msg.pos}")
    if tail.layer_end != n_layer or tail.layer_begin >= tail.layer_end:
        raise BrokenChain(f"the tail's receipt covers layers [{tail.layer_begin}, {tail.layer_end})")
    if tail.node_id != sender:
        raise BrokenChain("the ring's receipt is not the sender's")
    if tail.h_out != h_tokens:
        raise BrokenChain("the token is not the one the tail's receipt signs")
    if not chain.verify(0):
        raise BrokenChain("the tail's receipt has a bad signature")


def receipts_message(session: str, epoch: int, chain: bytes) -> Receipts:
    # built unvalidated from a packed chain of receipts this stage checked or signed
    return Receipts.unvalidated({"type": "receipts", "v": 1, "session": session, "epoch": epoch, "chain": chain})
