"""Verification on the fast path: rows go worker to worker, each stage's daemon signs spans of them.

Stages of a tiny random model run in this process, each with its own engine
worker; every range is served twice or three times, so each has a replica. A
verified ask takes the fast path (its decode rows never touch a daemon), with
and without speculation, and its answer is the undisturbed one's; the spot
checks replay it on a chain of replicas fed the token ids, so no stage hands
over its inputs. The attackers: a stage whose engine worker flips a float of
its output (and whose daemon signs what was sent, as an honest one would: only
a spot check can catch it), the same keeping its inputs from the check that
settles the mismatch, and stages whose daemons sign other spans than their
workers ran, or never sign their last.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio
from lying_worker import lying, restart_worker
from test_verify_route import stage_nodes, stage_of

from meshd.client.ask import AskRequest, AskResult
from meshd.client.failover import ask_with_failover
from meshd.client.session import run_session
from meshd.client.verifier import Verifier
from meshd.client.verify import CheckPlan
from meshd.mesh.proofs import check_proof
from meshd.net.peers import PeersConfig, open_peers
from meshd.stage.node import StageNode
from meshd.stage.service import StageService
from meshd.stage.state import Session
from wire.identity import NodeIdentity
from wire.receipt import row_hash
from wire.stage import Inputs, Seal

pytestmark = pytest.mark.slow  # seven engine workers

ASK_DEADLINE = 120
RANGES = {"head": (0, 2), "head2": (0, 2), "mid": (2, 4), "mid2": (2, 4), "mid3": (2, 4), "tail": (4, 6),
          "tail2": (4, 6)}
REQUEST = AskRequest(text="The lighthouse keeper climbed the stairs and", max_tokens=40)


def signing_other_input(service: StageService) -> None:
    """An attacker's daemon: signs its spans' input as other rows than its worker took in."""
    honest = service.signing.sign_span

    def other(session: Session, pos: int, n: int, h_in: bytes, h_out: bytes, t_us: int) -> None:
        honest(session, pos, n, row_hash(b"other" + h_in), h_out, t_us)

    service.signing.sign_span = other  # type: ignore[method-assign]


def signing_other_check_outputs(service: StageService) -> None:
    """A lying replica: signs its check sessions' outputs as other rows than it computed."""

    def other(session: Session, w: Any, out: Any) -> None:
        assert session.receipts is not None
        session.check_receipts.append(session.receipts.sign_wire(w.pos, w.n, w.payload.h_in, row_hash(b"other")))
        if session.book.in_flight == 0:
            service.signing.check_receipts(session, session.check_receipts.pop())

    service.signing.check_receipt = other  # type: ignore[method-assign]


def withholding_inputs(service: StageService) -> None:
    """An attacker's daemon: answers the asker's request for its kept inputs with none."""

    def nothing(session: Session, msg: Any) -> None:
        session.kept = []
        session.to_asker.send_nowait(Inputs(session=session.book.id, epoch=session.book.epoch, steps=[]))

    service.signing.send_inputs = nothing  # type: ignore[method-assign]


def withholding_seal(service: StageService) -> None:
    """An attacker's daemon: never signs its last span (the asker's seal goes unanswered)."""

    async def silent(session: Session, msg: Any) -> None:
        return None

    service.fast.seal = silent  # type: ignore[method-assign]


def inputs_asked(service: StageService) -> list[int]:
    """Records the positions up to which the asker asks ``service`` for a fast session's kept inputs."""
    asked: list[int] = []
    honest = service.fast.inputs

    async def recording(session: Session, msg: Any) -> None:
        asked.append(msg.until)
        await honest(session, msg)

    service.fast.inputs = recording  # type: ignore[method-assign]
    return asked


def client() -> tuple[list[int], Any]:
    """A client's view of an answer: the tokens handed to it, in order."""
    got: list[int] = []
    return got, lambda token, piece: got.append(token)


def route(nodes: dict[str, StageNode], names: tuple[str, ...]) -> Any:
    async def find(excluded: list[str]) -> list[Any]:
        out = []
        for begin in (0, 2, 4):
            out.append(next(stage_of(nodes[n]) for n in names if nodes[n].service.report.layer_begin == begin
                            and nodes[n].peers.node_id not in excluded))
        return out

    return find


