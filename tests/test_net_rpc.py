"""One request, one reply: typed errors for every way an exchange can fail."""

from __future__ import annotations

import functools

import pytest
import trio
import trio.testing
from memory_transport import memory_transport_pair
from test_net_link import ALICE, BOB, CALM, link_pair

from meshd.net import rpc
from meshd.net.peers import PeersConfig, open_peers
from meshd.net.stream import Stream
from relay.protocol import Accepted, Connect, Connected
from wire.errors import ErrorCode, ProtocolError
from wire.message import ErrorMessage


async def test_a_reply_of_the_expected_type_is_returned() -> None:
    async with link_pair() as pair:
        mine, theirs = await pair.stream_pair()
        async with trio.open_nursery() as nursery:

            async def answer() -> None:
                got = await rpc.receive(theirs, Connect, "a connect")
                assert got.target == "t"
                await theirs.send_message(Connected())

            nursery.start_soon(answer)
            reply = await rpc.request(mine, Connect(target="t"), Connected, "connecting", timeout=5)
        assert isinstance(reply, Connected)


@pytest.mark.parametrize(
    "answer, code, says",
    [
        (ErrorMessage(code=ErrorCode.OVERLOADED, message="full", retry_after_ms=300), ErrorCode.OVERLOADED, "full"),
        (Accepted(), ErrorCode.BAD_REQUEST, "expected 'relay_connected', got 'relay_accepted'"),
        (None, ErrorCode.UNREACHABLE, "ended the stream without answering"),
    ],
)
async def test_an_error_reply_a_wrong_type_and_no_reply_are_typed_errors(
    answer: ErrorMessage | Accepted | None, code: ErrorCode, says: str
) -> None:
    async with link_pair() as pair:
        mine, theirs = await pair.stream_pair()
        if answer is not None:
            await theirs.send_message(answer)
        await theirs.send_eof()
        with trio.fail_after(5), pytest.raises(ProtocolError) as failed:
            await rpc.request(mine, Connect(target="t"), Connected, "connecting")
        assert failed.value.code is code and says in failed.value.message
        if code is ErrorCode.OVERLOADED:
            assert failed.value.retry_after_ms == 300


async def test_a_lost_link_is_unreachable() -> None:
    async with link_pair() as pair:
        mine, _ = await pair.stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pair.bob.aclose)
            with trio.fail_after(5), pytest.raises(ProtocolError) as lost:
                await rpc.request(mine, Connect(target="t"), Connected, "connecting")
        assert lost.value.code is ErrorCode.UNREACHABLE and lost.value.retryable


async def test_its_own_deadline_is_deadline_exceeded_an_enclosing_one_stays_a_cancellation(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with link_pair() as pair:
        mine, _ = await pair.stream_pair()
        start = trio.current_time()
        with pytest.raises(ProtocolError) as slow:
            await rpc.request(mine, Connect(target="t"), Connected, "connecting", timeout=3.0)
        assert slow.value.code is ErrorCode.DEADLINE_EXCEEDED and "connecting" in slow.value.message
        assert trio.current_time() - start == pytest.approx(3.0)
        with trio.move_on_after(1.0) as outer:
            await rpc.receive(mine, Connected, "waiting", timeout=3.0)
        assert outer.cancelled_caught


async def test_call_opens_a_stream_asks_once_and_closes_it() -> None:
    handled: list[Stream] = []

    async def serve(stream: Stream) -> None:
        handled.append(stream)
        await rpc.receive(stream, Connect, "a connect")
        await stream.send_message(Connected())

    config = PeersConfig(timings=CALM, drain_timeout=0.1)
    a_end, b_end = memory_transport_pair()
    async with open_peers(ALICE, config) as alice, open_peers(BOB, config) as bob:
        bob.handle("test", serve)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(bob.attach, b_end, dialer=False))
            await alice.attach(a_end, dialer=True, node_id=BOB.node_id)
        with trio.fail_after(5):
            reply = await rpc.call(alice, None, "test", Connect(target="t"), Connected,
                                   node_id=BOB.node_id, timeout=5)
            assert isinstance(reply, Connected)
            with pytest.raises(ProtocolError) as nobody:
                await rpc.call(alice, None, "test", Connect(target="t"), Connected,
                               node_id="someone else", timeout=5)
        assert nobody.value.code is ErrorCode.UNREACHABLE
        [link] = alice.links
        assert len(handled) == 1 and link.core.mux.stream_count == 0
