"""A stage's receipts for one session: the history it has taken in, and signing each step (sans-IO).

The service hands this the bytes of each step's input and output as they
travel; the chain that came with the input is checked (``meshd.mesh.proofs``)
before the step is queued, so only a checked chain is ever extended and forwarded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wire.identity import NodeIdentity
from wire.receipt import NO_PREV, PackedChain, Receipt, history_next, history_start, read_chain, signed_wire


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

    def sign_wire(self, pos: int, n_tokens: int, h_in: bytes, h_out: bytes, h_prev: bytes = NO_PREV) -> bytes:
        """This step's receipt as it travels (``pack_chain``), after the receipt whose hash is ``h_prev``
        (the last of the checked chain it extends; the first of a chain names NO_PREV)."""
        if not self.hist:
            self.hist = history_start(self.model, self.layer_begin, self.layer_end, self.sampling)
        self.hist = history_next(self.hist, pos, n_tokens, h_in)
        s = self.signer
        return signed_wire(s.identity, self.session, self.epoch, self.model, pos, n_tokens, self.layer_begin,
                           self.layer_end, h_in, h_out, self.hist, h_prev, s.public_key)

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