async def test_a_verified_ask_takes_the_fast_path_and_catches_lies(tiny_models: dict[str, Path]) -> None:
    async with stage_nodes(tiny_models["llama-gqa-untied"], RANGES) as nodes:
        pool = [stage_of(n) for n in nodes.values()]
        every = tuple(nodes)
        async with open_peers(NodeIdentity.generate(), PeersConfig(drain_timeout=0.5)) as peers:
            with trio.fail_after(ASK_DEADLINE):
                undisturbed = await run_session(peers, await route(nodes, every)([]), replace(REQUEST, fast=False),
                                                AskResult())
                # (the daemon's own engine calls: a session on the daemons' path makes them)
                before = nodes["mid"].service.metrics.engine_calls
                fetched = inputs_asked(nodes["mid"].service)
                plan = CheckPlan(every=4, candidates=pool, rng=random.Random(3))
                got, on_token = client()
                honest = await ask_with_failover(peers, route(nodes, every), REQUEST, on_token,
                                                 verifier=Verifier(peers, plan))
                assert honest.tokens == undisturbed.tokens and honest.epochs == 1
                # the client got every token once its span's receipts were in and agreed
                assert got == honest.tokens and honest.shown == len(got) and honest.withdrawn == 0
                # the rows went worker to worker, and every range was checked to the end on a chain of
                # replicas fed the token ids: no stage was asked for its inputs
                assert nodes["mid"].service.metrics.engine_calls == before
                assert plan.checks > 0 and honest.unverified == [] and honest.verified
                assert fetched == []

                # a prompt of several prefill chunks (over 128 rows a step): the tail books the chunks it
                # samples nothing from in its spans too (it failed the session at the second chunk before)
                long = replace(REQUEST, text=REQUEST.text * 4, max_tokens=8)
                plain = await run_session(peers, await route(nodes, every)([]), replace(long, fast=False), AskResult())
                chunked = await ask_with_failover(peers, route(nodes, every), long,
                                                  verifier=Verifier(peers, CheckPlan(every=4, candidates=pool)))
                assert len(chunked.prompt_tokens) > 128 and chunked.tokens == plain.tokens and chunked.verified

                # speculation with verification: the same answer, drafts accepted, checked to the end
                got, on_token = client()
                spec = await ask_with_failover(peers, route(nodes, every), replace(REQUEST, speculate="ngram"),
                                               on_token, verifier=Verifier(peers, CheckPlan(every=4, candidates=pool)))
                assert spec.tokens == undisturbed.tokens and spec.accepted > 0 and got == spec.tokens
                assert spec.unverified == [] and spec.verified

                # a worker computing wrongly at one of the answer's last positions (signed as sent): the
                # last check of every range catches it, two replicas against it make a proof, and the
                # answer is generated again around it, the same
                prompt_len = len(undisturbed.prompt_tokens)
                await restart_worker(nodes["mid"], lying(nodes["mid"].service.engine.spec,
                                                         prompt_len + REQUEST.max_tokens - 3))
                verifier = Verifier(peers, CheckPlan(every=1 << 30, candidates=pool))
                got, on_token = client()
                caught = await ask_with_failover(peers, route(nodes, every), REQUEST, on_token, verifier=verifier)
                assert verifier.liars == {nodes["mid"].peers.node_id}
                assert caught.tokens == undisturbed.tokens and caught.epochs == 2
                # its receipts held together (it signed what it sent), so the client had the answer's text
                # before the replicas settled it; its rows changed no token, so the answer given again is
                # that text: nothing is withdrawn, nothing given twice (meshd.client.ask.give)
                assert caught.withdrawn == 0 and got == undisturbed.tokens
                (proof,) = verifier.proofs
                assert proof.kind == "divergence" and check_proof(proof) == nodes["mid"].peers.node_id

                # the same liar keeping from the check the inputs it asks for to settle the mismatch: a check
                # dodged is a check failed (no proof: what it withheld is not evidence)
                withholding_inputs(nodes["mid"].service)
                verifier = Verifier(peers, CheckPlan(every=1 << 30, candidates=pool, inputs_seconds=2))
                dodged = await ask_with_failover(peers, route(nodes, every), REQUEST, verifier=verifier)
                assert verifier.liars == {nodes["mid"].peers.node_id} and not verifier.proofs
                assert dodged.tokens == undisturbed.tokens

                # a range with no replica is replayed on its own stage, so the chain checks the ranges after it
                no_head_replica = [s for s in pool if s.node_id != nodes["head2"].peers.node_id]
                partly = await ask_with_failover(peers, route(nodes, ("head", "mid2", "tail")), REQUEST,
                                                 verifier=Verifier(peers, CheckPlan(every=4, candidates=no_head_replica)))
                assert partly.tokens == undisturbed.tokens
                assert [(n.layers, n.why) for n in partly.unverified] == [("[0, 2)", "no replica")]

                # a daemon signing another input than its worker took: it and its upstream disagree on rows
                # only they saw, so both are routed around (no proof: neither is named before the mesh)
                signing_other_input(nodes["mid2"].service)
                verifier = Verifier(peers, CheckPlan(every=4, candidates=pool))
                got, on_token = client()
                framed = await ask_with_failover(peers, route(nodes, ("head", "head2", "mid2", "mid3", "tail",
                                                                      "tail2")), REQUEST, on_token, verifier=verifier)
                assert verifier.liars == {nodes["mid2"].peers.node_id, nodes["head"].peers.node_id}
                assert not verifier.proofs and framed.tokens == undisturbed.tokens
                # the receipts disagreed before any token of theirs was handed over: the client saw none of it
                assert got == undisturbed.tokens and framed.withdrawn == 0

                # a tail that never signs its last span keeps it from every check: it failed the check, and
                # the answer is generated again around it, the same (and says that the tail's range, whose
                # only replica was the withholder, went unchecked)
                withholding_seal(nodes["tail"].service)
                verifier = Verifier(peers, CheckPlan(every=4, candidates=pool, inputs_seconds=2))
                short = await ask_with_failover(peers, route(nodes, ("head2", "mid3", "tail", "tail2")), REQUEST,
                                                verifier=verifier)
                assert verifier.liars == {nodes["tail"].peers.node_id}
                assert short.tokens == undisturbed.tokens
                assert [(n.layers, n.why) for n in short.unverified] == [("[4, 6)", "no replica")]

                # a replica lying in the chain (it signs another output than it computed): a third node sides
                # with the route, so the replica is not believed and nobody on the route is blamed
                signing_other_check_outputs(nodes["mid2"].service)
                chain = [stage_of(nodes[n]) for n in ("head", "mid2", "mid", "tail")]
                verifier = Verifier(peers, CheckPlan(every=4, candidates=chain))
                doubted = await ask_with_failover(peers, route(nodes, ("head2", "mid3", "tail2")), REQUEST,
                                                  verifier=verifier)
                assert doubted.tokens == undisturbed.tokens and not verifier.liars and not verifier.proofs
                assert doubted.unverified and all("disagreed with the route and a third node" in n.why
                                                  for n in doubted.unverified)

                # an asker sealing its session where no rows end fails that session alone: the stages serve on
                hostile = Verifier(peers, CheckPlan(every=4, candidates=pool))
                honest_seal = hostile._seal

                async def past_the_end(audit: Any) -> None:
                    audit.sealed_at = 1 << 20
                    for stream in hostile.streams:
                        if stream is not None:
                            await stream.send_message(Seal(session=audit.session, epoch=audit.epoch, until=1 << 20))
                    await honest_seal(audit)

                hostile._seal = past_the_end  # type: ignore[method-assign]
                # (each stage refuses the seal and ends the session: its own asker's answer goes unchecked)
                sealed_badly = await run_session(peers, await route(nodes, ("head2", "mid3", "tail2"))([]), REQUEST,
                                                 AskResult(), verifier=hostile)
                assert sealed_badly.tokens == undisturbed.tokens and not sealed_badly.verified
                after = await ask_with_failover(peers, route(nodes, ("head2", "mid3", "tail2")), REQUEST,
                                                verifier=Verifier(peers, CheckPlan(every=4, candidates=pool)))
                assert after.tokens == undisturbed.tokens
