"""The prefix cache through three `meshd serve` stages: an ask that shares a long prefix with an earlier
one takes that prefix from every stage's cache and gives exactly the tokens it gives with the cache off,
greedy and sampled with a seed, on the fast path and the daemons' path."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Iterator

import pytest
import trio
from localmesh import Served, start_serve, stop_all

from meshd.client.ask import AskRequest, AskResult, route_at, run_session
from meshd.net.peers import Peers, open_peers
from wire.identity import NodeIdentity
from wire.stage import PREFIX_BLOCK, STAGE_PROTOCOL, Metrics, MetricsRequest, Sampling

pytestmark = pytest.mark.slow  # three daemons and their workers

RANGES = ["0:10", "10:20", "20:30"]
NEW_TOKENS = 24
# every ask ends within this, however the pipeline breaks (a bound against hangs, not a speed claim)
ASK_DEADLINE = 240
WORDS = ("the river mesh stage model token cache layer prompt answer agent tool north quiet garden copper "
         "seven window harbor lantern signal paper winter orbit").split()


def document(words: int, seed: int = 5) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


# about 2,010 tokens of the default model's tokenizer with its chat template
SYSTEM = "Answer from this document.\n" + document(1980)


@pytest.fixture(scope="module")
def stages() -> Iterator[list[Served]]:
    served: list[Served] = []
    try:
        for r in RANGES:
            served.append(start_serve("--layers", r, "--threads", "1", "--max-sessions", "3",
                                      "--session-tokens", "2304", "--cache-tokens", "4608"))
        yield served
    finally:
        stop_all(served)


@pytest.fixture
async def peers() -> AsyncIterator[Peers]:
    async with open_peers(NodeIdentity.generate()) as p:
        yield p


def ask(question: str, cache: bool, sampling: Sampling = Sampling(), fast: bool = True) -> AskRequest:
    return AskRequest(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                      max_tokens=NEW_TOKENS, sampling=sampling, cache=cache, fast=fast)


async def answer(peers: Peers, stages: list[Served], request: AskRequest) -> AskResult:
    with trio.fail_after(ASK_DEADLINE):
        return await run_session(peers, route_at([s.address for s in stages]), request, AskResult())


async def cache_metrics(peers: Peers, address: str) -> dict[str, float]:
    stream = await peers.open_stream(address, STAGE_PROTOCOL)
    async with stream:
        await stream.send_message(MetricsRequest())
        reply = await stream.receive_message()
    assert isinstance(reply, Metrics)
    return {k: v for k, v in reply.values.items() if k.startswith("cache_")}


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.9, top_k=40, seed=1234)],
                         ids=["greedy", "seeded"])
async def test_a_cached_prefix_gives_the_uncached_answer(stages: list[Served], peers: Peers,
                                                         sampling: Sampling) -> None:
    first, second = "What is the first word?", "Which words come up most?"
    cold = await answer(peers, stages, ask(first, True, sampling))
    assert cold.cached_tokens == 0 or sampling.temperature  # the greedy run comes first: nothing kept yet
    assert len(cold.prompt_tokens) >= 2000
    warm = await answer(peers, stages, ask(second, True, sampling))
    off = await answer(peers, stages, ask(second, False, sampling))
    assert off.cached_tokens == 0
    # the shared part is the system prompt (all but its last partial block)
    shared = next(i for i, (a, b) in enumerate(zip(cold.prompt_tokens, warm.prompt_tokens, strict=False)) if a != b)
    assert warm.cached_tokens == shared // PREFIX_BLOCK * PREFIX_BLOCK >= 1900
    assert warm.tokens == off.tokens and len(off.tokens) > 0
    # the daemons' path takes the same prefix (the fast session left it) and gives the same answer
    slow = await answer(peers, stages, ask(second, True, sampling, fast=False))
    assert slow.cached_tokens >= warm.cached_tokens and slow.tokens == off.tokens
    # the same prompt again: all but its last position come from the cache
    again = await answer(peers, stages, ask(second, True, sampling))
    assert again.cached_tokens == (len(again.prompt_tokens) - 1) // PREFIX_BLOCK * PREFIX_BLOCK
    assert again.tokens == off.tokens
    for stage in stages:
        figures = await cache_metrics(peers, stage.address)
        assert figures["cache_hits"] >= 3 and figures["cache_tokens"] <= 4608, figures
