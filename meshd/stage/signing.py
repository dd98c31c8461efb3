"""What a stage signs of its sessions' steps, and the inputs it keeps for the asker's checks.

With receipts on, each step this stage runs is signed (``meshd.stage.receipts``):
past the tail, the chain so far and this stage's receipt ride downstream inside
the step's rows; the tail's chain goes to the asker inside the token and its own
receipt around the ring; a check session's receipts go to the asker alone, and
a fast session's spans as its worker hashed them. Past the head, each step's
input is kept as it came until the asker takes it for a spot check. The chain
that comes with an input is checked here before the rows are looked at
(``meshd.stage.receipts``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from meshd.stage.books import Work
from meshd.stage.receipts import check_incoming, receipts_message
from meshd.stage.state import HIDDEN, Rows, Session, StageState
from wire.errors import ErrorCode, ProtocolError
from wire.receipt import MAX_CHAIN, PackedChain, row_hash, sampling_bytes
from wire.sketch import Sketches, pick_sketch, row_sketch
from wire.stage import MAX_INPUTS_BYTES, MAX_TOP_LOGPROBS, Inputs, InputsRequest, StepInput
from wire.tensors import Activation, tensor_fields


class Signing:
    def __init__(self, state: StageState) -> None:
        self.state = state

    def signed_chain(self, s: Session, w: Work[Rows], h_out: bytes) -> bytes:
        """Signs this step: the chain so far (packed as it came) and this stage's receipt after it,
        which ride downstream inside the step's rows."""
        assert s.receipts is not None
        return s.receipts.extend(w.payload.chain, w.pos, w.n, w.payload.h_in, h_out)[1]

    def check_receipt(self, s: Session, w: Work[Rows], out: np.ndarray) -> None:
        """A check session's step: only its receipt goes anywhere (to the asker that checks it)."""
        if s.receipts is None:
            return
        fields = tensor_fields(HIDDEN, out, s.open.wire_dtype, s.open.wire_codec)
        sketch = row_sketch(out, s.open.sketch) if s.open.sketch else b""
        self.check_receipts(s, s.receipts.sign_wire(w.pos, w.n, w.payload.h_in, row_hash(fields["data"])), sketch)

    def check_receipts(self, s: Session, mine: bytes, sketch: bytes = b"") -> None:
        """A check session's receipts go to the asker in one message once the steps it fed together
        have run (a probe's one at a time): one message per check, not one per step it replays. Across
        numerics each comes with its output's sketch."""
        s.check_receipts.append(mine)
        if s.open.sketch:
            s.check_sketches.append(sketch)
        if s.book.in_flight == 0 or len(s.check_receipts) == MAX_CHAIN:
            if s.open.sketch:
                s.to_asker.send_nowait(Sketches.unvalidated({"type": "sketches", "v": 1, "session": s.book.id,
                                                             "epoch": s.book.epoch, "sketches": s.check_sketches}))
            s.to_asker.send_nowait(receipts_message(s.book.id, s.book.epoch, b"".join(s.check_receipts)))
            s.check_receipts, s.check_sketches = [], []

    def tail_receipts(self, s: Session, w: Work[Rows], picks: list[Any]) -> None:
        """The tail signs the tokens it sampled (none for a prompt chunk before the last); the whole
        route's chain goes to the asker inside the token (``Ring.tell``), its own receipt around the ring."""
        assert s.receipts is not None
        if not s.receipts.hist:
            s.receipts.sampling = sampling_bytes(s.open.sampling, s.book.prompt_len or 0)
        # (a check session's every pick: the span it replays sampled from each row)
        taken = picks if s.open.check else picks[:w.drafts + 1]
        sampled = np.asarray([p[0] for p in taken if p is not None], dtype=np.int32)
        mine, chain = s.receipts.extend(w.payload.chain, w.pos, w.n, w.payload.h_in, row_hash(sampled.tobytes()))
        if s.open.check:
            # a replica's receipt goes to the asker that checks it, on its own: nothing reads its tokens
            # but, across numerics, the asker's tolerance (each pick's likeliest tokens, wire.sketch)
            sketch = b"".join(pick_sketch(p[0], [(t, lp) for t, lp, _ in p[3][1]], p[3][2],
                                          min(s.open.sketch, MAX_TOP_LOGPROBS))
                              for p in taken if p is not None) if s.open.sketch else b""
            self.check_receipts(s, mine, sketch)
            return
        s.asker_chain = chain
        if picks:
            # the head needs only the tail's receipt of its token: it covers the chain before it by hash
            s.ring_receipt = mine

    def send_chain(self, s: Session) -> None:
        """A chain no token took along (a prompt chunk before the last, the end of generation) goes alone."""
        if s.asker_chain is not None:
            s.to_asker.send_nowait(receipts_message(s.book.id, s.book.epoch, s.asker_chain))
            s.asker_chain = None

    def sign_span(self, session: Session, pos: int, n: int, h_in: bytes, h_out: bytes, t_us: int) -> None:
        """Signs a fast session's span as its worker hashed and timed it and sends it to the asker, this
        stage's receipt alone: the asker checks that each stage's input is the one before's output, and
        tells the tracker what each stage said its time was (meshd.mesh.traffic)."""
        receipts = session.receipts
        if receipts is None:
            return
        if self.state.report.has_output and not receipts.hist:
            receipts.sampling = sampling_bytes(session.open.sampling, session.book.prompt_len or 0)
        session.to_asker.send_nowait(receipts_message(session.book.id, session.book.epoch,
                                                      receipts.sign_wire(pos, n, h_in, h_out, t_us=t_us)))

    def checked_chain(self, session: Session, msg: Activation, chain: tuple[str, bytes] | None,
                      ) -> tuple[bytes, PackedChain | None]:
        """With receipts on: the hash of the rows as they came, and their chain, checked before the
        rows' position or a byte of them is looked at, so a sender that moved or changed them is
        the one blamed, not this stage's books."""
        if session.receipts is None:
            return b"", None
        report, digest = self.state.report, self.state.digest
        if report.has_input:
            # the ring: the tail's receipt of the step before signs the token it sampled
            if msg.tokens is None:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "the head takes token ids, not hidden states")
            h = row_hash(np.asarray(msg.tokens, dtype=np.int32).tobytes())
            prompt_len = session.book.prompt_len or 0
            return h, None if chain is None else check_incoming(chain, msg, report.n_layer, h, True, prompt_len,
                                                              digest)
        entry = msg.tensor(HIDDEN)
        h = row_hash(entry.data)
        checked = None if chain is None else check_incoming(chain, msg, report.layer_begin, h, False,
                                                          session.book.prompt_len or 0, digest)
        if not session.open.check:
            session.kept.append(StepInput.unvalidated({"pos": msg.pos, "n_tokens": msg.n_tokens, "tensor": entry,
                                                       "tokens": msg.tokens}))
        return h, checked

    def send_inputs(self, session: Session, msg: InputsRequest) -> None:
        """Hands the asker the kept inputs before ``msg.until``, in messages of bounded size, and forgets them."""
        book = session.book
        if (msg.session, msg.epoch) != (book.id, book.epoch):
            raise ProtocolError(ErrorCode.EPOCH_STALE, "inputs of another session or epoch")
        if session.receipts is None or self.state.report.has_input:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "this stage keeps no inputs for the session")
        taken = 0
        while taken < len(session.kept) and session.kept[taken].pos < msg.until:
            taken += 1
        steps, session.kept = session.kept[:taken], session.kept[taken:]
        batch: list[StepInput] = []
        size = 0
        for step in steps:
            step_size = len(step.tensor.data) if step.tensor is not None else 0
            if batch and size + step_size > MAX_INPUTS_BYTES:
                session.to_asker.send_nowait(Inputs(session=book.id, epoch=book.epoch, steps=batch, more=True))
                batch, size = [], 0
            batch.append(step)
            size += step_size
        session.to_asker.send_nowait(Inputs(session=book.id, epoch=book.epoch, steps=batch, more=False))
