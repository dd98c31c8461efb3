"""KV budgets and bad input at a stage: typed errors, freed KV (read from llama.cpp), and a stage that keeps serving.

The stages of the default limits that several tests open sessions on (the whole model, the head, a middle
stage) are the module's, held on a loop of their own (tests/hosted.py): a test begins once the stage holds
none of an earlier one's sessions (their asker gone, each was released).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from attacks import typed_error
from hosted import Hosted, hosted, together

from meshd.client.ask import AskRequest, AskResult, RouteError
from meshd.client.route import Stage, check_opened, check_route, route_from_reply
from meshd.client.session import run_session
from meshd.net.peers import Peers, PeersConfig, open_peers
from meshd.net.stream import Stream
from meshd.stage.books import StageLimits
from meshd.stage.node import StageNode, stage_node
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.meshrpc import RouteReply, RouteStage
from wire.message import ErrorMessage, Message
from wire.stage import (
    STAGE_PROTOCOL,
    Cancel,
    Done,
    Hop,
    Open,
    Opened,
    PeerRef,
    Prompt,
    Released,
    StageInfo,
)
from wire.tensors import Activation, TensorEntry

# stages with engine worker processes
pytestmark = pytest.mark.slow

# every ask ends within this (a bound against hangs, not a speed claim)
ASK_DEADLINE = 60


@asynccontextmanager
async def stage(model: Path, layers: tuple[int, int] | None, **limits: float) -> AsyncIterator[StageNode]:
    lim = StageLimits(**({"max_sessions": 4, "max_session_tokens": 256} | limits))
    async with stage_node(model, layers, lim, NodeIdentity.generate(), PeersConfig(drain_timeout=0.5), threads=1) as node:
        yield node


class Shared:
    """A module's stage, asked by one test: ``node``, and what its books hold, read on its own loop."""

    def __init__(self, host: Hosted[StageNode]) -> None:
        self.host, self.node = host, host.value

    async def sessions(self) -> float:
        async def count() -> float:
            return self.node.service.metric_values()["sessions"]

        return await self.host.run(count)

    async def idle(self) -> Shared:
        """Once the stage holds no session (an earlier test's are released as their asker goes)."""
        with trio.fail_after(20):
            while await self.sessions():
                await trio.sleep(0.02)
        return self


@pytest.fixture(scope="module")
def whole_stage(default_model: Path) -> Iterator[Hosted[StageNode]]:
    with hosted(lambda: stage(default_model, None)) as node:
        yield node


@pytest.fixture(scope="module")
def head_stage(default_model: Path) -> Iterator[Hosted[StageNode]]:
    with hosted(lambda: stage(default_model, (0, 10))) as node:
        yield node


@pytest.fixture(scope="module")
def middle_stage(default_model: Path) -> Iterator[Hosted[StageNode]]:
    with hosted(lambda: stage(default_model, (10, 20))) as node:
        yield node


@pytest.fixture
async def whole(whole_stage: Hosted[StageNode]) -> Shared:
    return await Shared(whole_stage).idle()


@pytest.fixture
async def head(head_stage: Hosted[StageNode]) -> Shared:
    return await Shared(head_stage).idle()


@pytest.fixture
async def middle(middle_stage: Hosted[StageNode]) -> Shared:
    return await Shared(middle_stage).idle()


async def drain(stream: Stream) -> None:
    """A next stage that takes whatever it is sent."""
    with contextlib.suppress(ProtocolError, trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError):
        while True:
            await stream.receive_message()


@dataclass
class Asker:
    peers: Peers
    # the asker listens and stands in as the next stage of a head or middle stage: it drains what it gets
    sink: PeerRef


@pytest.fixture
async def asker() -> AsyncIterator[Asker]:
    async with open_peers(NodeIdentity.generate(), PeersConfig(drain_timeout=0.5)) as peers:
        peers.handle(STAGE_PROTOCOL, drain)
        port = await peers.listen("127.0.0.1", 0)
        yield Asker(peers, PeerRef(address=f"127.0.0.1:{port}", node_id=peers.node_id))


