"""The prefix cache through a real mesh (three `meshd join` volunteers splitting the default model, and a
member in front of them serving the HTTP API): an ask that shares a long prefix with an earlier one takes
that prefix from every stage's cache and gives exactly the tokens it gives with the cache off, greedy and
sampled with a seed, on the fast path and the daemons' path; another asker's entries are never its own;
and both API dialects say how many prompt tokens came from the cache."""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx2
import openai
import pytest
import trio
from localmesh import Served, start_join, stop_all
from prometheus_client.parser import text_string_to_metric_families

from meshd.client.ask import AskRequest, AskResult
from meshd.client.route import Stage, route_from_reply
from meshd.client.session import run_session
from meshd.net.peers import Peers, open_peers
from meshd.net.rpc import mesh_rpc
from wire.identity import NodeIdentity
from wire.meshrpc import RouteReply, RouteRequest
from wire.stage import PREFIX_BLOCK, STAGE_PROTOCOL, Metrics, MetricsRequest, Sampling, prefix_keys

pytestmark = pytest.mark.slow  # four daemons, three engine workers

# Memory for a third of the model and 4 sessions of 2,304 tokens each: the model takes three volunteers.
# Four, not three: the tracker's probe of a stage (every 30 s) takes the least recently used entry's
# sequence as any session does, and the liar's test needs an entry older than the ones it counts on
# beside the one its own next ask takes.
VOLUNTEER = ["--memory", "120M", "--threads", "1", "--max-sessions", "4", "--session-tokens", "2304",
             "--cache-tokens", "4608"]
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
# about 220: what the liar's test shows is whose entries a stage finds, not how long they are
SHORT_SYSTEM = "Answer from this document.\n" + document(200)


@dataclass
class Mesh:
    seed: Served
    url: str
    route: list[Stage]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    base = tmp_path_factory.mktemp("prefixmesh")
    nodes: list[Served] = []
    try:
        # the API's asks verified, no prefix of theirs could be cached: spot checks are off here
        nodes.append(start_join("--no-model", "--state-dir", str(base / "seed"), "--api", "127.0.0.1:0",
                                "--verify", "0"))
        url = next(line.split()[4] for line in nodes[0].lines if line.startswith("meshd: HTTP API on "))
        for i in range(3):
            nodes.append(start_join("--seed", nodes[0].address, "--state-dir", str(base / f"v{i}"), *VOLUNTEER))
        yield Mesh(nodes[0], url, route_of(nodes[0], base))
    finally:
        stop_all(nodes)


def route_of(seed: Served, base: Path, timeout: float = 120.0) -> list[Stage]:
    """The tracker's route once it has three stages (the cache keeps to a route: so does the tracker)."""
    async def ask() -> RouteReply | None:
        async with open_peers(NodeIdentity.generate()) as peers:
            try:
                reply = await mesh_rpc(peers, seed.address, RouteRequest(), timeout=10)
            except Exception:  # noqa: BLE001 (not covered yet: asked again)
                return None
        return reply if isinstance(reply, RouteReply) else None

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = trio.run(ask)
        if reply is not None and len(reply.stages) == 3:
            return route_from_reply(reply)
        time.sleep(0.5)
    raise AssertionError(f"no three-stage route in {timeout:g} s")


@pytest.fixture(scope="module")
def asker() -> NodeIdentity:
    """The identity the module's asks go out under: a stage finds an asker's own entries only, so the seeded
    run's first ask takes the greedy run's prefix instead of running all 2,000 tokens again."""
    return NodeIdentity.generate()


@pytest.fixture
async def peers(asker: NodeIdentity) -> AsyncIterator[Peers]:
    async with open_peers(asker) as p:
        yield p


def ask(question: str, cache: bool, sampling: Sampling = Sampling(), fast: bool = True,
        system: str = SYSTEM) -> AskRequest:
    return AskRequest(messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                      max_tokens=NEW_TOKENS, sampling=sampling, cache=cache, fast=fast)


async def answer(peers: Peers, mesh: Mesh, request: AskRequest) -> AskResult:
    with trio.fail_after(ASK_DEADLINE):
        # a 2,000-token prefill on a busy 2-core box: the first token may take a while
        return await run_session(peers, mesh.route, request, AskResult(), stall_timeout=ASK_DEADLINE / 2)


async def cache_metrics(peers: Peers, address: str) -> dict[str, float]:
    stream = await peers.open_stream(address, STAGE_PROTOCOL)
    async with stream:
        await stream.send_message(MetricsRequest())
        reply = await stream.receive_message()
    assert isinstance(reply, Metrics)
    return {k: v for k, v in reply.values.items() if k.startswith("cache_")}


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.9, top_k=40, seed=1234)],
                         ids=["greedy", "seeded"])
