"""A grammar-constrained answer and a seeded one survive their tail's SIGKILL exactly: `meshd serve` of a
head and three replicas of the tail; the asker fails over mid-answer to the spare tail, which re-prefills
the prompt and the tokens so far: its grammar reads those tokens first (PromptTokens.generated), its
sampler's draws depend on the seed and the tokens so far alone, and the answer is token for token the one
of a run that never failed (a well-formed call)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import trio
from chat_goldens import templates_dir
from localmesh import Served, start_serve, stop_all
from test_api_tools_mesh import OTHER, TOOL, WEATHER, with_template

from meshd.client.ask import AskRequest, AskResult
from meshd.client.chat import ChatRequest, parse
from meshd.client.failover import ask_with_failover
from meshd.client.route import Stage
from meshd.net.peers import Peers
from wire.stage import STAGE_PROTOCOL, Sampling

pytestmark = pytest.mark.slow  # three daemons and their workers

SESSIONS = ["--threads", "1", "--max-sessions", "2", "--session-tokens", "512"]
# the call takes some 30 tokens: the tail dies a few tokens into it
KILL_AT = 6
TOKENS = 48


@pytest.fixture(scope="module")
def stages(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Iterator[list[Served]]:
    """A head [0, 15) and three tails [15, 30) of the default model carrying Qwen 2.5's tool-use template:
    each test kills one of the first two, the third is the spare."""
    model = with_template(default_model, tmp_path_factory.mktemp("failover") / "smollm2-qwen25-tools.gguf",
                          templates_dir() / "Qwen-Qwen2.5-7B-Instruct.jinja")
    served: list[Served] = []
    try:
        for layers in ("0:15", "15:30", "15:30", "15:30"):
            served.append(start_serve("--model", str(model), "--layers", layers, *SESSIONS))
        yield served
    finally:
        stop_all(served)


def call() -> AskRequest:
    return AskRequest(chat=ChatRequest(messages=[{"role": "user", "content": "Weather in Rome?"}],
                                       tools=[TOOL, OTHER], tool_choice="required"), max_tokens=TOKENS)


def seeded() -> AskRequest:
    return AskRequest(messages=[{"role": "user", "content": "Tell me a story about a lighthouse."}],
                      sampling=Sampling(temperature=1.0, top_k=40, seed=1234), max_tokens=TOKENS)


async def known(peers: Peers, served: Served) -> Stage:
    """The stage with its node id (as its handshake proves it): failover routes around node ids."""
    stream = await peers.open_stream(served.address, STAGE_PROTOCOL)
    async with stream:
        return Stage(served.address, stream.remote_node_id)


async def whole_then_killed(peers: Peers, stages: list[Served], victim: int,
                            request: AskRequest) -> tuple[AskResult, AskResult]:
    """The answer of a route that never fails, then the same ask whose tail ``stages[victim]`` is
    SIGKILLed (daemon and worker) KILL_AT tokens in."""
    head, doomed, spare = [await known(peers, stages[i]) for i in (0, victim, 3)]

    async def spare_route(excluded: list[str]) -> list[Stage]:
        return [head, spare]

    with trio.fail_after(120):
        whole = await ask_with_failover(peers, spare_route, request, stall_timeout=20.0)

    killed = False

    async def find(excluded: list[str]) -> list[Stage]:
        # the doomed tail until the asker found it dead and routes around it
        return [head, spare if doomed.node_id in excluded else doomed]

    def on_token(token: int, piece: bytes) -> None:
        nonlocal killed
        if not killed and len(result.tokens) == KILL_AT:
            os.kill(stages[victim].proc.pid, signal.SIGKILL)
            os.kill(stages[victim].worker_pid, signal.SIGKILL)
            killed = True

    result = AskResult()
    with trio.fail_after(120):
        await ask_with_failover(peers, find, request, on_token=on_token, stall_timeout=20.0, result=result)
    assert killed and result.failovers >= 1 and result.epochs >= 2
    return whole, result


async def test_a_required_call_is_the_same_after_its_tail_is_killed_mid_answer(stages: list[Served],
                                                                              peers: Peers) -> None:
    whole, result = await whole_then_killed(peers, stages, 1, call())
    assert result.tokens == whole.tokens
    assert result.rendered is not None
    calls = parse(result.rendered, result.text, False)["tool_calls"]
    assert calls and calls[0]["function"]["name"] in ("get_weather", "get_time"), result.text
    if calls[0]["function"]["name"] == "get_weather":
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER)


async def test_a_seeded_answer_is_the_same_after_its_tail_is_killed_mid_answer(stages: list[Served],
                                                                              peers: Peers) -> None:
    whole, result = await whole_then_killed(peers, stages, 2, seeded())
    assert len(whole.tokens) > KILL_AT + 4, whole.text
    assert result.tokens == whole.tokens
