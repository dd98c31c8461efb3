"""The stage service: one layer range served to many sessions over the stage protocol.

Each session holds one llama.cpp sequence (its KV) in the engine worker. Work
arrives as prefill chunks and decode steps (tokens at the head, residual rows
elsewhere); one scheduler task puts the ready work of all sessions into one
engine call per step (continuous batching) and hands each session's rows on:
downstream as an activation, or at the tail as a sampled token that goes to
the asker and around the ring to the head.

A session on the fast path (``Open.fast``) skips all of that per step: its
rows go from this stage's engine worker straight to the next one's
(meshd.engine.fastpath). Here it is admitted, its KV reserved whole in the
books, its connections set up (``Hop.fast``) and handed to the worker, the
tail's tokens streamed to the asker as the worker reports them, and it is
ended like any other.

What is decided (slots, budgets, eviction, expiry, batches, when a session
ends) lives in the sans-IO books (``books.py``). This facade wires the parts,
each a module of one concern over the shared ``StageState``:

    sessions.py       the session protocol: Open, the control stream, the prompt
    hops.py           rows between stages: the hop stream in, the one out
    fast.py           the fast path's door and set-up, its worker's events
    cached_prefix.py  the prefix cache's lookups, copies and entries
    batching.py       continuous batching: one engine call per step
    ring.py           the tail's tokens: booked, told, fed around the ring with drafts
    signing.py        receipts signed and sent, inputs kept for spot checks
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from meshd.engine import ops
from meshd.engine.engine import RangeReport
from meshd.engine.supervisor import EngineSupervisor
from meshd.net.peers import Peers
from meshd.net.rpc import answer_typed
from meshd.net.stream import Stream
from meshd.stage.batching import Batcher
from meshd.stage.books import SessionBook, StageBooks, StageLimits
from meshd.stage.cached_prefix import CachedPrefix
from meshd.stage.fast import FastDoor, FastPath
from meshd.stage.hops import Hops
from meshd.stage.metrics import StageMetrics
from meshd.stage.ring import Ring
from meshd.stage.sessions import DialCheck, SessionProtocol, plain_address
from meshd.stage.signing import Signing
from meshd.stage.state import Rows, StageState
from wire.errors import ErrorCode, ProtocolError
from wire.message import Message
from wire.stage import Hop, Metrics, MetricsRequest, Open, StageInfo


class StageService:
    def __init__(self, peers: Peers, engine: EngineSupervisor, report: RangeReport, model_digest: str,
                 model_name: str, limits: StageLimits = StageLimits(), may_dial: DialCheck = plain_address,
                 draft_engine: EngineSupervisor | None = None, door: FastDoor | None = None,
                 credit_of: Callable[[str], float] | None = None) -> None:
        self.state = state = StageState(peers, engine, report, model_digest, model_name, limits)
        self.signing = Signing(state)
        self.ring = Ring(state, self.signing, draft_engine)
        self.batcher = Batcher(state, self.signing, self.ring)
        self.fast = FastPath(state, self.signing, self.ring, door or FastDoor())
        self.cached = CachedPrefix(state)
        self.hops = Hops(state, self.signing, self.fast, self.cached)
        self.protocol = SessionProtocol(state, self.signing, self.ring, self.fast, self.cached, self.hops,
                                       self.info, may_dial, credit_of)

    @property
    def peers(self) -> Peers:
        return self.state.peers

    @property
    def engine(self) -> EngineSupervisor:
        return self.state.engine

    @property
    def report(self) -> RangeReport:
        return self.state.report

    @property
    def digest(self) -> str:
        return self.state.digest

    @property
    def books(self) -> StageBooks[Rows]:
        return self.state.books

    @property
    def metrics(self) -> StageMetrics:
        return self.state.metrics

    @property
    def limits(self) -> StageLimits:
        return self.state.limits

    @property
    def door(self) -> FastDoor:
        return self.fast.door

    @property
    def sessions(self) -> dict[str, SessionBook]:
        return self.state.books.sessions

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.batcher.schedule)
            nursery.start_soon(self.state.expire)
            nursery.start_soon(self.fast.end_stopped)
            task_status.started()

    def on_worker_down(self, generation: int, reason: str) -> None:
        """The worker's KV is gone: every session on it fails, typed and retryable."""
        state = self.state
        error = ProtocolError(ErrorCode.INTERNAL, f"stage [{state.report.layer_begin}, {state.report.layer_end}) "
                                                   f"lost its engine worker ({reason})")
        for book in state.books.fail_all(error):
            state.ended(book)
        state.metrics.worker_gone()

    def on_engine_event(self, event: dict[str, Any]) -> None:
        self.fast.on_engine_event(event)

    async def handle_stream(self, stream: Stream) -> None:
        await answer_typed(stream, self.handle_first)

    def holds(self, session: str) -> bool:
        return session in self.state.books.sessions

    async def wait_idle(self) -> None:
        """Returns once no session is held (a retiring range waits for its last one)."""
        while self.sessions:
            await self.state.idle.wait()
            self.state.idle = trio.Event()

    async def handle_first(self, stream: Stream, first: Message) -> None:
        """Serves a stage stream whose first message has been read."""
        if isinstance(first, MetricsRequest):
            try:
                reply, _ = await self.state.engine_call(ops.FastStats())
                self.state.metrics.fast = dict(reply["stats"])
            except ProtocolError:
                pass  # the worker is down: its last counts stand
            await stream.send_message(Metrics(values=self.metric_values()))
        elif isinstance(first, Open):
            await self.protocol.serve(stream, first)
        elif isinstance(first, Hop):
            await self.hops.serve(stream, first)
        else:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"a stage stream cannot start with {first.type!r}")

    def info(self) -> StageInfo:
        state, r = self.state, self.state.report
        return StageInfo(node_id=state.peers.node_id, model_digest=state.digest, model_name=state.model_name,
                         layer_begin=r.layer_begin, layer_end=r.layer_end, n_layer=r.n_layer, stage_width=r.stage_width,
                         ready=state.engine.is_up, needs_tokens=r.needs_tokens, numerics=r.numerics,
                         cache_tokens=state.limits.cache_tokens if state.caching else 0)

    def metric_values(self) -> dict[str, float]:
        return self.state.metrics.values(self.state.books, self.state.engine)
