"""One range served by a CPU stage and a lavapipe stage as replicas (the GPU lane, tests/gpu_lane.py).

Two stages of the whole of a tiny random model, each with its own engine worker of the Vulkan build: one
with no layer offloaded (the CPU's numerics), one with every layer on lavapipe. Their fingerprints differ,
so a spot check of one on the other compares the route's tokens with the replica's likeliest within the
measured tolerance (wire.sketch), never bytes: verified at 1 in 1, an honest answer blames nobody over
200 steps; a lavapipe stage that picks another token is caught by the CPU replica; and an answer that
fails over from the CPU stage onto the lavapipe one says that it crossed numerics. The same with the first
half of the model's layers served on both, whose rows are compared with the next stage's kept inputs.
"""

from __future__ import annotations

import os
import signal
from contextlib import AsyncExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from meshd.cli.figures import figures_line
from meshd.client.ask import AskRequest
from meshd.client.failover import ask_with_failover
from meshd.client.route import Stage
from meshd.client.verifier import Verifier
from meshd.client.verify import CheckPlan
from meshd.front.dialect import verification
from meshd.net.peers import PeersConfig, open_peers
from meshd.stage.books import StageLimits
from meshd.stage.node import StageNode, stage_node
from wire.identity import NodeIdentity

pytestmark = pytest.mark.gpu

ASK_DEADLINE = 120
STEPS = 200
PROMPTS = ["The lighthouse keeper climbed the stairs and", "Once upon a time, far away,",
           "A list of the rivers of Europe:", "def fibonacci(n):", "The weather today is"]


def stage_of(node: StageNode, named: bool = True) -> Stage:
    """The stage as a route's planner names it, with its numerics (a replica's, where they are not the route's)."""
    r = node.service.report
    return Stage(node.address, node.peers.node_id, node.service.digest, (r.layer_begin, r.layer_end),
                 numerics=r.numerics if named else "")


def picking_another_token(node: StageNode, at_call: int) -> None:
    """An attacker: its ``at_call``-th engine call of a routed session (not a check session's) samples the
    next token id after the one its engine picked, and signs that as an honest tail signs its pick."""
    honest = node.service.batcher.dispatch
    calls = [0]

    def lying(batch: list[Any], reply: dict[str, Any], body: bytearray) -> None:
        if reply.get("picks") and any(not w.payload.session.open.check for w in batch):
            calls[0] += 1
            if calls[0] == at_call:
                token, _, _, *rest = reply["picks"][0]
                other = (token + 1) % node.service.report.n_vocab
                reply["picks"][0] = [other, False, b"", *rest]
        honest(batch, reply, body)

    node.service.batcher.dispatch = lying  # type: ignore[method-assign]


def on(node: StageNode, other: StageNode) -> object:
    """Routes onto ``node`` while it is not excluded, else onto ``other``: a planner that prefers one fingerprint."""
    async def find(excluded: list[str]) -> list[Stage]:
        return [stage_of(node if node.peers.node_id not in excluded else other, named=False)]

    return find


async def test_a_cpu_and_a_lavapipe_replica_check_each_other(tiny_models: dict[str, Path]) -> None:
    limits = StageLimits(max_sessions=4, max_session_tokens=512)
    async with AsyncExitStack() as stack:
        cpu, vk = [await stack.enter_async_context(stage_node(
            tiny_models["llama-gqa-tied"], None, limits, NodeIdentity.generate(), PeersConfig(drain_timeout=0.5),
            threads=1, gpu_layers=gpu)) for gpu in (0, -1)]
        assert cpu.service.report.numerics.endswith("/cpu") and not vk.service.report.numerics.endswith("/cpu")
        async with open_peers(NodeIdentity.generate(), PeersConfig(drain_timeout=0.5)) as peers:
            with trio.fail_after(ASK_DEADLINE):
                # verified at 1 in 1 on the CPU stage, checked on the lavapipe one: nobody blamed over 200 steps
                steps, undisturbed = 0, {}
                for text in PROMPTS:
                    request = AskRequest(text=text, max_tokens=80)
                    plan = CheckPlan(every=1, candidates=[stage_of(vk)])
                    verifier = Verifier(peers, plan)
                    answer = await ask_with_failover(peers, on(cpu, vk), request, verifier=verifier)
                    assert verifier.liars == set() and answer.epochs == 1, figures_line(answer)
                    assert answer.unverified == [] and answer.verified, [n.detail for n in answer.unverified]
                    # every step compared, across numerics
                    assert plan.across >= len(answer.tokens)
                    undisturbed[text] = answer.tokens
                    steps += len(answer.tokens)
                    if steps >= STEPS:
                        break
                assert steps >= STEPS

                # the lavapipe stage picks another token at one step, and signs it as it sends it: its CPU
                # replica's likeliest tokens do not allow it, and the answer goes on around it, the CPU's
                request = AskRequest(text=PROMPTS[0], max_tokens=40)
                picking_another_token(vk, at_call=10)
                verifier = Verifier(peers, CheckPlan(every=1, candidates=[stage_of(cpu)]))
                caught = await ask_with_failover(peers, on(vk, cpu), request, verifier=verifier)
                assert verifier.liars == {vk.peers.node_id} and not verifier.proofs, (
                    print(caught.tokens, verifier.plan.across), figures_line(caught))
                assert caught.epochs == 2 and caught.tokens == undisturbed[PROMPTS[0]][:len(caught.tokens)]
                del vk.service.batcher.dispatch

                # the CPU stage's worker dies mid-answer: the answer fails over onto the lavapipe stage, and
                # says where it crossed numerics (figures line, the API's verification field)
                killed: list[int] = []

                def kill_at_five(token: int, piece: str) -> None:
                    killed.append(token)
                    if len(killed) == 5 and cpu.service.engine.pid is not None:
                        os.kill(cpu.service.engine.pid, signal.SIGKILL)

                moved = await ask_with_failover(peers, on(cpu, vk), replace(request, fast=False), kill_at_five)
                assert moved.epochs == 2 and moved.crossed_numerics_at, figures_line(moved)
                assert 5 <= moved.crossed_numerics_at[0] <= len(moved.tokens)
                assert "continued on other numerics after" in figures_line(moved)
                assert verification(moved)["crossed_numerics_at"] == moved.crossed_numerics_at


