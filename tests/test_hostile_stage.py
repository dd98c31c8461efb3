"""Hostile bytes against real `meshd serve` stages: typed errors, bounded memory, a worker that lives.

A stranger who knows a stage's address opens a session and sends what an
honest stage never would: an activation whose few compressed bytes claim far
more rows than the session may hold, and a prompt far beyond the session's
budget. Each costs the stage a typed error and nothing else: its peak resident
memory (VmHWM, so a spike freed again still counts) grows by less than 64 MiB,
its engine worker keeps its PID, and an honest ask answers the same greedy
tokens before and after.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator

import crc32c
import pytest
import trio
import zstandard
from attacks import typed_error
from localmesh import Served, start_serve

from meshd.client.ask import AskRequest, AskResult
from meshd.client.route import route_at
from meshd.client.session import run_session
from meshd.net.peers import Peers, open_peers
from meshd.net.stream import Stream
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.stage import (
    PREFIX_BLOCK,
    STAGE_PROTOCOL,
    CacheLookup,
    CacheUse,
    ChatMessage,
    Hop,
    Metrics,
    MetricsRequest,
    Open,
    Opened,
    PeerRef,
    Prompt,
    PromptTokens,
    prefix_keys,
)
from wire.tensors import Activation, TensorEntry, wire_size

# a stage with its engine worker process
pytestmark = pytest.mark.slow

SESSION_TOKENS = 2048
N_EMBD = 576
HONEST = AskRequest(text="The three primary colours are", max_tokens=12)
MiB = 1 << 20


@pytest.fixture(scope="module")
def stages() -> Iterator[list[Served]]:
    served: list[Served] = []
    try:
        for layers in ("0:10", "10:30"):
            served.append(start_serve("--layers", layers, "--threads", "1", "--max-sessions", "4",
                                      "--session-tokens", str(SESSION_TOKENS)))
        yield served
    finally:
        for s in served:
            s.stop()


async def drain(stream: Stream) -> None:
    with contextlib.suppress(ProtocolError, trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError):
        while True:
            await stream.receive_message()


@pytest.fixture
async def stranger() -> AsyncIterator[tuple[Peers, PeerRef]]:
    """A peer with no model, listening so a stage can dial it as its next hop (it drains what it gets)."""
    async with open_peers(NodeIdentity.generate()) as peers:
        peers.handle(STAGE_PROTOCOL, drain)
        port = await peers.listen("127.0.0.1", 0)
        yield peers, PeerRef(address=f"127.0.0.1:{port}", node_id=peers.node_id)


def status_kib(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status").read().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


async def honest(peers: Peers, stages: list[Served]) -> list[int]:
    with trio.fail_after(120):
        result = await run_session(peers, route_at([s.address for s in stages]), HONEST, AskResult())
    assert len(result.tokens) == HONEST.max_tokens
    return result.tokens


async def worker_restarts(peers: Peers, stage: Served) -> float:
    with trio.fail_after(10):
        stream = await peers.open_stream(stage.address, STAGE_PROTOCOL)
        async with stream:
            await stream.send_message(MetricsRequest())
            reply = await stream.receive_message()
    assert isinstance(reply, Metrics)
    return reply.values["worker_restarts"]


def claimed_rows_bomb(rows: int) -> TensorEntry:
    """q8_0 zeros for ``rows`` × N_EMBD, zstd-compressed: a couple of KB that decode to hundreds of MB."""
    raw = bytes(wire_size("q8_0", rows * N_EMBD))
    data = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(raw)
    return TensorEntry(name="hidden_states", dtype="q8_0", shape=[rows, N_EMBD], codec="zstd",
                       crc32c=crc32c.crc32c(data), data=data)


async def test_a_tiny_activation_claiming_100k_rows_is_refused_before_it_is_decoded(
        stages: list[Served], stranger: tuple[Peers, PeerRef]) -> None:
    peers, sink = stranger
    tail = stages[1]
    before = await honest(peers, stages)
    bomb = claimed_rows_bomb(100_000)
    assert len(bomb.data) < 16 << 10
    hwm, rss = status_kib(tail.proc.pid, "VmHWM"), status_kib(tail.proc.pid, "VmRSS")

    control = await peers.open_stream(tail.address, STAGE_PROTOCOL)
    await control.send_message(Open(session="bomb", epoch=0, head=sink, wire_dtype="q8_0", wire_codec="zstd"))
    assert isinstance(await control.receive_message(), Opened)
    hop = await peers.open_stream(tail.address, STAGE_PROTOCOL)
    await hop.send_message(Hop(session="bomb", epoch=0, prompt_tokens=4))
    await hop.send_message(Activation(session="bomb", epoch=0, step=0, pos=0, n_tokens=100_000, tensors=[bomb]))
    err = await typed_error(control)
    assert err.code == ErrorCode.OVERLOADED
    assert f"session budget is {SESSION_TOKENS}" in err.message

    grew_peak = (status_kib(tail.proc.pid, "VmHWM") - hwm) * 1024
    grew = (status_kib(tail.proc.pid, "VmRSS") - rss) * 1024
    print(f"stage peak RSS grew {grew_peak / MiB:.1f} MiB, RSS {grew / MiB:.1f} MiB on a {len(bomb.data)}-byte bomb")
    assert grew_peak < 64 * MiB and grew < 64 * MiB
    assert await honest(peers, stages) == before


async def test_a_prompt_of_16_8_mb_is_a_typed_error_and_the_engine_worker_lives(
        stages: list[Served], stranger: tuple[Peers, PeerRef]) -> None:
    peers, sink = stranger
    head = stages[0]
    before = await honest(peers, stages)
    control = await peers.open_stream(head.address, STAGE_PROTOCOL)
    await control.send_message(Open(session="huge", epoch=0, next=sink))
    assert isinstance(await control.receive_message(), Opened)
    # 256 chat messages of 65,535 characters: each string within the decoder's limit, 16.8 MB in all
    content = "x" * 65_535
    prompt = Prompt(session="huge", epoch=0, messages=[ChatMessage(role="user", content=content)] * 256)
    with contextlib.suppress(ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
        await control.send_message(prompt)
    err = await typed_error(control)
    print(f"16.8 MB prompt: {err.code.value}: {err.message}")
    if err.code == ErrorCode.OVERLOADED:
        assert f"session budget of {SESSION_TOKENS} tokens" in err.message
    else:
        # refused by the decoder before the stage saw it: still typed
        assert err.code == ErrorCode.BAD_REQUEST
    os.kill(head.worker_pid, 0)
    assert await worker_restarts(peers, head) == 0.0
    assert await honest(peers, stages) == before
    os.kill(head.worker_pid, 0)
    assert await worker_restarts(peers, head) == 0.0


async def test_the_prefix_cache_takes_no_start_a_stage_did_not_find_and_no_more_keys_than_a_session(
        stages: list[Served], stranger: tuple[Peers, PeerRef]) -> None:
    peers, sink = stranger
    head, tail = stages
    before = await honest(peers, stages)
    # a head told its rows begin past anything it found of the prompt
    control = await peers.open_stream(head.address, STAGE_PROTOCOL)
    await control.send_message(Open(session="start", epoch=0, next=sink))
    assert isinstance(await control.receive_message(), Opened)
    await control.send_message(Prompt(session="start", epoch=0, text="x " * 200, cache=True))
    assert isinstance(await control.receive_message(), PromptTokens)
    await control.send_message(CacheUse(session="start", epoch=0, tokens=96))
    err = await typed_error(control)
    assert err.code == ErrorCode.CACHE_MISS and "found 0 positions" in err.message
    # a stage after it whose upstream says so (the upstream is who the opener named: a stranger here)
    control = await peers.open_stream(tail.address, STAGE_PROTOCOL)
    await control.send_message(Open(session="hop", epoch=0, head=sink))
    assert isinstance(await control.receive_message(), Opened)
    hop = await peers.open_stream(tail.address, STAGE_PROTOCOL)
    await hop.send_message(Hop(session="hop", epoch=0, prompt_tokens=200, start=128))
    err = await typed_error(control)
    assert err.code == ErrorCode.CACHE_MISS
    # keys for more positions than a session may hold
    control = await peers.open_stream(tail.address, STAGE_PROTOCOL)
    await control.send_message(Open(session="keys", epoch=0, head=sink))
    assert isinstance(await control.receive_message(), Opened)
    keys = prefix_keys(list(range(SESSION_TOKENS + PREFIX_BLOCK)))
    await control.send_message(CacheLookup(session="keys", epoch=0, keys=keys))
    err = await typed_error(control)
    assert err.code == ErrorCode.BAD_REQUEST and "prefix keys exceed" in err.message
    for stage in stages:
        assert await worker_restarts(peers, stage) == 0.0
    assert await honest(peers, stages) == before