async def open_session(asker: Asker, node: StageNode, session: str, epoch: int = 0, digest: str | None = None,
                       max_tokens: int = 4, **extra: Any) -> tuple[Stream, Message]:
    info = node.service.info()
    s = await asker.peers.open_stream(node.address, STAGE_PROTOCOL)
    tail = info.layer_end == info.n_layer
    await s.send_message(Open(session=session, epoch=epoch, model_digest=digest or info.model_digest,
                              layer_begin=info.layer_begin, layer_end=info.layer_end,
                              next=None if tail else asker.sink,
                              head=asker.sink if tail and info.layer_begin > 0 else None,
                              max_tokens=max_tokens, **extra))
    try:
        reply = await s.receive_message()
    except ProtocolError as exc:
        return s, ErrorMessage(code=exc.code, message=exc.message, retry_after_ms=exc.retry_after_ms)
    return s, reply


async def slot_pos_max(node: StageNode, slot: int) -> int:
    """What llama.cpp's KV holds in a slot's sequence: its last position, -1 for nothing."""
    reply, _ = await node.engine.call({"op": "seq_pos_max", "seq": slot})
    return int(reply["pos_max"])


async def until_freed(node: StageNode, slot: int) -> None:
    with trio.fail_after(10):
        while await slot_pos_max(node, slot) != -1:
            await trio.sleep(0.02)


async def prefilled(node: StageNode, session: str, positions: int | None = None) -> None:
    """Polls until llama.cpp holds ``positions`` of the session (default: its prompt) and none is in flight."""
    book = node.service.sessions[session]
    with trio.fail_after(20):
        while True:
            want = positions if positions is not None else book.prompt_len
            if want is not None and not book.in_flight and await slot_pos_max(node, book.slot) >= want - 1:
                return
            await trio.sleep(0.02)


async def next_message(s: Stream, kind: type[Message]) -> Message:
    with trio.fail_after(20):
        while True:
            msg = await s.receive_message()
            if isinstance(msg, kind | ErrorMessage):
                return msg


async def test_idle_session_expires_and_frees_its_kv(default_model: Path, asker: Asker) -> None:
    async with stage(default_model, None, ttl=1.0) as node:
        s, reply = await open_session(asker, node, "a", max_tokens=1)
        assert isinstance(reply, Opened)
        slot = node.service.sessions["a"].slot
        await s.send_message(Prompt(session="a", epoch=0, text="The capital of France is"))
        assert isinstance(await next_message(s, Done), Done)
        held = await slot_pos_max(node, slot)
        assert held >= 3 and node.service.metric_values()["kv_tokens"] == held + 1
        # it had finished its answer: expiring, it is released without an error
        assert isinstance(await next_message(s, Released), Released)
        m = node.service.metric_values()
        assert (m["sessions"], m["kv_tokens"], m["expirations"]) == (0.0, 0.0, 1.0)
        await until_freed(node, slot)


