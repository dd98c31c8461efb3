"""A cached answer is the one verification vouches for: stages of a tiny random model in this process, every
range served twice, answer a prompt that shares a prefix with an earlier one from their prefix caches,
and a verified ask of the same prompt on the fast path takes the cached prefix too (receipts at every
stage from where the rows begin, every span spot-checked on a chain of replicas fed every token id, the
prefix's included) and gives the same tokens, checked to the end of every range. A stage that lies past
the cached prefix is caught: the chain's mismatch sends the answer round again without the cache (the
prefix's KV, which this session's checks never saw made, could be why), and that session's checks name
the liar."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import trio
from hosted import Hosted, hosted, together
from lying_worker import lying, restart_worker
from test_verify_route import stage_of

from meshd.client.ask import AskRequest, AskResult
from meshd.client.failover import ask_with_failover
from meshd.client.route import Stage
from meshd.client.session import run_session
from meshd.client.verifier import Verifier
from meshd.client.verify import CheckPlan
from meshd.net.peers import PeersConfig, open_peers
from meshd.stage.books import StageLimits
from meshd.stage.node import StageNode, stage_node
from wire.identity import NodeIdentity
from wire.stage import Sampling

pytestmark = pytest.mark.slow  # six engine workers

ASK_DEADLINE = 180
RANGES = {"head": (0, 2), "head2": (0, 2), "mid": (2, 4), "mid2": (2, 4), "tail": (4, 6), "tail2": (4, 6)}
# a shared beginning of about 90 tokens (the tiny model's tokenizer is byte-level), then each ask's own: the
# whole prompt within one prefill chunk (128)
SHARED = "The lighthouse keeper climbed the stairs. " * 2


@asynccontextmanager
async def caching_stages(model: Path, ranges: dict[str, tuple[int, int]] = RANGES) -> AsyncIterator[dict[str, StageNode]]:
    limits = StageLimits(max_sessions=4, max_session_tokens=512, max_total_tokens=2048, cache_tokens=1024)
    # started side by side, and stopped so
    async with together([stage_node(model, layers, limits, NodeIdentity.generate(), PeersConfig(drain_timeout=0.5),
                                    threads=1) for layers in ranges.values()]) as nodes:
        yield dict(zip(ranges, nodes, strict=True))


async def test_a_cached_answer_is_the_verified_one_and_a_liar_past_the_prefix_is_caught(
        tiny_models: dict[str, Path]) -> None:
    async with caching_stages(tiny_models["llama-gqa-untied"]) as nodes:
        pool = [stage_of(n) for n in nodes.values()]
        first = [stage_of(nodes[n]) for n in ("head", "mid", "tail")]

        async def find(excluded: list[str]) -> list[Stage]:
            return [next(s for s in pool if s.layers == r and s.node_id not in excluded)
                    for r in ((0, 2), (2, 4), (4, 6))]

        async with open_peers(NodeIdentity.generate(), PeersConfig(drain_timeout=0.5)) as peers:
            with trio.fail_after(ASK_DEADLINE):
                ask = AskRequest(text=SHARED + "Then he", max_tokens=24)
                cold = await run_session(peers, first, replace(ask, text=SHARED + "At dusk she"), AskResult())
                cached = await run_session(peers, first, ask, AskResult())
                slow = await run_session(peers, first, replace(ask, fast=False), AskResult())
                plan = CheckPlan(every=1, candidates=pool)
                verified = await ask_with_failover(peers, find, ask, verifier=Verifier(peers, plan))
                assert cold.cached_tokens == 0 and cached.cached_tokens >= 64 and slow.cached_tokens >= 64
                assert verified.cached_tokens >= 64 and verified.verified and plan.checks > 0
                assert verified.epochs == 1 and verified.failovers == 0
                assert cached.tokens == slow.tokens == verified.tokens and len(verified.tokens) > 0

                # the middle stage's worker lies at an answer's position past the prefix (its KV stays honest:
                # the lie is in the rows it sends on); an ask through it first keeps that prefix in its cache
                liar = nodes["mid"]
                await restart_worker(liar, lying(liar.service.engine.spec, len(verified.prompt_tokens) + 8))
                await run_session(peers, first, replace(ask, text=SHARED + "At dusk she"), AskResult())
                verifier = Verifier(peers, CheckPlan(every=1, candidates=pool))
                caught = await ask_with_failover(peers, find, ask, verifier=verifier)
                assert verifier.liars == {liar.peers.node_id}
                # (the liar's range has one node left, with nobody to check it: the answer says so)
                assert caught.tokens == verified.tokens
                assert [(n.layers, n.why) for n in caught.unverified] == [("[2, 4)", "no replica")]
                # doubted with the cache, caught without it, answered around it
                assert caught.epochs == 3 and caught.cached_tokens == 0


@pytest.fixture(scope="module")
def penalty_stages(tiny_models: dict[str, Path]) -> Iterator[Hosted[dict[str, StageNode]]]:
    """A split route and a whole-model stage, the module's: the fast and the daemons' case ask them alike
    (each case's own asks show its cache hit, and its answer without the cache)."""
    ranges = {"head": (0, 2), "mid": (2, 4), "tail": (4, 6), "whole": (0, 6)}
    with hosted(lambda: caching_stages(tiny_models["llama-gqa-untied"], ranges)) as nodes:
        yield nodes


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "daemons"])
async def test_a_cached_prefix_keeps_the_repetition_penalty_and_a_whole_model_stage(
        penalty_stages: Hosted[dict[str, StageNode]], fast: bool) -> None:
    # the penalty's history holds the prompt's ids, the cached prefix's too: a sampler that missed them
    # would pick other tokens; one stage serving the whole model (head and tail at once) takes the cache too
    sampling = Sampling(temperature=0.8, top_k=20, repeat_penalty=1.5, repeat_last_n=256, seed=7)
    nodes = penalty_stages.value
    split = [stage_of(nodes[n]) for n in ("head", "mid", "tail")]
    async with open_peers(NodeIdentity.generate(), PeersConfig(drain_timeout=0.5)) as peers:
        with trio.fail_after(ASK_DEADLINE):
            for route in (split, [stage_of(nodes["whole"])]):
                ask = AskRequest(text=SHARED + "Then he", max_tokens=24, sampling=sampling, fast=fast)
                await run_session(peers, route, replace(ask, text=SHARED + "At dusk she"), AskResult())
                cached = await run_session(peers, route, ask, AskResult())
                off = await run_session(peers, route, replace(ask, cache=False), AskResult())
                assert cached.cached_tokens >= 64 and off.cached_tokens == 0
                assert cached.tokens == off.tokens and len(off.tokens) > 0