async def test_a_cached_prefix_gives_the_uncached_answer(mesh: Mesh, peers: Peers, sampling: Sampling) -> None:
    first, second = "What is the first word?", "Which words come up most?"
    cold = await answer(peers, mesh, ask(first, True, sampling))
    # the greedy run comes first: nothing kept yet (the seeded run, the same asker, finds the greedy run's prefix)
    assert cold.cached_tokens == 0 or sampling.temperature
    assert len(cold.prompt_tokens) >= 2000
    warm = await answer(peers, mesh, ask(second, True, sampling))
    off = await answer(peers, mesh, ask(second, False, sampling))
    assert off.cached_tokens == 0
    # the shared part is the system prompt (all but its last partial block)
    shared = next(i for i, (a, b) in enumerate(zip(cold.prompt_tokens, warm.prompt_tokens, strict=False)) if a != b)
    assert warm.cached_tokens == shared // PREFIX_BLOCK * PREFIX_BLOCK >= 1900
    assert warm.tokens == off.tokens and len(off.tokens) > 0
    if sampling.temperature:
        # what follows holds of the cache's keys and paths, whatever the sampling: shown once, greedy (each
        # whole run of the 2,000-token prompt is a few seconds of a core on each stage)
        return
    # the daemons' path takes the same prefix (the fast session left it) and gives the same answer
    slow = await answer(peers, mesh, ask(second, True, sampling, fast=False))
    assert slow.cached_tokens >= warm.cached_tokens and slow.tokens == off.tokens
    # the same prompt again: all but its last position come from the cache
    again = await answer(peers, mesh, ask(second, True, sampling))
    assert again.cached_tokens == (len(again.prompt_tokens) - 1) // PREFIX_BLOCK * PREFIX_BLOCK
    assert again.tokens == off.tokens
    # (that another asker's entries are not its own is shown on a shorter prompt, beside the liar's)
    for stage in mesh.route:
        figures = await cache_metrics(peers, stage.address)
        assert figures["cache_hits"] >= 3 and figures["cache_tokens"] <= 4608, figures


async def test_both_dialects_say_how_much_of_the_prompt_came_from_the_cache(mesh: Mesh) -> None:
    system = SYSTEM[:2000]
    oai = openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="none", max_retries=0, timeout=ASK_DEADLINE)
    turns = [await oai.chat.completions.create(model="", max_tokens=4, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": question}])
        for question in ("Which word comes first?", "Which word comes last?")]
    usage = turns[1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    # the system prompt's whole blocks, at least (about 400 tokens of it)
    assert 320 <= cached < usage.prompt_tokens
    claude = anthropic.AsyncAnthropic(base_url=mesh.url, api_key="none", max_retries=0, timeout=ASK_DEADLINE)
    reply = await claude.messages.create(model="", max_tokens=4, system=system, extra_body={"temperature": 0.0},
                                         messages=[{"role": "user", "content": "Which word is in the middle?"}])
    read = reply.usage.cache_read_input_tokens or 0
    assert read >= 320 and reply.usage.input_tokens >= 1
    async with httpx2.AsyncClient(base_url=mesh.url, timeout=60) as client:
        with trio.fail_after(30):
            while True:
                samples: dict[str, list[tuple[dict[str, str], float]]] = {}
                for family in text_string_to_metric_families((await client.get("/metrics")).text):
                    for sample in family.samples:
                        samples.setdefault(sample.name, []).append((sample.labels, sample.value))
                # the console's stage figures come from its polls of the stages, once a second
                if len([v for _, v in samples.get("meshd_stage_cache_hit_ratio", []) if v > 0]) == 3:
                    break
                await trio.sleep(0.5)
    assert sum(v for _, v in samples["meshd_cached_prompt_tokens_total"]) >= cached + read


async def test_an_asker_lying_about_its_prefix_hurts_only_its_own_answers(mesh: Mesh,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # a first asker of its own, with no entries yet (the module's asker keeps the long prompt's, whose
    # first 200 words are SHORT_SYSTEM's)
    async with open_peers(NodeIdentity.generate()) as peers:
        # the liar runs one prompt and names it with the keys of another's: each stage keeps what it ran
        # under the names the liar gave, as the liar's own
        honest_prompt, lie = "Which words come up least?", "Tell me a story about a harbor."
        truth = await answer(peers, mesh, ask(honest_prompt, False, system=SHORT_SYSTEM))
        async with open_peers(NodeIdentity.generate()) as liar:
            honest_ids = truth.prompt_tokens
            monkeypatch.setattr("meshd.client.prefix.prefix_keys", lambda ids: prefix_keys(honest_ids[:-1]))
            lied = await answer(liar, mesh, ask(lie, True, system=SHORT_SYSTEM))
            monkeypatch.undo()
            # the liar's entry is found by the liar alone
            again = await answer(liar, mesh, ask(honest_prompt, True, system=SHORT_SYSTEM))
        assert lied.cached_tokens == 0 and again.cached_tokens > 0
        # the first asker keeps an entry of that very prompt too (the latest: each stage's least recently used
        # entries give their sequences up first, so it outlives the next ask)
        kept = await answer(peers, mesh, ask(honest_prompt, True, system=SHORT_SYSTEM))
        assert kept.tokens == truth.tokens
        # another asker with the very prompt the lie named and the first asker kept: nothing of the liar's
        # nor of the first asker's, it runs the whole prompt, to the true answer
        async with open_peers(NodeIdentity.generate()) as honest:
            first = await answer(honest, mesh, ask(honest_prompt, True, system=SHORT_SYSTEM))
        assert first.cached_tokens == 0 and first.tokens == truth.tokens
        # while the first asker's own entry is still found by it
        mine = await answer(peers, mesh, ask(honest_prompt, True, system=SHORT_SYSTEM))
        assert mine.cached_tokens > 0 and mine.tokens == truth.tokens