async def test_least_recently_used_not_oldest_idle_session_is_evicted(default_model: Path, asker: Asker) -> None:
    async with stage(default_model, (0, 10), max_sessions=2, evict_after=0.0) as node:
        a, _ = await open_session(asker, node, "a")
        await a.send_message(Prompt(session="a", epoch=0, text="The sky is"))
        b, _ = await open_session(asker, node, "b")
        await b.send_message(Prompt(session="b", epoch=0, text="Once upon a time"))
        await prefilled(node, "a")
        await prefilled(node, "b")
        slot_a, slot_b = node.service.sessions["a"].slot, node.service.sessions["b"].slot
        # the older session is used again (a token around the ring): now b is the least recently used
        ring = await asker.peers.open_stream(node.address, STAGE_PROTOCOL)
        await ring.send_message(Hop(session="a", epoch=0, ring=True))
        pos = node.service.sessions["a"].next_pos
        await ring.send_message(Activation(session="a", epoch=0, step=1, pos=pos, n_tokens=1, tensors=[], tokens=[42]))
        await prefilled(node, "a", pos + 1)
        assert node.service.sessions["a"].last_used > node.service.sessions["b"].last_used
        c, reply = await open_session(asker, node, "c")
        assert isinstance(reply, Opened)
        err = await typed_error(b, timeout=10)
        assert err.code == ErrorCode.CACHE_MISS and "evicted" in err.message
        assert set(node.service.sessions) == {"a", "c"}
        assert node.service.metric_values()["evictions"] == 1.0
        # read from llama.cpp: b's sequence is empty (c took its slot, fresh), a's is whole
        assert node.service.sessions["c"].slot == slot_b
        await until_freed(node, slot_b)
        assert await slot_pos_max(node, slot_a) == pos


async def test_session_beyond_the_budget_is_overloaded_with_a_retry_hint(default_model: Path, asker: Asker) -> None:
    async with stage(default_model, None, max_sessions=2, evict_after=60.0) as node:
        await open_session(asker, node, "a")
        await open_session(asker, node, "b")
        _, reply = await open_session(asker, node, "c")
        assert isinstance(reply, ErrorMessage)
        assert reply.code == ErrorCode.OVERLOADED and reply.retry_after_ms and reply.retry_after_ms > 0
        # a session that fits still runs to the end
        node.service.books.limits = StageLimits(max_sessions=2, max_session_tokens=256, evict_after=0.0)
        with trio.fail_after(ASK_DEADLINE):
            result = await run_session(asker.peers, [Stage(node.address)], AskRequest(text="The sky is", max_tokens=5),
                                       AskResult())
        assert len(result.tokens) == 5


async def test_prompt_longer_than_the_session_budget_is_refused_naming_the_limit(
        default_model: Path, asker: Asker) -> None:
    async with stage(default_model, None, max_session_tokens=16) as node:
        with pytest.raises(ProtocolError) as err, trio.fail_after(ASK_DEADLINE):
            await run_session(asker.peers, [Stage(node.address)], AskRequest(text="word " * 40, max_tokens=4),
                              AskResult())
        assert err.value.code == ErrorCode.OVERLOADED
        assert "exceeds this stage's session budget of 16 tokens" in err.value.message
        assert "prompt of 4" in err.value.message
        assert node.service.metric_values()["sessions"] == 0.0


async def test_stale_epoch_is_refused(whole: Shared, asker: Asker) -> None:
    node = whole.node
    _, first = await open_session(asker, node, "s", epoch=3)
    assert isinstance(first, Opened)
    _, reply = await open_session(asker, node, "s", epoch=2)
    assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.EPOCH_STALE


async def test_other_model_digest_is_refused(whole: Shared, asker: Asker) -> None:
    node = whole.node
    _, reply = await open_session(asker, node, "s", digest="f" * 64)
    assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.MODEL_MISMATCH


async def test_opened_says_what_the_stage_serves_and_its_next_hop_is_dialled_already(
        head: Shared, asker: Asker) -> None:
    node = head.node
    assert node.peers.link_to(asker.peers.node_id) is None
    _, reply = await open_session(asker, node, "s")
    assert isinstance(reply, Opened)
    assert (reply.info.layer_begin, reply.info.layer_end, reply.info.n_layer) == (0, 10, 30)
    assert reply.info.node_id == node.peers.node_id and reply.info.model_digest == node.service.digest
    # before any prompt, the head holds its link to the next stage
    assert node.peers.link_to(asker.peers.node_id) is not None


async def test_unreachable_next_stage_fails_the_open(head: Shared, asker: Asker, refusing_address: str) -> None:
    node = head.node
    s = await asker.peers.open_stream(node.address, STAGE_PROTOCOL)
    await s.send_message(Open(session="s", epoch=0, next=PeerRef(address=refusing_address)))
    err = await typed_error(s, timeout=10)
    assert err.code == ErrorCode.UNREACHABLE and f"next stage {refusing_address} is unreachable" in err.message
    assert await head.sessions() == 0.0