def negating_a_row(node: StageNode, at_call: int) -> None:
    """An attacker before the tail: its ``at_call``-th engine call of a routed session (not a check
    session's) sends its first row negated, and signs what it sends as an honest stage does."""
    honest = node.service.batcher.dispatch
    calls = [0]

    def lying(batch: list[Any], reply: dict[str, Any], body: bytearray) -> None:
        if any(not w.payload.session.open.check for w in batch):
            calls[0] += 1
            if calls[0] == at_call:
                rows = np.frombuffer(body, dtype=np.float32)
                rows[:node.service.report.stage_width] *= -1
        honest(batch, reply, body)

    node.service.batcher.dispatch = lying  # type: ignore[method-assign]


async def test_a_range_before_the_tail_is_checked_across_numerics_on_the_next_stages_rows(
        tiny_models: dict[str, Path]) -> None:
    """The head's range on the CPU and on lavapipe: a replica of other numerics replays the route's inputs
    and sketches its rows, which the asker compares with the rows the tail took in (its kept inputs)."""
    limits = StageLimits(max_sessions=4, max_session_tokens=512)
    async with AsyncExitStack() as stack:
        head, head_vk, head2, tail, tail2 = [await stack.enter_async_context(stage_node(
            tiny_models["llama-gqa-tied"], layers, limits, NodeIdentity.generate(), PeersConfig(drain_timeout=0.5),
            threads=1, gpu_layers=gpu)) for layers, gpu in (((0, 3), 0), ((0, 3), -1), ((0, 3), 0), ((3, 6), 0),
                                                            ((3, 6), 0))]

        def split(first: StageNode, other: StageNode) -> object:
            async def find(excluded: list[str]) -> list[Stage]:
                pick = first if first.peers.node_id not in excluded else other
                return [stage_of(pick, named=False), stage_of(tail, named=False)]

            return find

        async with open_peers(NodeIdentity.generate(), PeersConfig(drain_timeout=0.5)) as peers:
            with trio.fail_after(ASK_DEADLINE):
                request = AskRequest(text=PROMPTS[0], max_tokens=48)
                plan = CheckPlan(every=1, candidates=[stage_of(head_vk), stage_of(tail2, named=False)])
                verifier = Verifier(peers, plan)
                honest = await ask_with_failover(peers, split(head, head_vk), request, verifier=verifier)
                assert verifier.liars == set() and honest.epochs == 1, figures_line(honest)
                assert honest.unverified == [] and honest.verified, [n.detail for n in honest.unverified]
                # (the fast path's steps are spans: the head's range was compared across numerics on each)
                assert 0 < plan.across < plan.compared

                # the lavapipe head sends one row negated (its rows' receipts agree with what it sent): the CPU
                # replica's sketch of that row does not allow it
                negating_a_row(head_vk, at_call=12)
                verifier = Verifier(peers, CheckPlan(every=1, candidates=[stage_of(head), stage_of(tail2, named=False)]))
                caught = await ask_with_failover(peers, split(head_vk, head), replace(request, fast=False),
                                                 verifier=verifier)
                assert verifier.liars == {head_vk.peers.node_id} and not verifier.proofs, figures_line(caught)
                assert caught.epochs == 2 and caught.tokens == honest.tokens
                del head_vk.service.batcher.dispatch

                # the lavapipe replica frames the honest CPU head (its check sessions' rows, and their sketches,
                # negated): a third node of the head's own numerics sides with it by bytes, so nobody is blamed
                # and the replica checks no more
                honest_receipt = head_vk.service.signing.check_receipt

                def framing(s: Any, w: Any, out: np.ndarray) -> None:
                    honest_receipt(s, w, -out)

                head_vk.service.signing.check_receipt = framing  # type: ignore[method-assign]
                verifier = Verifier(peers, CheckPlan(every=1, candidates=[stage_of(head_vk), stage_of(head2, named=False),
                                                                          stage_of(tail2, named=False)]))
                framed = await ask_with_failover(peers, split(head, head_vk), request, verifier=verifier)
                assert verifier.liars == set() and framed.epochs == 1 and framed.tokens == honest.tokens
                (note,) = framed.unverified
                assert "of other numerics disagreed with the route and a third node" in note.detail, note
                del head_vk.service.signing.check_receipt
