"""A refused batched engine call fails only the offending session (a fake engine, named as one).

The stage batches every session's ready rows into one engine call. The fake
engine refuses any call holding a poisoned row, as the real one refuses bad
input before computing; the service then runs each session alone, so the
bystander batched with the offender gets its rows and only the offender fails.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import trio

from meshd.engine.engine import RangeReport
from meshd.engine.supervisor import WorkerRefused
from meshd.stage.books import Phase, StageLimits
from meshd.stage.outlet import Outlet
from meshd.stage.service import StageService
from meshd.stage.state import Rows, Session
from wire.errors import ErrorCode
from wire.message import encode
from wire.stage import Open

N_EMBD = 4
POISON = 666.0
REPORT = RangeReport(layer_begin=10, layer_end=20, n_layer=30, has_input=False, has_output=False, n_tensors=1,
                     n_bytes=1, n_embd=N_EMBD, n_vocab=100, n_ctx_train=512, arch="fake", stage_width=N_EMBD,
                     gpu_layers=(20, 20), gpu_output=False, n_bytes_gpu=0)


class FakeEngine:
    """Echoes hidden rows back; refuses (before computing) any call that holds a poisoned row."""

    generation = 1
    is_up = True
    restarts = 0

    def __init__(self) -> None:
        self.calls: list[int] = []

    async def call(self, header: dict[str, Any], payload: bytes | memoryview = b"",
                   fds: tuple[int, ...] = ()) -> tuple[dict[str, Any], bytearray]:
        await trio.lowlevel.checkpoint()
        if header["op"] != "forward":
            return {"ok": True}, bytearray()
        rows = np.frombuffer(payload, dtype=np.float32).reshape(-1, N_EMBD)
        self.calls.append(len(rows))
        if (rows == POISON).any():
            raise WorkerRefused("InvalidInput", "a poisoned row")
        return {"ok": True}, bytearray(rows.tobytes())


def session(service: StageService, name: str, owner: str) -> tuple[Session, trio.MemoryReceiveChannel[bytes]]:
    book, _ = service.books.open(name, 0, 1, 16, (), 0.0, owner=owner)
    service.books.opened(book)
    service.books.set_prompt(book, 1)
    s = Session(book=book, open=Open(session=name, epoch=0), to_asker=Outlet(encode))
    # no stream attached: what goes downstream waits in the outlet's channel, where the test reads it
    s.downstream = Outlet(bytes)
    service.state.sessions[book] = s
    return s, s.downstream.receive


async def test_a_bystander_batched_with_an_offender_gets_its_rows_and_only_the_offender_fails() -> None:
    engine = FakeEngine()
    service = StageService(None, engine, REPORT, "d" * 64, "fake", StageLimits(max_sessions=4))  # type: ignore[arg-type]
    bystander, bystander_out = session(service, "bystander", "honest")
    offender, offender_out = session(service, "offender", "attacker")
    for s, value in ((bystander, 1.0), (offender, POISON)):
        service.state.enqueue(s, 0, 1, Rows(s, None, np.full((1, N_EMBD), value, dtype=np.float32), None))
    batch = service.books.next_batch()
    assert len(batch) == 2
    await service.batcher.run_batch(batch)
    assert engine.calls == [2, 1, 1]
    assert bystander.book.phase is Phase.DECODE and bystander.book.failure is None
    assert bystander_out.receive_nowait()
    assert offender.book.phase is Phase.FAILED and offender.book.failure is not None
    assert offender.book.failure.code is ErrorCode.BAD_REQUEST
    try:
        offender_out.receive_nowait()
    except trio.WouldBlock:
        return
    raise AssertionError("the offender's rows went downstream")