async def test_open_without_the_next_hop_says_what_the_stage_serves_but_takes_no_prompt(
        head: Shared, asker: Asker) -> None:
    node = head.node
    s = await asker.peers.open_stream(node.address, STAGE_PROTOCOL)
    await s.send_message(Open(session="s", epoch=0))
    reply = await s.receive_message()
    assert isinstance(reply, Opened) and (reply.info.layer_begin, reply.info.layer_end) == (0, 10)
    await s.send_message(Prompt(session="s", epoch=0, text="hello"))
    err = await typed_error(s, timeout=10)
    assert err.code == ErrorCode.BAD_REQUEST and "needs the next stage's address" in err.message


async def test_hop_for_unknown_session_is_not_found(middle: Shared, asker: Asker) -> None:
    node = middle.node
    s = await asker.peers.open_stream(node.address, STAGE_PROTOCOL)
    await s.send_message(Hop(session="nobody", epoch=0, prompt_tokens=3))
    err = await typed_error(s, timeout=10)
    assert err.code == ErrorCode.NOT_FOUND


async def middle_session(asker: Asker, node: StageNode, **extra: Any) -> tuple[Stream, Stream]:
    control, reply = await open_session(asker, node, "m", **extra)
    assert isinstance(reply, Opened)
    hop = await asker.peers.open_stream(node.address, STAGE_PROTOCOL)
    await hop.send_message(Hop(session="m", epoch=0, prompt_tokens=4))
    return control, hop


def activation(pos: int, rows: int, width: int = 576, **tensor: Any) -> Activation:
    hidden = np.random.default_rng(pos).standard_normal((rows, width)).astype(np.float32)
    return Activation(session="m", epoch=0, step=0, pos=pos, n_tokens=rows,
                      tensors=[TensorEntry.from_array("hidden_states", hidden, **tensor)])


async def test_position_gap_is_a_cache_miss(middle: Shared, asker: Asker) -> None:
    node = middle.node
    control, hop = await middle_session(asker, node)
    await hop.send_message(activation(pos=3, rows=2))
    err = await typed_error(control, timeout=10)
    assert err.code == ErrorCode.CACHE_MISS and "position 3" in err.message
    assert await middle.sessions() == 0.0


async def test_residual_of_wrong_width_is_refused_and_stage_keeps_serving(middle: Shared, asker: Asker) -> None:
    node = middle.node
    control, hop = await middle_session(asker, node)
    await hop.send_message(activation(pos=0, rows=2, width=100))
    err = await typed_error(control, timeout=10)
    assert err.code == ErrorCode.BAD_REQUEST and "(2, 576)" in err.message
    # the stage takes the next session as if nothing happened
    _, reply = await open_session(asker, node, "next")
    assert isinstance(reply, Opened)


@pytest.mark.parametrize(("negotiated", "sent"), [
    ({"wire_dtype": "q8_0"}, {"dtype": "f16"}),
    ({"wire_dtype": "f16"}, {"dtype": "f16", "codec": "zstd"}),
    ({"wire_codec": "zstd"}, {}),
])
async def test_hidden_states_not_as_negotiated_at_open_are_refused(
        middle: Shared, asker: Asker, negotiated: dict[str, str], sent: dict[str, str]) -> None:
    node = middle.node
    control, hop = await middle_session(asker, node, **negotiated)
    await hop.send_message(activation(pos=0, rows=2, **sent))
    err = await typed_error(control, timeout=10)
    assert err.code == ErrorCode.BAD_REQUEST and "this session travels as" in err.message


