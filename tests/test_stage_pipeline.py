"""Three `meshd serve` processes on loopback answer exactly like the whole model, alone and together."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio
from localmesh import Served, serving

from meshd.client.ask import AskRequest, AskResult
from meshd.client.route import Stage, route_at
from meshd.client.session import run_session
from meshd.net.peers import Peers, open_peers
from tests.conftest import greedy_reference
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.stage import STAGE_PROTOCOL, Metrics, MetricsRequest

pytestmark = pytest.mark.slow  # three daemons and their workers

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 10.",
    "Give me a short recipe for pancakes.",
]
NEW_TOKENS = 64
# every ask ends within this, however the pipeline breaks (a bound against hangs, not a speed claim)
ASK_DEADLINE = 120
RANGES = ["0:10", "10:20", "20:30"]


@pytest.fixture(scope="module")
def stages() -> Iterator[list[Served]]:
    with serving(RANGES, 12, 512) as served:
        yield served


@pytest.fixture(scope="module")
def expected(default_model: Path) -> dict[str, list[int]]:
    return greedy_reference(default_model, PROMPTS, NEW_TOKENS)


@pytest.fixture
async def peers() -> AsyncIterator[Peers]:
    async with open_peers(NodeIdentity.generate()) as p:
        yield p


def route_of(stages: list[Served]) -> list[Stage]:
    return route_at([s.address for s in stages])


def request(prompt: str, max_tokens: int = NEW_TOKENS) -> AskRequest:
    return AskRequest(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens)


async def metrics(peers: Peers, address: str) -> dict[str, float]:
    stream = await peers.open_stream(address, STAGE_PROTOCOL)
    async with stream:
        await stream.send_message(MetricsRequest())
        reply = await stream.receive_message()
    assert isinstance(reply, Metrics)
    return reply.values


async def test_pipeline_matches_whole_model_for_each_prompt(stages: list[Served], peers: Peers,
                                                            expected: dict[str, list[int]]) -> None:
    route = route_of(stages)
    for prompt in PROMPTS:
        with trio.fail_after(ASK_DEADLINE):
            result = await run_session(peers, route, request(prompt), AskResult())
        assert result.tokens == expected[prompt], prompt
        assert result.reason == ("max_tokens" if len(result.tokens) == NEW_TOKENS else "eog")


async def test_concurrent_sessions_match_solo_runs_and_share_engine_calls(
        stages: list[Served], peers: Peers, expected: dict[str, list[int]]) -> None:
    route = route_of(stages)
    before = [await metrics(peers, s.address) for s in stages]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    results: list[AskResult | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        with trio.fail_after(ASK_DEADLINE):
            results[i] = await run_session(peers, route, request(prompts[i]), AskResult())

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    for prompt, result in zip(prompts, results, strict=False):
        assert result is not None and result.tokens == expected[prompt], prompt
    after = [await metrics(peers, s.address) for s in stages]
    for b, a in zip(before, after, strict=False):
        # calls were shared, but by how many sessions is the run's timing: a stage takes what is ready when
        # its engine frees (no gather window), and 8 sessions through 3 stages settle into waves of about
        # three (CI at a3c573e: one stage's largest call held 3)
        assert a["multi_session_calls"] > b["multi_session_calls"]
        assert a["sessions"] == 0 and a["kv_tokens"] == 0


async def test_cancel_frees_kv_on_every_stage_at_once(stages: list[Served], peers: Peers) -> None:
    route = route_of(stages)
    seen: list[int] = []
    during: list[dict[str, float]] = []

    class Cancelled(Exception):
        pass

    async def count(token: int, piece: bytes) -> None:
        seen.append(token)
        if len(seen) == 10:
            during.extend([await metrics(peers, s.address) for s in stages])
            raise Cancelled()

    result = AskResult()
    # a hang is a failure here, not a pass
    with trio.fail_after(60), pytest.raises(Cancelled):
        # the pancake recipe runs past 200 tokens: the session is live at the tenth
        await run_session(peers, route, request(PROMPTS[4], max_tokens=500), result, on_token=count)
    assert len(seen) == 10 and result.tokens == seen
    assert [(m["sessions"], m["kv_tokens"] > len(result.prompt_tokens)) for m in during] == [(1.0, True)] * 3
    # run_session returns once every stage has said Released: the KV is off every stage's books
    after = [await metrics(peers, s.address) for s in stages]
    assert [(m["sessions"], m["kv_tokens"]) for m in after] == [(0.0, 0.0)] * 3
    assert all(a["released"] == d["released"] + 1 for a, d in zip(after, during, strict=True))


async def test_killed_engine_worker_fails_session_fast_then_recovers(
        stages: list[Served], peers: Peers, expected: dict[str, list[int]]) -> None:
    route = route_of(stages)
    middle = stages[1]
    killed = False

    async def kill_middle_worker(token: int, piece: bytes) -> None:
        nonlocal killed
        if not killed and len(result.tokens) == 5:
            os.kill(middle.worker_pid, signal.SIGKILL)
            killed = True

    result = AskResult()
    # "fast" is not a time: the stage must see the death itself (its socket or its exit), not
    # wait out the engine call's deadline; the outer deadline only bounds a hang
    with pytest.raises(ProtocolError) as err, trio.fail_after(ASK_DEADLINE):
        # a long answer (the pancake recipe runs past 200 tokens): the tail tells tokens in 50 ms pieces
        # (fastpath.STREAM_INTERVAL), and a short one could be whole before the fifth token reached us
        await run_session(peers, route, request(PROMPTS[4], max_tokens=500), result, on_token=kill_middle_worker)
    print(f"typed error {err.value.code.value} after SIGKILL: {err.value.message}")
    assert killed
    assert err.value.code in (ErrorCode.INTERNAL, ErrorCode.UNREACHABLE)
    assert err.value.retryable
    assert "engine worker" in err.value.message and "in time" not in err.value.message, err.value.message
    with trio.fail_after(30):
        while (await metrics(peers, middle.address))["worker_up"] != 1.0:
            await trio.sleep(0.1)
    m = await metrics(peers, middle.address)
    assert m["worker_restarts"] >= 1
    with trio.fail_after(ASK_DEADLINE):
        again = await run_session(peers, route, request(PROMPTS[0]), AskResult())
    assert again.tokens == expected[PROMPTS[0]]
