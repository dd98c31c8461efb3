"""The HTTP API of a real mesh: a `meshd join --no-model --api` member (it only asks) in front of three
volunteers that split the default model, asked with the official `openai` and `anthropic` clients."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import openai
import pytest
import trio
from localmesh import Served, run_meshd, start_join, stop_all
from prometheus_client.parser import text_string_to_metric_families

from meshd.engine import Model
from meshd.net import rpc as net_rpc
from meshd.net.peers import Peers, open_peers
from meshd.net.rpc import mesh_rpc
from tests.conftest import greedy_chat_reference
from wire.identity import NodeIdentity
from wire.meshrpc import RouteReply, RouteRequest
from wire.stage import STAGE_PROTOCOL, Metrics, MetricsRequest

pytestmark = pytest.mark.slow  # four daemons, three engine workers

KEY = "test-key-7c1d"
# Small KV budgets and memory, so the default model needs three stages; eight sessions each, for eight asks.
VOLUNTEER = ["--memory", "64M", "--threads", "1", "--max-sessions", "8", "--session-tokens", "256"]
PROMPT = "What is the capital of France? Answer in one sentence."
NEW_TOKENS = 24


@dataclass
class Mesh:
    seed: Served
    url: str
    volunteers: list[Served]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    base = tmp_path_factory.mktemp("apimesh")
    (base / "keys").write_text(KEY + "\n")
    nodes: list[Served] = []
    try:
        nodes.append(start_join("--no-model", "--state-dir", str(base / "seed"), "--api", "127.0.0.1:0",
                                "--api-key-file", str(base / "keys")))
        url = next(line.split()[4] for line in nodes[0].lines if line.startswith("meshd: HTTP API on "))
        for i in range(3):
            nodes.append(start_join("--seed", nodes[0].address, "--state-dir", str(base / f"v{i}"), *VOLUNTEER))
        wait_covered(url)
        yield Mesh(nodes[0], url, nodes[1:])
    finally:
        stop_all(nodes)


def wait_covered(url: str, timeout: float = 120.0) -> None:
    """Polls /v1/models (with the key) until the model is covered by three stages."""
    deadline = time.monotonic() + timeout
    with httpx2.Client(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as client:
        while time.monotonic() < deadline:
            models = client.get("/v1/models").json()["data"]
            if models and models[0]["coverage"]["covered"] and len(models[0]["coverage"]["stages"]) == 3:
                return
            time.sleep(0.5)
    raise AssertionError(f"the model was not covered by three stages in {timeout:g} s: {models}")


def oai(mesh: Mesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def claude(mesh: Mesh) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=mesh.url, api_key=KEY, max_retries=0, timeout=120)


async def meshd_ask(mesh: Mesh, prompt: str, *args: str) -> str:
    done = await trio.to_thread.run_sync(lambda: run_meshd("ask", "--seed", mesh.seed.address, "--max-tokens",
                                                           str(NEW_TOKENS), *args, prompt))
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n")
    return done.stdout[:-1]


async def openai_chat(mesh: Mesh, prompt: str, stream: bool) -> str:
    client = oai(mesh)
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        reply = await client.chat.completions.create(model="", messages=messages, temperature=0,  # type: ignore[arg-type]
                                                     max_tokens=NEW_TOKENS)
        assert reply.usage is not None and reply.usage.completion_tokens <= NEW_TOKENS
        return reply.choices[0].message.content or ""
    chunks = await client.chat.completions.create(model="", messages=messages, temperature=0,  # type: ignore[arg-type]
                                                  max_tokens=NEW_TOKENS, stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in chunks])


async def anthropic_message(mesh: Mesh, prompt: str, stream: bool) -> str:
    client = claude(mesh)
    messages = [{"role": "user", "content": prompt}]
    extra = {"temperature": 0.0}
    if not stream:
        reply = await client.messages.create(model="", messages=messages, max_tokens=NEW_TOKENS,  # type: ignore[arg-type]
                                             extra_body=extra)
        block = reply.content[0]
        assert block.type == "text"
        return block.text
    async with client.messages.stream(model="", messages=messages, max_tokens=NEW_TOKENS,  # type: ignore[arg-type]
                                      extra_body=extra) as events:
        return "".join([text async for text in events.text_stream])


async def openai_response(mesh: Mesh, prompt: str, stream: bool) -> str:
    client = oai(mesh)
    if not stream:
        reply = await client.responses.create(model="", input=prompt, temperature=0, max_output_tokens=NEW_TOKENS)
        return reply.output_text
    events = await client.responses.create(model="", input=prompt, temperature=0, max_output_tokens=NEW_TOKENS,
                                           stream=True)
    return "".join([e.delta async for e in events if e.type == "response.output_text.delta"])


ASKS = {
    "openai": lambda mesh, prompt: openai_chat(mesh, prompt, stream=False),
    "openai-stream": lambda mesh, prompt: openai_chat(mesh, prompt, stream=True),
    "anthropic": lambda mesh, prompt: anthropic_message(mesh, prompt, stream=False),
    "anthropic-stream": lambda mesh, prompt: anthropic_message(mesh, prompt, stream=True),
    "responses": lambda mesh, prompt: openai_response(mesh, prompt, stream=False),
    "responses-stream": lambda mesh, prompt: openai_response(mesh, prompt, stream=True),
}


def whole_model_answer(model: Path, prompt: str) -> str:
    """The greedy answer of the whole model in this process, to the prompt rendered with the model's own
    chat template as the front door renders it (meshd.client.chat)."""
    tokens = greedy_chat_reference(model, [prompt], NEW_TOKENS)[prompt]
    with Model(model) as m:
        return b"".join(m.token_piece(t) for t in tokens).decode()


async def test_greedy_answer_equals_the_whole_model_in_each_dialect_streamed_and_not(mesh: Mesh,
                                                                                    default_model: Path) -> None:
    expected = whole_model_answer(default_model, PROMPT)
    assert expected  # the model says something
    assert {how: await ask(mesh, PROMPT) for how, ask in ASKS.items()} == dict.fromkeys(ASKS, expected)


async def test_completion_equals_meshd_ask_raw(mesh: Mesh) -> None:
    prompt = "The three primary colours are"
    expected = await meshd_ask(mesh, prompt, "--raw")
    reply = await oai(mesh).completions.create(model="", prompt=prompt, temperature=0, max_tokens=NEW_TOKENS)
    assert reply.choices[0].text == expected and reply.choices[0].finish_reason == "length"


async def test_count_tokens_is_the_prompt_a_message_request_runs(mesh: Mesh) -> None:
    """The head tokenizes the prompt rendered with the model's own template, as for the message itself;
    no stage runs a row of it, and none keeps its session."""
    client = claude(mesh)
    messages = [{"role": "user", "content": PROMPT}]
    async with open_peers(NodeIdentity.generate()) as peers:
        route = await mesh_rpc(peers, mesh.seed.address, RouteRequest(), timeout=10)
        assert isinstance(route, RouteReply) and len(route.stages) == 3
        before = await stage_metrics(peers, route)
        counted = await client.messages.count_tokens(model="", messages=messages, system="Be brief.")  # type: ignore[arg-type]
        with trio.fail_after(20):
            while True:
                after = await stage_metrics(peers, route)
                if all(a["released"] > b["released"] and a["sessions"] == 0 for a, b in zip(after, before,
                                                                                            strict=True)):
                    break
                await trio.sleep(0.1)
    # the tracker's speed probes run a few rows of their own (ProbeConfig.steps) now and then; the
    # prompt would have run all of its rows on every stage
    assert all(a["rows"] - b["rows"] < counted.input_tokens for a, b in zip(after, before, strict=True))
    reply = await client.messages.create(model="", messages=messages, system="Be brief.", max_tokens=2)  # type: ignore[arg-type]
    assert counted.input_tokens == reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) > 10
    longer = await client.messages.count_tokens(model="", messages=[*messages, {"role": "assistant", "content": "Paris."},
                                                                     {"role": "user", "content": "And Spain?"}])  # type: ignore[list-item]
    assert longer.input_tokens > counted.input_tokens


async def test_completion_logprobs_come_from_the_tail_streamed_and_not(mesh: Mesh) -> None:
    """Greedy: each token is its position's likeliest, so its log-probability is the highest of its top ones;
    the tokens spell the text, their offsets walk it, and the streamed ones are the same."""
    args: dict[str, Any] = {"model": "", "prompt": "The three primary colours are", "temperature": 0,
                            "max_tokens": 8, "logprobs": 3}
    reply = await oai(mesh).completions.create(**args)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs
    assert reply.usage is not None and len(logprobs.tokens) == reply.usage.completion_tokens
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 3 and top[token] == logprob == max(top.values())
    streamed = [c.choices[0].logprobs async for c in await oai(mesh).completions.create(**args, stream=True)]
    assert [t for lp in streamed if lp is not None for t in lp.tokens or []] == logprobs.tokens
    assert [v for lp in streamed if lp is not None for v in lp.token_logprobs or []] == logprobs.token_logprobs


async def test_meshd_ask_equals_a_chat_completion_of_the_same_messages(mesh: Mesh) -> None:
    """`meshd ask` renders its chat on the model's own template, as a chat completion is rendered: the same
    prompt, so the same greedy answer (with a system message too)."""
    expected = await openai_chat(mesh, PROMPT, stream=False)
    assert expected  # the model says something
    assert await meshd_ask(mesh, PROMPT) == expected
    system = "You answer in French."
    reply = await oai(mesh).chat.completions.create(
        model="", messages=[{"role": "system", "content": system}, {"role": "user", "content": PROMPT}],
        temperature=0, max_tokens=NEW_TOKENS)
    assert reply.choices[0].message.content
    assert await meshd_ask(mesh, PROMPT, "--system", system) == reply.choices[0].message.content


async def test_eight_concurrent_requests_each_equal_their_solo_run(mesh: Mesh) -> None:
    prompts = [f"Name {n} animals that live in the {place}." for n, place in
               zip(range(2, 10), ["sea", "desert", "forest", "arctic", "jungle", "mountains", "savanna", "sky"],
                   strict=False)]
    kinds = list(ASKS)
    solo = [await ASKS[kinds[i % 4]](mesh, p) for i, p in enumerate(prompts)]
    together: list[str] = [""] * len(prompts)

    async def one(i: int) -> None:
        together[i] = await ASKS[kinds[i % 4]](mesh, prompts[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    assert together == solo
    assert len(set(solo)) == len(solo)  # eight different answers, not one repeated


async def stage_metrics(peers: Peers, route: RouteReply) -> list[dict[str, float]]:
    values = []
    for stage in route.stages:
        reply = await net_rpc.call(peers, stage.address, STAGE_PROTOCOL, MetricsRequest(), Metrics,
                                   node_id=stage.node_id, timeout=10)
        values.append(reply.values)
    return values


async def test_client_gone_mid_stream_frees_the_kv_on_every_stage(mesh: Mesh) -> None:
    budget = 200
    async with open_peers(NodeIdentity.generate()) as peers:
        route = await mesh_rpc(peers, mesh.seed.address, RouteRequest(), timeout=10)
        assert isinstance(route, RouteReply) and len(route.stages) == 3
        before = await stage_metrics(peers, route)
        async with httpx2.AsyncClient(base_url=mesh.url, headers={"x-api-key": KEY}, timeout=60) as client:
            body = {"max_tokens": budget, "stream": True, "temperature": 0,
                    "messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}]}
            async with client.stream("POST", "/v1/messages", json=body) as r:
                assert r.status_code == 200
                deltas = 0
                async for line in r.aiter_lines():
                    deltas += line.startswith("event: content_block_delta")
                    if deltas == 2:
                        break
        # the front door cancels the ask; the asker's release frees the session on every stage
        with trio.fail_after(20):
            while True:
                after = await stage_metrics(peers, route)
                if all(a["sessions"] == 0 and a["kv_tokens"] == 0 for a in after):
                    break
                await trio.sleep(0.1)
    for b, a in zip(before, after, strict=True):
        assert a["released"] > b["released"]
        # cut short: the whole answer would have run prompt + budget - 1 rows through every stage
        assert a["rows"] - b["rows"] < budget // 2


async def test_models_list_the_mesh_model_with_its_coverage(mesh: Mesh) -> None:
    listed = [m async for m in oai(mesh).models.list()]
    assert len(listed) == 1
    entry = listed[0].model_dump()
    assert entry["coverage"]["covered_layers"] == entry["coverage"]["n_layers"] == 30
    assert len(entry["digest"]) == 64
    # the model by its listed name and by its digest's prefix
    for name in (listed[0].id, entry["digest"][:12]):
        reply = await oai(mesh).chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                                        max_tokens=2)
        assert reply.model == listed[0].id


async def test_health_and_metrics_of_a_covered_mesh(mesh: Mesh) -> None:
    reply = await oai(mesh).chat.completions.create(model="", messages=[{"role": "user", "content": PROMPT}],
                                                    max_tokens=4)
    async with httpx2.AsyncClient(base_url=mesh.url, timeout=60) as client:
        health = await client.get("/health")
        refused = await client.get("/metrics")
        scraped = await client.get("/metrics", headers={"authorization": f"Bearer {KEY}"})
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert refused.status_code == 401 and scraped.status_code == 200
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(scraped.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    assert sum(v for labels, v in samples["meshd_requests_total"] if labels["outcome"] == "answered") >= 1
    assert reply.usage is not None
    assert sum(v for _, v in samples["meshd_completion_tokens_total"]) >= reply.usage.completion_tokens
    assert sum(v for _, v in samples["meshd_time_to_first_token_seconds_count"]) >= 1
    # each stage of the route: its KV use, sessions and engine worker, as the console polls them
    stages = {labels["node"] for labels, _ in samples["meshd_stage_kv_tokens"]}
    assert len(stages) == 3 and {labels["node"] for labels, v in samples["meshd_stage_worker_up"] if v == 1} == stages
    assert {labels["node"] for labels, _ in samples["meshd_stage_sessions"]} == stages
    assert [v for _, v in samples["meshd_model_covered_layers"]] == [30]
    assert sum(v for _, v in samples["meshd_members"]) >= 4


async def test_the_key_is_required(mesh: Mesh) -> None:
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="wrong", max_retries=0).models.list()


async def test_a_volunteer_gone_makes_the_model_uncovered_503_with_the_reason(mesh: Mesh) -> None:
    """Last in this module: it takes a volunteer away, and two of 64 MiB cannot hold the model."""
    await trio.to_thread.run_sync(mesh.volunteers[-1].stop)
    async with httpx2.AsyncClient(base_url=mesh.url, headers={"authorization": f"Bearer {KEY}"}, timeout=60) as client:
        with trio.fail_after(60):
            while True:
                r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                                    "max_tokens": 2})
                if r.status_code != 200:
                    break
                await trio.sleep(0.5)
        anthropic_reply = await client.post("/v1/messages", json={"max_tokens": 2,
                                                                  "messages": [{"role": "user", "content": "Hi"}]})
        models = (await client.get("/v1/models")).json()["data"]
        health = await client.get("/health")
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["type"] == "service_unavailable" and "is not covered" in error["message"]
    reason = models[0]["coverage"]["reason"]
    assert reason and reason in error["message"] and not models[0]["coverage"]["covered"]
    assert anthropic_reply.status_code == 503 and reason in anthropic_reply.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["status"] == "unavailable" and reason in health.json()["reason"]