async def test_rows_beyond_the_session_budget_are_refused_before_decoding(default_model: Path, asker: Asker) -> None:
    async with stage(default_model, (10, 20), max_session_tokens=64) as node:
        control, hop = await middle_session(asker, node)
        await hop.send_message(activation(pos=0, rows=65))
        err = await typed_error(control, timeout=10)
        assert err.code == ErrorCode.OVERLOADED and "session budget is 64" in err.message


async def test_unknown_first_message_resets_only_that_stream(whole: Shared, asker: Asker) -> None:
    node = whole.node
    s = await asker.peers.open_stream(node.address, STAGE_PROTOCOL)
    await s.send_message(Cancel(session="x", epoch=0))
    err = await typed_error(s, timeout=10)
    assert err.code == ErrorCode.BAD_REQUEST
    _, reply = await open_session(asker, node, "after")
    assert isinstance(reply, Opened)


def fake_info(begin: int, end: int, digest: str = "d" * 64, n_layer: int = 30) -> StageInfo:
    return StageInfo(node_id="n", model_digest=digest, model_name="m", layer_begin=begin, layer_end=end,
                     n_layer=n_layer, stage_width=576, ready=True)


@pytest.mark.parametrize(("ranges", "message"), [
    ([(0, 10), (12, 30)], r"leaves layers \[10, 12\) uncovered"),
    ([(0, 10), (10, 20)], r"leaves layers \[20, 30\) uncovered"),
    ([(5, 30)], r"leaves layers \[0, 5\) uncovered"),
    ([(0, 15), (10, 30)], r"layers \[10, 15\) are covered twice"),
])
def test_route_with_gap_or_overlap_is_refused(ranges: list[tuple[int, int]], message: str) -> None:
    with pytest.raises(RouteError, match=message):
        check_route([Stage(f"h:{i}") for i in range(len(ranges))], [fake_info(a, b) for a, b in ranges])


def test_route_of_different_model_files_is_refused() -> None:
    with pytest.raises(RouteError, match="different model files"):
        check_route([Stage("h:1"), Stage("h:2")], [fake_info(0, 15, "a" * 64), fake_info(15, 30, "b" * 64)])


def test_a_planned_route_is_opened_with_what_it_expects_and_a_stage_serving_otherwise_is_refused() -> None:
    reply = RouteReply(model="d" * 64, n_layers=30, seconds_per_token=0.1, stages=[
        RouteStage(node_id="n1", address="h:1", start=0, end=12), RouteStage(node_id="n2", address="h:2", start=12,
                                                                                end=30)])
    route = route_from_reply(reply)
    assert route == [Stage("h:1", "n1", "d" * 64, (0, 12)), Stage("h:2", "n2", "d" * 64, (12, 30))]
    check_opened(route[0], fake_info(0, 12).model_copy(update={"node_id": "n1"}))
    with pytest.raises(ProtocolError) as other_model:
        check_opened(route[0], fake_info(0, 12, "e" * 64).model_copy(update={"node_id": "n1"}))
    assert other_model.value.code is ErrorCode.MODEL_MISMATCH
    with pytest.raises(ProtocolError, match=r"serves layers \[0, 10\), the route has \[0, 12\)"):
        check_opened(route[0], fake_info(0, 10).model_copy(update={"node_id": "n1"}))
    with pytest.raises(ProtocolError, match="says it is node"):
        check_opened(route[0], fake_info(0, 12))


async def test_a_route_that_does_not_cover_the_model_is_refused_after_opening_and_released(
        default_model: Path, asker: Asker) -> None:
    async with together([stage(default_model, (0, 10)), stage(default_model, (20, 30))]) as (head, tail):
        with pytest.raises(RouteError, match=r"leaves layers \[10, 20\) uncovered"), trio.fail_after(ASK_DEADLINE):
            await run_session(asker.peers, [Stage(head.address), Stage(tail.address)],
                              AskRequest(text="The sky is", max_tokens=4), AskResult())
        for node in (head, tail):
            assert node.service.metric_values()["sessions"] == 0.0
