"""Continuous batching: one engine call per step for the ready work of every session.

One scheduler task clears released slots and rejected drafts' KV, takes the
books' next batch, runs it in one engine call and hands each session's rows on:
downstream as an activation, or at the tail as sampled tokens (``meshd.stage.ring``).
The engine refuses bad input before it computes, so a refused call of several
sessions runs again one session at a time and only the offender fails.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import trio

from meshd.engine import ops
from meshd.stage.books import LIVE, Work
from meshd.stage.ring import Ring
from meshd.stage.signing import Signing
from meshd.stage.state import HIDDEN, Rows, StageState
from wire.errors import ErrorCode, ProtocolError
from wire.receipt import row_hash
from wire.tensors import encode_activation, tensor_fields


class Batcher:
    def __init__(self, state: StageState, signing: Signing, ring: Ring) -> None:
        self.state = state
        self.signing = signing
        self.ring = ring

    async def schedule(self) -> None:
        state, books = self.state, self.state.books
        while True:
            if not books.queued and not books.dirty:
                state.wake = trio.Event()
                await state.wake.wait()
            await self.clear_dirty()
            batch = books.next_batch()
            if not batch:
                continue
            await self.run_batch(batch)
            state.changed()

    async def clear_dirty(self) -> None:
        """Clears released slots and drops rejected drafts' KV; rows queued meanwhile wait for their trim."""
        state, books = self.state, self.state.books
        while books.dirty or books.trims:
            try:
                for slot, generation, pos in books.take_trims():
                    if generation == state.engine.generation:
                        await state.engine_call(ops.Remove(seq=slot, p0=pos))
                for slot, generation in books.take_dirty():
                    if generation != state.engine.generation:
                        continue
                    await state.engine_call(ops.Remove(seq=slot))
                    if state.report.has_output:
                        await state.engine_call(ops.SamplerFree(sid=slot))
            except ProtocolError:
                return

    async def run_batch(self, batch: list[Work[Rows]]) -> None:
        """One engine call for ``batch``. The engine refuses bad input before it computes, so a
        refused call of several sessions is run again one session at a time: only the offender fails."""
        books = self.state.books
        t0 = trio.current_time()
        try:
            reply, body = await self.forward(batch)
        except ProtocolError as exc:
            if exc.code is ErrorCode.BAD_REQUEST and len(batch) > 1:
                for work in batch:
                    if books.holds(work.session) and work.session.phase in LIVE:
                        await self.run_batch([work])
                    else:
                        books.ran(work, trio.current_time())
                return
            for work in batch:
                books.ran(work, trio.current_time())
                self.state.fail(work.payload.session, exc)
            return
        self.state.metrics.record_call(len(batch), sum(w.n for w in batch), trio.current_time() - t0,
                                       sum(w.n - books.history(w) for w in batch))
        self.dispatch(batch, reply, body)

    async def forward(self, batch: list[Work[Rows]]) -> tuple[dict[str, Any], bytearray]:
        report, books = self.state.report, self.state.books
        seq = _joined([np.full(w.n, w.session.slot, dtype=np.int32) for w in batch])
        pos = _joined([np.arange(w.pos, w.pos + w.n, dtype=np.int32) for w in batch])
        payload: bytes | memoryview = b""
        tokens: bytes | None = None
        want_rows: bytes | None = None
        sample: list[list[int]] = []
        history: list[ops.SlotHistory] = []
        if report.has_input:
            tokens = _joined([w.payload.tokens for w in batch if w.payload.tokens is not None]).tobytes()
        else:
            payload = _joined([w.payload.hidden for w in batch if w.payload.hidden is not None]).data.cast("B")
            if report.needs_tokens:
                tokens = _joined([np.asarray(w.payload.carry, dtype=np.int32) for w in batch
                                  if w.payload.carry is not None]).tobytes()
        if report.has_output:
            want = np.zeros(len(pos), dtype=np.int8)
            row, out_row = 0, 0
            for w in batch:
                row += w.n
                drafts = w.payload.session.drafts
                for i, r in enumerate(range(row - books.sampled_rows(w), row)):
                    want[r] = 1
                    # a drafted row names the draft after it: the sampler stops at the first it does not pick
                    sample.append([out_row, w.session.slot, drafts[i] if i < len(drafts) else -1]
                                  if i < w.drafts else [out_row, w.session.slot])
                    out_row += 1
            want_rows = want.tobytes()
            history = [ops.SlotHistory(sid=w.session.slot, tokens=list(w.payload.history[:books.history(w)]))
                       for w in batch if w.payload.history and books.history(w)]
        return await self.state.engine_call(ops.Forward(seq=seq.tobytes(), pos=pos.tobytes(), tokens=tokens,
                                                        want=want_rows, sample=sample, history=history), payload)

    def dispatch(self, batch: list[Work[Rows]], reply: dict[str, Any], body: bytearray) -> None:
        report, books, signing = self.state.report, self.state.books, self.signing
        now = trio.current_time()
        if not report.has_output:
            hidden = np.frombuffer(body, dtype=np.float32).reshape(-1, report.stage_width)
            row = 0
            for w in batch:
                books.ran(w, now)
                out = hidden[row:row + w.n]
                row += w.n
                s = w.payload.session
                if w.session.phase not in LIVE:
                    continue
                if s.open.check:
                    signing.check_receipt(s, w, out)
                if s.downstream is None:
                    continue
                fields = tensor_fields(HIDDEN, out, s.open.wire_dtype, s.open.wire_codec)
                # a check session with a next stage is a link of a chain of replicas (meshd.client.chain_check):
                # the next range's replica replays from these rows, and each signs for the asker alone
                chain = None if s.receipts is None or s.open.check else signing.signed_chain(
                    s, w, row_hash(fields["data"]))
                s.downstream.send_nowait(encode_activation(
                    session=w.session.id, epoch=w.session.epoch, step=s.steps, pos=w.pos, n_tokens=w.n,
                    tensors=[fields], tokens=w.payload.carry if s.carry else None, drafts=w.drafts,
                    receipts=chain))
                s.steps += 1
            return
        picks = iter(reply.get("picks", []))
        for w in batch:
            books.ran(w, now)
            s = w.payload.session
            if s.drafter is not None and w.payload.history:
                s.drafter.extend(list(w.payload.history[:books.history(w)]))
            rows = [next(picks) for _ in range(books.sampled_rows(w))]
            if s.receipts is not None and w.session.phase in LIVE:
                signing.tail_receipts(s, w, rows)
            if rows:
                self.ring.verified(s, w, rows, now)
            signing.send_chain(s)


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    # one session's rows (every step of a lone session) need no copy
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
