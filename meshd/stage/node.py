"""A stage on its own (``meshd serve``): a model's layer range with its supervised engine worker,
an optional draft model's worker, and the peers it listens on."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from meshd.engine import ops
from meshd.engine.supervisor import EngineSupervisor, WorkerSpec
from meshd.mesh.models import ModelNotFound
from meshd.net.peers import Peers, PeersConfig, open_peers
from meshd.stage.books import StageLimits
from meshd.stage.model_file import model_manifest
from meshd.stage.service import StageService
from wire.identity import NodeIdentity
from wire.stage import STAGE_PROTOCOL

log = logging.getLogger(__name__)


@dataclass
class StageNode:
    address: str
    service: StageService
    engine: EngineSupervisor
    peers: Peers


class DraftModelMismatch(ModelNotFound):
    """The draft model cannot draft for this stage's model."""


async def vocab_digest(engine: EngineSupervisor) -> str:
    reply, _ = await engine.call(ops.VocabDigest().header())
    return str(reply["digest"])


@asynccontextmanager
async def stage_node(model: Path, layers: tuple[int, int] | None, limits: StageLimits, identity: NodeIdentity,
                     config: PeersConfig | None = None, listen: tuple[str, int] = ("127.0.0.1", 0),
                     threads: int = 0, poll: int = 0, gpu_layers: int = 0,
                     draft_model: Path | None = None) -> AsyncIterator[StageNode]:
    """A stage serving ``layers`` of ``model`` on ``listen``, with its supervised engine worker.

    ``gpu_layers`` of the range (counted from its end) go to a GPU; -1: all of them. A tail may
    run ``draft_model`` (the whole of a small GGUF of the same vocabulary) in a worker of its own,
    to draft for the sessions that speculate with "model"."""
    digest = (await trio.to_thread.run_sync(model_manifest, model, None)).model_id
    spec = WorkerSpec(model, layers, n_ctx=limits.max_sessions * limits.max_session_tokens,
                      n_seq_max=limits.max_sessions, n_batch=limits.n_batch, threads=threads, poll=poll,
                      gpu_layers=gpu_layers)
    engine = EngineSupervisor(spec)
    async with trio.open_nursery() as nursery:
        report = await nursery.start(engine.run)
        drafter: EngineSupervisor | None = None
        if draft_model is not None:
            if not report.has_output:
                raise DraftModelMismatch(f"a draft model drafts at the tail: layers [{report.layer_begin}, "
                                         f"{report.layer_end}) of {model.name} end before its last layer")
            drafter = EngineSupervisor(WorkerSpec(draft_model, None, n_ctx=spec.n_ctx, n_seq_max=spec.n_seq_max,
                                                  n_batch=spec.n_batch, threads=threads, poll=poll))
            draft_report = await nursery.start(drafter.run)
            same_count = draft_report.n_vocab == report.n_vocab
            if not same_count or await vocab_digest(drafter) != await vocab_digest(engine):
                detail = "the same number of tokens, but other ones" if same_count else \
                    f"{draft_report.n_vocab} tokens, not {report.n_vocab}"
                raise DraftModelMismatch(f"draft model {draft_model.name} has another vocabulary than "
                                         f"{model.name} ({detail})")
        async with open_peers(identity, config) as peers:
            service = StageService(peers, engine, report, digest, model.name, limits, draft_engine=drafter)
            engine.on_down, engine.on_event = service.on_worker_down, service.on_engine_event
            engine.on_gone = functools.partial(log.error, "layers [%d, %d) of %s no longer served: %s",
                                               report.layer_begin, report.layer_end, model.name)
            peers.handle_fast(service.door.accept)
            await nursery.start(service.run)
            peers.handle(STAGE_PROTOCOL, service.handle_stream)
            port = await peers.listen(*listen)
            yield StageNode(f"{listen[0]}:{port}", service, engine, peers)
            nursery.cancel_scope.cancel()
