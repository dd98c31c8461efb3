"""An answer that reaches a stage's session budget ends there, at once and saying so; it is not a dead
route found half a minute later. Nor is a client that stops taking the answer. Two real stages of a
tiny random model, in this process."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from meshd.cli.figures import figures_line
from meshd.client.ask import AskRequest, AskResult, ClientStopped, StageError
from meshd.client.failover import ask_with_failover
from meshd.client.route import Stage
from meshd.client.session import run_session
from meshd.net.peers import PeersConfig, open_peers
from meshd.stage.books import StageLimits
from meshd.stage.node import StageNode, stage_node
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity

pytestmark = pytest.mark.slow  # four engine workers

PROMPT = "The lighthouse keeper climbed the stairs"


def stage_of(node: StageNode) -> Stage:
    r = node.service.report
    return Stage(node.address, node.peers.node_id, node.service.digest, (r.layer_begin, r.layer_end))


async def test_an_answer_at_a_stages_session_budget_ends_there_saying_so(tiny_models: dict[str, Path]) -> None:
    model = tiny_models["llama-gqa-untied"]
    async with AsyncExitStack() as stack:

        async def pair(budget: int) -> list[Stage]:
            limits = StageLimits(max_sessions=2, max_session_tokens=budget)
            return [stage_of(await stack.enter_async_context(stage_node(
                model, layers, limits, NodeIdentity.generate(), PeersConfig(drain_timeout=0.5), threads=1)))
                for layers in ((0, 3), (3, 6))]

        roomy, tight = await pair(256), await pair(44)
        peers = await stack.enter_async_context(open_peers(NodeIdentity.generate(), PeersConfig(drain_timeout=0.5)))
        request = AskRequest(text=PROMPT, max_tokens=24)
        with trio.fail_after(60):
            whole = await run_session(peers, roomy, request, AskResult())
            n_prompt = len(whole.prompt_tokens)
            assert n_prompt + len(whole.tokens) > 44, "the answer must outgrow the tight budget"

            async def tight_route(excluded: list[str]) -> list[Stage]:
                return tight

            ended = await ask_with_failover(peers, tight_route, request)
        # the tokens up to the budget, the same as the roomy route's, and no failover (which went on to
        # "no route" half a minute later, the budget's words lost)
        assert ended.reason == "budget" and ended.failovers == 0 and ended.excluded == []
        assert ended.tokens == whole.tokens[:len(ended.tokens)] and n_prompt + len(ended.tokens) <= 44
        assert "session budget is 44" in ended.budget
        assert "stopped by a stage's session budget (" in figures_line(ended)
        # a prompt over the budget is refused at once, in the budget's words
        with trio.fail_after(20), pytest.raises(StageError) as refused:
            await ask_with_failover(peers, tight_route, AskRequest(text=PROMPT * 3, max_tokens=4))
        assert refused.value.code is ErrorCode.OVERLOADED and "session budget of 44 tokens" in refused.value.message


@pytest.mark.parametrize("failure", [trio.TooSlowError(), ProtocolError(ErrorCode.UNREACHABLE, "the client's socket")],
                         ids=["timeout", "protocol"])
async def test_a_client_that_stops_taking_the_answer_ends_the_ask_and_no_stage_is_blamed(
        tiny_models: dict[str, Path], failure: Exception) -> None:
    model = tiny_models["llama-gqa-untied"]
    async with AsyncExitStack() as stack:
        route = [stage_of(await stack.enter_async_context(stage_node(
            model, layers, StageLimits(max_sessions=2, max_session_tokens=256), NodeIdentity.generate(),
            PeersConfig(drain_timeout=0.5), threads=1))) for layers in ((0, 3), (3, 6))]
        peers = await stack.enter_async_context(open_peers(NodeIdentity.generate(), PeersConfig(drain_timeout=0.5)))
        asked: list[list[str]] = []

        async def find(excluded: list[str]) -> list[Stage]:
            asked.append(excluded)
            return route

        taken: list[int] = []

        async def client(token: int, piece: bytes) -> None:
            # what the tail's own errors look like to the session, raised by the client at its third token
            if len(taken) == 2:
                raise failure
            taken.append(token)

        result = AskResult()
        with trio.fail_after(60), pytest.raises(ClientStopped) as stopped:
            await ask_with_failover(peers, find, AskRequest(text=PROMPT, max_tokens=8), client, result=result)
        assert str(stopped.value) == f"the client stopped taking the answer: {failure}"
        assert len(taken) == 2 and result.failovers == 0 and result.excluded == [] and asked == [[]]
