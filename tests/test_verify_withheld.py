"""A check nobody can dodge, and no honest stage blamed, on real stages: a stage that keeps its inputs
from a spot check (nothing, a short or reordered list, or nothing in time) has failed it, a one-stage
route is checked too, and a replica of other numerics is never compared with the stage it would check.

Stages of a tiny random model run in this process, each with its own engine worker: the model
split in two (each half served twice) and whole (twice). The attackers are meshd's own stage
service with one method patched: the tail's answer to the asker's request for its inputs, or a
whole-model stage's sampled token. Each lie is blamed on its stage and the answer comes out as
an undisturbed one's; where nothing can check a range, the answer says so, and an asker that
requires a verified answer generates it again on a route that can be checked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio
from test_verify_route import stage_nodes, stage_of

from meshd.client.ask import AskRequest, AskResult, RouteError
from meshd.client.asker import Asker, Unverified
from meshd.client.failover import ask_with_failover
from meshd.client.route import Stage
from meshd.client.session import run_session
from meshd.client.verifier import Verifier
from meshd.client.verify import CheckPlan
from meshd.net.peers import PeersConfig, open_peers
from meshd.stage.node import StageNode
from meshd.stage.service import StageService
from meshd.stage.state import Session
from wire.identity import NodeIdentity
from wire.receipt import Proof
from wire.stage import Inputs, InputsRequest, Sampling

pytestmark = pytest.mark.slow  # six engine workers

ASK_DEADLINE = 120
RANGES = {"head": (0, 3), "head2": (0, 3), "tail": (3, 6), "tail2": (3, 6), "whole": (0, 6), "whole2": (0, 6)}
# the daemons' path, whose stage services the attackers patch (tests/test_verify_fast.py: the fast path)
REQUEST = AskRequest(text="The lighthouse keeper climbed the stairs", max_tokens=16, fast=False)


def withholding(service: StageService, kind: str) -> None:
    """An attacker: answers the asker's request for its kept inputs with none, all but the last,
    all in reverse order, or never ("late")."""

    def lying(session: Session, msg: InputsRequest) -> None:
        taken = [s for s in session.kept if s.pos < msg.until]
        session.kept = session.kept[len(taken):]
        if kind == "late":
            return
        steps = {"nothing": [], "short": taken[:-1], "reordered": taken[::-1]}[kind]
        session.to_asker.send_nowait(Inputs(session=session.book.id, epoch=session.book.epoch, steps=steps))

    service.signing.send_inputs = lying  # type: ignore[method-assign]


def forging_tokens(service: StageService, from_call: int) -> None:
    """An attacker serving the whole model: from its ``from_call``-th engine call of a routed session
    on, it sends (and signs, as an honest stage would) another token than the one it sampled."""
    honest = service.batcher.dispatch
    calls = [0]
    n_vocab = service.report.n_vocab

    def lying(batch: list[Any], reply: dict[str, Any], body: bytearray) -> None:
        if any(not w.payload.session.open.check for w in batch):
            calls[0] += 1
            if calls[0] >= from_call and reply.get("picks"):
                token = reply["picks"][0][0]
                reply["picks"][0] = ((token + 1) % n_vocab, False, b" FORGED")
        honest(batch, reply, body)

    service.batcher.dispatch = lying  # type: ignore[method-assign]


def route_finder(pool: Sequence[StageNode], whole: bool) -> Callable[[list[str]], Any]:
    """Routes over ``pool`` as a tracker would plan them: one stage serving the whole model if
    ``whole`` and one is left, else the first node of each half not excluded."""

    async def find(excluded: list[str]) -> list[Stage]:
        left = [n for n in pool if n.peers.node_id not in excluded]
        ranges = [(0, 6)] if whole and any(n.service.report.layer_begin == 0 and n.service.report.layer_end == 6
                                           for n in left) else [(0, 3), (3, 6)]
        route = []
        for begin, end in ranges:
            node = next((n for n in left if (n.service.report.layer_begin, n.service.report.layer_end)
                         == (begin, end)), None)
            if node is None:
                raise RouteError(f"no node left serving [{begin}, {end})")
            route.append(stage_of(node))
        return route

    return find


async def test_inputs_kept_from_a_check_and_a_one_stage_liar_are_caught_or_said(tiny_models: dict[str, Path]) -> None:
    async with stage_nodes(tiny_models["llama-gqa-untied"], RANGES) as nodes:
        # one engine build on one machine, on the CPU: one numerics fingerprint, which each stage tells the asker
        assert len({n.service.report.numerics for n in nodes.values()}) == 1
        assert nodes["head"].service.report.numerics.endswith("/cpu")
        assert nodes["head"].service.info().numerics == nodes["head"].service.report.numerics
        halves = [nodes[n] for n in ("head", "head2", "tail", "tail2")]
        split = route_finder(halves, whole=False)
        async with open_peers(NodeIdentity.generate(), PeersConfig(drain_timeout=0.5)) as peers:
            with trio.fail_after(ASK_DEADLINE):
                undisturbed = await run_session(peers, await split([]), REQUEST, AskResult())

                # the tail keeps its inputs from the check the answer gets once it is in: blamed, and the
                # answer generated again on a route without it comes out the same
                liar = nodes["tail"]
                for kind in ("nothing", "short", "reordered", "late"):
                    withholding(liar.service, kind)
                    verifier = Verifier(peers, CheckPlan(every=1 << 30, candidates=[stage_of(n) for n in halves],
                                                         inputs_seconds=2.0))
                    answer = await ask_with_failover(peers, split, REQUEST, verifier=verifier)
                    assert verifier.liars == {liar.peers.node_id}, kind
                    assert answer.tokens == undisturbed.tokens and answer.epochs == 2, kind
                    del liar.service.signing.send_inputs

                # a replica of other numerics (another build, a GPU: other last bits, as this one's flipped float
                # stands for) is never compared with the stage: its range goes unchecked, and nobody is blamed
                other = nodes["tail2"]
                report = other.service.report
                other.service.state.report = dataclasses.replace(report, numerics="another-build/x86_64/gpu")
                honest = other.service.batcher.dispatch

                def other_bits(batch: list[Any], reply: dict[str, Any], body: bytearray) -> None:
                    if reply.get("picks"):
                        reply["picks"][0] = ((reply["picks"][0][0] + 1) % other.service.report.n_vocab, False, b"")
                    honest(batch, reply, body)

                other.service.batcher.dispatch = other_bits  # type: ignore[method-assign]
                verifier = Verifier(peers, CheckPlan(every=4, candidates=[stage_of(n) for n in halves]))
                answer = await ask_with_failover(peers, split, REQUEST, verifier=verifier)
                assert verifier.liars == set() and answer.tokens == undisturbed.tokens and answer.epochs == 1
                (note,) = [n for n in answer.unverified if n.layers == "[3, 6)"]
                assert "other numerics (another-build/x86_64/gpu)" in note.why, note
                del other.service.batcher.dispatch
                other.service.state.report = report

                # a stage serving the whole model is a route of one stage, checked on a replica of the whole range:
                # honest, with a repeat penalty (whose history, the prompt's ids, the replica reads off the
                # ids it is fed), it is checked to the end and blamed for nothing
                whole_pool = [nodes["whole"], nodes["whole2"]]
                penalised = replace(REQUEST, sampling=Sampling(repeat_penalty=1.3))
                verifier = Verifier(peers, CheckPlan(every=4, candidates=[stage_of(n) for n in whole_pool]))
                answer = await ask_with_failover(peers, route_finder(whole_pool, whole=True), penalised,
                                                 verifier=verifier)
                assert verifier.liars == set() and answer.verified and answer.epochs == 1
                assert verifier.plan.compared >= len(answer.tokens)
                forger = nodes["whole"]
                forging_tokens(forger.service, 3)
                verifier = Verifier(peers, CheckPlan(every=4, candidates=[stage_of(n) for n in nodes.values()]))
                answer = await ask_with_failover(peers, route_finder(list(nodes.values()), whole=True), REQUEST,
                                                 verifier=verifier)
                assert verifier.liars == {forger.peers.node_id}
                assert answer.tokens == undisturbed.tokens and answer.epochs == 2
                # its replica answered in its place, with nobody left to check it: the answer says so
                assert [(n.layers, n.node_id, n.why) for n in answer.unverified] == [
                    ("[0, 6)", nodes["whole2"].peers.node_id, "no replica")]

                # with no replica of the whole range, its forged answer comes with the word that nothing checked
                # it; an asker that requires a verified answer gets the honest one on a route that is checked
                pool = [forger, *halves]

                async def no_proof(proof: Proof) -> None:
                    raise AssertionError("nothing here is proven")

                asker = Asker(peers, route_finder(pool, whole=True), split, no_proof, verify_every=4)
                forged = await asker.ask(REQUEST)
                assert b" FORGED" in b"".join(forged.pieces) and not forged.verified
                assert [(n.layers, n.node_id, n.why) for n in forged.unverified] == [
                    ("[0, 6)", forger.peers.node_id, "no replica")]
                shown: list[bytes] = []
                asker.require_verified = True
                checked = await asker.ask(REQUEST, lambda token, piece: shown.append(piece))
                assert checked.tokens == undisturbed.tokens and checked.verified
                assert forger.peers.node_id in checked.excluded and shown == checked.pieces
                # and where no route can be checked at all, the answer is withheld, not shown
                lone = Asker(peers, route_finder([forger], whole=True), route_finder([forger], whole=True), no_proof,
                             require_verified=True)
                shown.clear()
                with pytest.raises(Unverified, match=r"layers \[0, 6\) .* \(no replica\)"):
                    await lone.ask(REQUEST, lambda token, piece: shown.append(piece))
                assert shown == []
