"""KV budgets and bad input at a stage: typed errors, freed KV, and a stage that keeps serving."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import trio

from meshd.client.ask import AskRequest, AskResult, RouteError, Stage, check_route, run_session
from meshd.net.link import Stream
from meshd.net.peers import Peers, PeersConfig, open_peers
from meshd.stage.service import StageLimits, StageNode, stage_node
from wire.codec import ErrorMessage, Message
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.stage import (
    STAGE_PROTOCOL,
    Cancel,
    Describe,
    Hop,
    Open,
    Opened,
    PeerRef,
    StageInfo,
)
from wire.tensors import Activation, TensorEntry

# every ask ends within this (a bound against hangs, not a speed claim)
ASK_DEADLINE = 60


@asynccontextmanager
async def stage(model: Path, layers: tuple[int, int] | None, **limits: float) -> AsyncIterator[StageNode]:
    lim = StageLimits(**({"max_sessions": 4, "max_session_tokens": 256} | limits))
    async with stage_node(model, layers, lim, NodeIdentity.generate(), PeersConfig(drain_timeout=0.5), threads=1) as node:
        yield node


@pytest.fixture
async def asker() -> AsyncIterator[Peers]:
    async with open_peers(NodeIdentity.generate()) as peers:
        yield peers


async def info_of(peers: Peers, node: StageNode) -> StageInfo:
    s = await peers.open_stream(node.address, STAGE_PROTOCOL)
    async with s:
        await s.send_message(Describe())
        reply = await s.receive_message()
    assert isinstance(reply, StageInfo)
    return reply


async def open_session(peers: Peers, node: StageNode, session: str, epoch: int = 0,
                       digest: str | None = None) -> tuple[Stream, Message]:
    info = await info_of(peers, node)
    s = await peers.open_stream(node.address, STAGE_PROTOCOL)
    here = PeerRef(address=node.address)
    await s.send_message(Open(session=session, epoch=epoch, model_digest=digest or info.model_digest,
                              layer_begin=info.layer_begin, layer_end=info.layer_end,
                              next=None if info.layer_end == info.n_layer else here,
                              head=here if info.layer_end == info.n_layer else None, max_tokens=4))
    try:
        reply = await s.receive_message()
    except ProtocolError as exc:
        return s, ErrorMessage(code=exc.code, message=exc.message, retry_after_ms=exc.retry_after_ms)
    return s, reply


async def next_error(s: Stream) -> ProtocolError:
    with trio.fail_after(10):
        while True:
            try:
                msg = await s.receive_message()
            except ProtocolError as exc:
                return exc
            if isinstance(msg, ErrorMessage):
                return ProtocolError(msg.code, msg.message, msg.retry_after_ms)


async def test_idle_session_expires_and_frees_its_kv(default_model: Path, asker: Peers) -> None:
    async with stage(default_model, None, ttl=0.5) as node:
        s, reply = await open_session(asker, node, "a")
        assert isinstance(reply, Opened)
        err = await next_error(s)
        assert err.code == ErrorCode.CACHE_MISS and "expired" in err.message
        m = node.service.metric_values()
        assert (m["sessions"], m["kv_tokens"], m["expirations"]) == (0.0, 0.0, 1.0)


async def test_least_recently_used_idle_session_is_evicted_for_a_new_one(default_model: Path, asker: Peers) -> None:
    async with stage(default_model, None, max_sessions=2, evict_after=0.2) as node:
        a, _ = await open_session(asker, node, "a")
        await trio.sleep(0.05)
        b, _ = await open_session(asker, node, "b")
        await trio.sleep(0.3)
        c, reply = await open_session(asker, node, "c")
        assert isinstance(reply, Opened)
        err = await next_error(a)
        assert err.code == ErrorCode.CACHE_MISS and "evicted" in err.message
        assert set(node.service.sessions) == {"b", "c"}
        assert node.service.metric_values()["evictions"] == 1.0


async def test_session_beyond_the_budget_is_overloaded_with_a_retry_hint(default_model: Path, asker: Peers) -> None:
    async with stage(default_model, None, max_sessions=2, evict_after=60.0) as node:
        await open_session(asker, node, "a")
        await open_session(asker, node, "b")
        _, reply = await open_session(asker, node, "c")
        assert isinstance(reply, ErrorMessage)
        assert reply.code == ErrorCode.OVERLOADED and reply.retry_after_ms and reply.retry_after_ms > 0
        # a session that fits still runs to the end
        route = [Stage(node.address, await info_of(asker, node))]
        node.service.limits = StageLimits(max_sessions=2, max_session_tokens=256, evict_after=0.0)
        with trio.fail_after(ASK_DEADLINE):
            result = await run_session(asker, route, AskRequest(text="The sky is", max_tokens=5), AskResult())
        assert len(result.tokens) == 5


async def test_prompt_longer_than_the_session_budget_is_overloaded(default_model: Path, asker: Peers) -> None:
    async with stage(default_model, None, max_session_tokens=16) as node:
        route = [Stage(node.address, await info_of(asker, node))]
        with pytest.raises(ProtocolError) as err, trio.fail_after(ASK_DEADLINE):
            await run_session(asker, route, AskRequest(text="word " * 40, max_tokens=4), AskResult())
        assert err.value.code == ErrorCode.OVERLOADED
        assert node.service.metric_values()["sessions"] == 0.0


async def test_stale_epoch_is_refused(default_model: Path, asker: Peers) -> None:
    async with stage(default_model, None) as node:
        _, first = await open_session(asker, node, "s", epoch=3)
        assert isinstance(first, Opened)
        _, reply = await open_session(asker, node, "s", epoch=2)
        assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.EPOCH_STALE


async def test_other_model_digest_is_refused(default_model: Path, asker: Peers) -> None:
    async with stage(default_model, None) as node:
        _, reply = await open_session(asker, node, "s", digest="f" * 64)
        assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.MODEL_MISMATCH


async def test_hop_for_unknown_session_is_not_found(default_model: Path, asker: Peers) -> None:
    async with stage(default_model, (10, 20)) as node:
        s = await asker.open_stream(node.address, STAGE_PROTOCOL)
        await s.send_message(Hop(session="nobody", epoch=0, prompt_tokens=3))
        err = await next_error(s)
        assert err.code == ErrorCode.NOT_FOUND


async def middle_session(asker: Peers, node: StageNode) -> tuple[Stream, Stream]:
    control, reply = await open_session(asker, node, "m")
    assert isinstance(reply, Opened)
    hop = await asker.open_stream(node.address, STAGE_PROTOCOL)
    await hop.send_message(Hop(session="m", epoch=0, prompt_tokens=4))
    return control, hop


def activation(pos: int, rows: int, width: int = 576) -> Activation:
    hidden = np.random.default_rng(pos).standard_normal((rows, width)).astype(np.float32)
    return Activation(session="m", epoch=0, step=0, pos=pos, n_tokens=rows,
                      tensors=[TensorEntry.from_array("hidden_states", hidden)])


async def test_position_gap_is_a_cache_miss(default_model: Path, asker: Peers) -> None:
    async with stage(default_model, (10, 20)) as node:
        control, hop = await middle_session(asker, node)
        await hop.send_message(activation(pos=3, rows=2))
        err = await next_error(control)
        assert err.code == ErrorCode.CACHE_MISS and "position 3" in err.message
        assert node.service.metric_values()["sessions"] == 0.0


async def test_residual_of_wrong_width_is_refused_and_stage_keeps_serving(default_model: Path, asker: Peers) -> None:
    async with stage(default_model, (10, 20)) as node:
        control, hop = await middle_session(asker, node)
        await hop.send_message(activation(pos=0, rows=2, width=100))
        err = await next_error(control)
        assert err.code == ErrorCode.BAD_REQUEST and "(2, 576)" in err.message
        # the stage takes the next session as if nothing happened
        _, reply = await open_session(asker, node, "next")
        assert isinstance(reply, Opened)


async def test_unknown_first_message_resets_only_that_stream(default_model: Path, asker: Peers) -> None:
    async with stage(default_model, None) as node:
        s = await asker.open_stream(node.address, STAGE_PROTOCOL)
        await s.send_message(Cancel(session="x", epoch=0))
        err = await next_error(s)
        assert err.code == ErrorCode.BAD_REQUEST
        assert isinstance(await info_of(asker, node), StageInfo)


def fake_stage(address: str, begin: int, end: int, digest: str = "d" * 64, n_layer: int = 30) -> Stage:
    return Stage(address, StageInfo(node_id="n", model_digest=digest, model_name="m", layer_begin=begin,
                                    layer_end=end, n_layer=n_layer, n_embd=576, ready=True))


@pytest.mark.parametrize(("ranges", "message"), [
    ([(0, 10), (12, 30)], r"leaves layers \[10, 12\) uncovered"),
    ([(0, 10), (10, 20)], r"leaves layers \[20, 30\) uncovered"),
    ([(5, 30)], r"leaves layers \[0, 5\) uncovered"),
    ([(0, 15), (10, 30)], r"layers \[10, 15\) are covered twice"),
])
def test_route_with_gap_or_overlap_is_refused(ranges: list[tuple[int, int]], message: str) -> None:
    with pytest.raises(RouteError, match=message):
        check_route([fake_stage(f"h:{i}", a, b) for i, (a, b) in enumerate(ranges)])


def test_route_of_different_model_files_is_refused() -> None:
    with pytest.raises(RouteError, match="different model files"):
        check_route([fake_stage("h:1", 0, 15, "a" * 64), fake_stage("h:2", 15, 30, "b" * 64)])
