"""An answer constrained by a grammar (a JSON schema here; tool calls take the same path) is verified like
any other: the tail's replicas replay its picks under the session's grammar, so an honest tail is checked
to the end and blamed for nothing, on a split route and on a one-stage one, and a tail that picks what
the grammar forbids is caught and routed around, the answer coming out as the undisturbed one.

Stages of a tiny random model carrying Qwen 2.5's chat template run in this process, each with its own
engine worker: the model split in two (each half served twice) and whole (twice)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import trio
from chat_goldens import templates_dir
from test_api_tools_mesh import with_template
from test_verify_route import stage_nodes, stage_of
from test_verify_withheld import forging_tokens, route_finder

from meshd.client.ask import AskRequest, AskResult
from meshd.client.chat import ChatRequest
from meshd.client.failover import ask_with_failover
from meshd.client.session import run_session
from meshd.client.verifier import Verifier
from meshd.client.verify import CheckPlan
from meshd.net.peers import PeersConfig, open_peers
from wire.identity import NodeIdentity
from wire.stage import Sampling

pytestmark = pytest.mark.slow  # six engine workers

ASK_DEADLINE = 120
RANGES = {"head": (0, 3), "head2": (0, 3), "tail": (3, 6), "tail2": (3, 6), "whole": (0, 6), "whole2": (0, 6)}
# a required field: the answer takes some ten tokens at least (the tiny model's are bytes)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
# the daemons' path, where a grammar is applied (the fast path takes no constrained ask)
REQUEST = AskRequest(chat=ChatRequest(messages=[{"role": "user", "content": "A lighthouse, as JSON."}],
                                      json_schema=SCHEMA), max_tokens=16, fast=False,
                     sampling=Sampling(temperature=0.9, seed=3))


async def test_a_constrained_answer_is_checked_to_the_end_and_a_tail_that_breaks_its_grammar_is_caught(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model = with_template(tiny_models["llama-gqa-untied"], tmp_path / "tiny-qwen25.gguf",
                          templates_dir() / "Qwen-Qwen2.5-7B-Instruct.jinja")
    async with stage_nodes(model, RANGES) as nodes:
        halves = [nodes[n] for n in ("head", "head2", "tail", "tail2")]
        split = route_finder(halves, whole=False)
        async with open_peers(NodeIdentity.generate(), PeersConfig(drain_timeout=0.5)) as peers:
            with trio.fail_after(ASK_DEADLINE):
                undisturbed = await run_session(peers, await split([]), REQUEST, AskResult())
                assert undisturbed.text.startswith('{"name"') and len(undisturbed.tokens) > 8, undisturbed.text

                verifier = Verifier(peers, CheckPlan(every=4, candidates=[stage_of(n) for n in halves]))
                answer = await ask_with_failover(peers, split, REQUEST, verifier=verifier)
                assert verifier.liars == set() and answer.verified and answer.epochs == 1, answer.unverified
                assert answer.tokens == undisturbed.tokens
                assert verifier.plan.compared >= len(answer.tokens)

                whole_pool = [nodes["whole"], nodes["whole2"]]
                verifier = Verifier(peers, CheckPlan(every=4, candidates=[stage_of(n) for n in whole_pool]))
                answer = await ask_with_failover(peers, route_finder(whole_pool, whole=True), REQUEST,
                                                 verifier=verifier)
                assert verifier.liars == set() and answer.verified and answer.tokens == undisturbed.tokens

                # greedy too: the tail's replica takes the grammar where the pick would otherwise be argmax's
                greedy = replace(REQUEST, sampling=Sampling())
                first = await run_session(peers, await split([]), greedy, AskResult())
                liar = nodes["tail"]
                forging_tokens(liar.service, 3)
                verifier = Verifier(peers, CheckPlan(every=4, candidates=[stage_of(n) for n in halves]))
                answer = await ask_with_failover(peers, split, greedy, verifier=verifier)
                assert verifier.liars == {liar.peers.node_id}
                assert answer.tokens == first.tokens and answer.epochs == 2
