"""The tail's sampled tokens: booked, told to the asker, and fed around the ring with drafts.

A token the tail samples goes on the books (which end the answer at its end of
generation, budget or stop string), to the asker, and around the ring to the
head as the next step, with the drafts the session speculates with after it: an
n-gram drafter's, or a draft model's run in a worker of its own. A step of
drafts comes back as several sampled rows, of which the ones the drafts agree
with are taken (``meshd.steps.accepted``). A whole-model stage is its own ring.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import trio

from meshd import steps
from meshd.engine import ops
from meshd.engine.supervisor import EngineSupervisor, WorkerDown, WorkerRefused
from meshd.stage.books import LIVE, Emitted, Work
from meshd.stage.signing import Signing
from meshd.stage.state import Rows, Session, StageState
from wire.errors import ErrorCode, ProtocolError
from wire.receipt import read_chain, row_hash
from wire.stage import Done, Sampling, Token, TopLogprob
from wire.tensors import encode_activation

# how the draft model picks its drafts: its most likely token
GREEDY = Sampling(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, repeat_last_n=0, seed=0)


class Ring:
    def __init__(self, state: StageState, signing: Signing, draft_engine: EngineSupervisor | None) -> None:
        self.state = state
        self.signing = signing
        # the tail's draft model (same vocabulary), for sessions that speculate with "model"
        self.draft_engine = draft_engine

    def verified(self, s: Session, w: Work[Rows], picks: list[Any], now: float) -> None:
        """Emits the sampled tokens the drafts agree with, and the one after them (the rows past
        that one were not sampled)."""
        accepted = 0
        if w.drafts:
            drafts, s.drafts = s.drafts, []
            # the worker stops sampling at the first pick that is not the draft: no pick after it (None)
            accepted = steps.accepted([p[0] for p in picks if p is not None], drafts[:w.drafts])
            if s.draft_length is not None:
                s.draft_length.record(w.drafts, accepted)
        taken: list[tuple[int, bytes, Emitted, Any]] = []
        for token, eog, raw, *logprobs in picks[:accepted + 1]:
            piece = bytes(raw)
            emitted = self.take(s, token, eog, piece, now)
            if emitted is None:
                break
            # the worker's [logprob, [[token, logprob, piece], ...]] where the session asked for them
            taken.append((token, piece, emitted, logprobs[0] if logprobs else None))
            if not emitted.feed:
                break
        else:
            # The ring's token goes before the asker hears of any: the head's next step is the critical
            # path, and each message to the asker is sealed and written here, at once (Outlet). Side by
            # side (tools/bench_hop.py, default model, 2 x 3 rounds alternated) the daemons' path decoded
            # 42.8 and 43.3 tok/s with the asker told first, 44.3 and 44.2 so (the in-process split 51.4
            # and 51.1, then 52.3 and 52.2). The last token taken goes at the first position the drafts
            # did not get right.
            self.feed(s, token, w.pos + w.n - w.drafts + accepted)
        for token, piece, emitted, logprobs in taken:
            self.tell(s, token, piece, emitted, logprobs)

    def emit(self, s: Session, token: int, eog: bool, piece: bytes, now: float) -> bool:
        """Books a sampled token and sends it to the asker; True if the session goes on after it."""
        emitted = self.take(s, token, eog, piece, now)
        if emitted is None:
            return False
        self.tell(s, token, piece, emitted)
        return emitted.feed

    def take(self, s: Session, token: int, eog: bool, piece: bytes, now: float) -> Emitted | None:
        """A sampled token on the books (and the drafter's history); None: the session is not live."""
        emitted = self.state.books.emit(s.book, eog, piece, now)
        if emitted is not None and s.drafter is not None and not eog:
            s.drafter.extend([token])
        return emitted

    def tell(self, s: Session, token: int, piece: bytes, emitted: Emitted, logprobs: Any = None) -> None:
        """What the asker hears of a booked token: the token, and the end of the answer if it is one."""
        book = s.book
        if emitted.index is not None:
            # built unvalidated from our own values (the asker validates): this is per token
            chain, s.asker_chain = s.asker_chain, None
            lp, top = (None, None) if logprobs is None else (float(logprobs[0]), [TopLogprob.unvalidated(
                {"token": int(t), "logprob": float(v), "piece": bytes(p)}) for t, v, p in logprobs[1]])
            s.to_asker.send_nowait(Token.unvalidated({"type": "token", "v": 1, "session": book.id,
                                                   "epoch": book.epoch, "index": emitted.index, "token": token,
                                                   "piece": piece, "receipts": chain, "logprob": lp,
                                                   "top_logprobs": top}))
        if emitted.done is not None:
            self.signing.send_chain(s)
            length = s.draft_length
            s.to_asker.send_nowait(Done(session=book.id, epoch=book.epoch, reason=emitted.done,
                                        generated=book.generated, drafted=length.drafted if length else 0,
                                        accepted=length.accepted if length else 0))

    def feed(self, s: Session, token: int, pos: int) -> None:
        """Sends the token (at ``pos``) around the ring, with drafts after it."""
        book = s.book
        k = 0
        if s.drafter is not None and s.draft_length is not None:
            # drafts never run past the session's budget or its last token
            room = min(self.state.limits.max_session_tokens - pos, book.max_tokens - book.generated) - 1
            k = max(0, min(s.draft_length.next_k(), room))
        if s.to_draft is not None:
            # the draft model's calls are awaited in the session's own task, off the scheduler
            s.to_draft.send_nowait((token, pos, k))
            return
        self.send_step(s, token, pos, s.drafter.draft(k) if s.drafter is not None else [])

    async def model_drafts(self, s: Session, steps: trio.MemoryReceiveChannel[tuple[int, int, int]]) -> None:
        async for token, pos, k in steps:
            drafts = await self.draft_with_model(s, k) if k else []
            if self.state.books.holds(s.book) and s.book.phase in LIVE:
                self.send_step(s, token, pos, drafts)

    async def draft_with_model(self, s: Session, k: int) -> list[int]:
        """Up to ``k`` greedy tokens of the draft model after the session's tokens; none if its worker
        fails (the step then goes on without drafts: a draft is only ever a guess)."""
        engine, kv, slot = self.draft_engine, s.draft_kv, s.book.slot
        assert engine is not None and kv is not None and s.drafter is not None
        tokens = list(s.drafter.tokens)
        try:
            if s.draft_generation != engine.generation:
                # a new draft worker (or a slot another session used before): nothing of ours in its KV
                s.draft_generation = engine.generation
                kv.held = []
                await self._draft_call(engine, ops.SamplerNew(sid=slot, params=GREEDY))
            keep, feed = kv.plan(tokens)
            await self._draft_call(engine, ops.Remove(seq=slot, p0=keep))
            drafts: list[int] = []
            pos = keep
            while len(drafts) < k:
                chunk = feed[:self.state.limits.n_batch] if feed else drafts[-1:]
                feed = feed[len(chunk):]
                reply = await self._draft_call(engine, ops.Forward(
                    seq=np.full(len(chunk), slot, dtype=np.int32).tobytes(),
                    pos=np.arange(pos, pos + len(chunk), dtype=np.int32).tobytes(),
                    tokens=np.asarray(chunk, dtype=np.int32).tobytes(),
                    want=np.eye(1, len(chunk), len(chunk) - 1, dtype=np.int8).tobytes(),
                    sample=[[0, slot]] if not feed else []))
                pos += len(chunk)
                if not feed:
                    drafts.append(int(reply["picks"][0][0]))
        except (ProtocolError, KeyError, IndexError, TypeError, ValueError):
            s.draft_generation = -1
            return []
        kv.ran(tokens, drafts)
        return drafts

    async def _draft_call(self, engine: EngineSupervisor, op: ops.Op) -> dict[str, Any]:
        try:
            reply, _ = await engine.call(op.header())
        except (WorkerDown, WorkerRefused) as exc:
            raise ProtocolError(ErrorCode.INTERNAL, f"draft model: {exc}") from exc
        return reply

    def send_step(self, s: Session, token: int, pos: int, drafts: list[int]) -> None:
        state, book = self.state, s.book
        s.drafts = drafts
        tokens = [token, *drafts]
        if state.report.has_input and not s.open.check:
            # a whole-model stage is its own ring (in a check session every step comes from the asker):
            # its receipt of the token starts the next step's chain, as the tail's does on a longer
            # route, so the asker checks one kind of chain
            ids = np.asarray(tokens, dtype=np.int32)
            h_in = row_hash(ids.tobytes()) if s.receipts is not None else b""
            ring, s.ring_receipt = s.ring_receipt, None
            chain = None if ring is None else read_chain(ring, book.id, book.epoch, state.digest)
            try:
                state.enqueue(s, pos, len(tokens), Rows(s, ids, None, None, h_in, chain), len(tokens) - 1)
            except ProtocolError as exc:
                state.fail(s, exc)
        elif s.downstream is not None:
            ring, s.ring_receipt = s.ring_receipt, None
            s.downstream.send_nowait(encode_activation(session=book.id, epoch=book.epoch, step=book.generated,
                                                       pos=pos, n_tokens=len(tokens), tensors=[], tokens=tokens,
                                                       drafts=len(tokens) - 1, receipts=ring))
