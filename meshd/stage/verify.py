"""The stage's checks of the receipts that come with its input (sans-IO).

On a hop (or ring) stream with receipts on, each activation carries the
receipts of its step (``Activation.receipts``). The chain is checked before a
byte of the rows is decoded; a chain that does not hold fails the session as
PAYLOAD_CORRUPT, which the asker reads as the sender's fault: an honest sender
checked what it forwards.
"""

from __future__ import annotations

from meshd.mesh.proofs import BrokenChain, Step, check_chain
from wire.errors import ErrorCode, ProtocolError
from wire.receipt import PackedChain, Receipts, read_chain
from wire.tensors import Activation


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
