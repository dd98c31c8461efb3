"""The trio link shell: its streams keep trio's stream contract, its timers follow the core's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from memory_transport import MemoryTransport, memory_transport_pair

from meshd.net.link import Link, LinkTimings
from meshd.net.stream import Stream, StreamBroken, StreamClosed
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.link import SecureLink
from wire.message import LENGTH_PREFIX, ErrorMessage, Message, encode, error_message
from wire.mux_config import MuxConfig

ALICE = NodeIdentity.from_private_bytes(b"a" * 32)
BOB = NodeIdentity.from_private_bytes(b"b" * 32)

# Keepalives slowed down so that they cannot mask a lost wake-up.
CALM = LinkTimings(keepalive_interval=300, dead_after=900)
# A window this small is full after one send, which trio's checks call "clogged".
SMALL_WINDOW = 1024


class LinkPair:
    """ALICE's and BOB's ends of one running link; BOB's accepted streams queue up."""

    def __init__(self, alice: Link, bob: Link, accepted: trio.MemoryReceiveChannel[Stream]) -> None:
        self.alice = alice
        self.bob = bob
        self._accepted = accepted

    async def stream_pair(self) -> tuple[Stream, Stream]:
        mine = self.alice.open_stream("test")
        with trio.fail_after(5):
            theirs = await self._accepted.receive()
        return mine, theirs


@asynccontextmanager
async def link_pair(
    timings: LinkTimings = CALM,
    mux: MuxConfig | None = None,
    transports: tuple[MemoryTransport, MemoryTransport] | None = None,
) -> AsyncIterator[LinkPair]:
    a_end, b_end = transports or memory_transport_pair()
    send, accepted = trio.open_memory_channel[Stream](64)
    alice = Link(SecureLink(ALICE, dialer=True, mux_config=mux), a_end, timings=timings)
    bob = Link(
        SecureLink(BOB, dialer=False, mux_config=mux), b_end, timings=timings, on_stream=send.send_nowait
    )
    async with trio.open_nursery() as nursery:
        with trio.fail_after(5):
            async with trio.open_nursery() as handshakes:
                handshakes.start_soon(alice.handshake)
                handshakes.start_soon(bob.handshake)
        nursery.start_soon(alice.run)
        nursery.start_soon(bob.run)
        yield LinkPair(alice, bob, accepted)
        nursery.cancel_scope.cancel()


async def test_streams_pass_trios_half_closeable_stream_checks() -> None:
    async with link_pair() as roomy, link_pair(mux=MuxConfig(stream_window=SMALL_WINDOW)) as tight:

        async def clogged() -> tuple[Stream, Stream]:
            mine, theirs = await tight.stream_pair()
            # Spend each direction's whole credit: the next send waits for the reader.
            await mine.send_all(b"x" * SMALL_WINDOW)
            await theirs.send_all(b"x" * SMALL_WINDOW)
            return mine, theirs

        with trio.fail_after(60):
            await trio.testing.check_half_closeable_stream(roomy.stream_pair, clogged)


async def test_a_lost_link_and_a_local_close_are_protocol_errors_and_trio_errors() -> None:
    async with link_pair() as pair:
        mine, _ = await pair.stream_pair()
        await mine.aclose()
        with pytest.raises(StreamClosed) as closed:
            await mine.send_all(b"late")
        assert isinstance(closed.value, trio.ClosedResourceError)
        assert isinstance(closed.value, ProtocolError)
        _, other = await pair.stream_pair()
        await pair.alice.aclose()
        with pytest.raises(StreamBroken) as broken:
            await other.send_all(b"to nobody")
        assert broken.value.code is ErrorCode.UNREACHABLE and broken.value.retryable
        assert isinstance(broken.value, trio.BrokenResourceError)
        with pytest.raises(ProtocolError, match=r"^UNREACHABLE: link closed$"):
            pair.alice.open_stream("test")


async def test_the_peers_reset_reaches_the_sender_with_its_code() -> None:
    async with link_pair() as pair:
        mine, theirs = await pair.stream_pair()
        theirs.reset(ProtocolError(ErrorCode.OVERLOADED, "too busy"))
        with trio.fail_after(5), pytest.raises(ProtocolError) as refused:
            while True:
                await mine.send_all(b"x")
        assert refused.value.code is ErrorCode.OVERLOADED and refused.value.message == "too busy"
        assert isinstance(refused.value, trio.BrokenResourceError)


async def test_send_nowait_sends_only_what_the_credit_covers_whole_and_in_order() -> None:
    async with link_pair(mux=MuxConfig(stream_window=SMALL_WINDOW)) as pair:
        mine, theirs = await pair.stream_pair()
        assert mine.send_nowait(b"a" * 600)
        # the rest of the credit does not cover this one whole: refused, nothing of it sent
        assert not mine.send_nowait(b"b" * 600)
        assert mine.send_nowait(b"c" * 400)
        got = b""
        with trio.fail_after(5):
            while len(got) < 1000:
                got += await theirs.receive_some()
        assert got == b"a" * 600 + b"c" * 400
        assert not mine.send_nowait(b"")
        theirs.reset(ProtocolError(ErrorCode.OVERLOADED, "too busy"))
        with trio.fail_after(5):
            while mine.send_nowait(b"x"):
                await trio.sleep(0)
        # refused once broken: the awaiting send says why
        with pytest.raises(StreamBroken) as broken:
            await mine.send_all(b"x")
        assert broken.value.code is ErrorCode.OVERLOADED


async def test_an_outlet_writes_in_order_whether_its_task_or_send_nowait_writes() -> None:
    from meshd.stage.outlet import Outlet

    async with link_pair(mux=MuxConfig(stream_window=SMALL_WINDOW)) as pair:
        mine, theirs = await pair.stream_pair()
        outlet: Outlet[bytes] = Outlet(bytes)
        # before the task attaches the stream, everything waits for it
        outlet.send_nowait(b"1" * 100)
        outlet.send_nowait(b"2" * 100)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outlet.run, mine)
            await trio.testing.wait_all_tasks_blocked()
            assert outlet.stream is mine
            # straight onto the stream; then one over the credit goes to the task, and what
            # follows it waits behind it even though it would fit
            outlet.send_nowait(b"3" * 100)
            outlet.send_nowait(b"4" * 900)
            outlet.send_nowait(b"5" * 10)
            got = b""
            with trio.fail_after(5):
                while len(got) < 1210:
                    got += await theirs.receive_some()
            assert got == b"1" * 100 + b"2" * 100 + b"3" * 100 + b"4" * 900 + b"5" * 10
            nursery.cancel_scope.cancel()
        assert outlet.stream is None


def _note(text: str) -> ErrorMessage:
    return error_message(ProtocolError(ErrorCode.CANCELLED, text))


async def test_a_message_hook_takes_messages_as_they_come_and_leaves_the_rest_to_the_reader_in_order() -> None:
    async with link_pair() as pair:
        mine, theirs = await pair.stream_pair()
        taken: list[str] = []

        def hook(message: Message) -> bool:
            assert isinstance(message, ErrorMessage)
            if message.message == "bad":
                raise ProtocolError(ErrorCode.EPOCH_STALE, "the hook refused it")
            if message.message.startswith("take"):
                taken.append(message.message)
                return True
            return False

        theirs.set_message_hook(hook)
        got: list[Message] = []
        async with trio.open_nursery() as nursery:

            async def read() -> None:
                got.append(await theirs.receive_message())

            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            await mine.send_all(encode(_note("take 1")) + encode(_note("take 2")))
            await mine.send_all(encode(_note("take 3")))
            with trio.fail_after(5):
                while len(taken) < 3:
                    await trio.sleep(0)
            # split across two records: the hook gets it whole
            second = encode(_note("take 4"))
            await mine.send_all(second[:5])
            await trio.testing.wait_all_tasks_blocked()
            await mine.send_all(second[5:])
            await mine.send_all(encode(_note("for the reader")))
        assert taken == ["take 1", "take 2", "take 3", "take 4"]
        assert isinstance(got[0], ErrorMessage) and got[0].message == "for the reader"
        assert theirs.messages_received == 5

        async def read_after(data: bytes) -> BaseException:
            # the reader waits first, so the hook sees the message
            async with trio.open_nursery() as nursery:
                failed: list[BaseException] = []

                async def read() -> None:
                    with pytest.raises(ProtocolError) as raised:
                        await theirs.receive_message()
                    failed.append(raised.value)

                nursery.start_soon(read)
                await trio.testing.wait_all_tasks_blocked()
                await mine.send_all(data)
            return failed[0]

        with trio.fail_after(5):
            # the hook's own error comes out of the reader as it is, and the stream is not reset
            refused = await read_after(encode(_note("bad")))
            assert isinstance(refused, ProtocolError) and refused.code is ErrorCode.EPOCH_STALE
            assert not isinstance(refused, StreamBroken)
            await theirs.send_all(b"still open")
            # a message that does not decode resets the stream, as without a hook
            undecodable = await read_after(LENGTH_PREFIX.pack(3) + b"\x81\xa1x")
            assert isinstance(undecodable, ProtocolError) and undecodable.code is ErrorCode.BAD_REQUEST
        with pytest.raises(StreamBroken):
            await theirs.send_all(b"reset")



async def test_a_message_the_hook_leaves_reaches_the_reader_before_data_that_came_after_it() -> None:
    # Two messages in one record: the hook leaves the first to the reader (as a tail leaves a prompt
    # step that must wait for the prompt's ids) and the second arrives before the reader has run. The
    # reader gets them in order (a replica's tail once got the step after the prompt first, and
    # refused it: CACHE_MISS).
    async with link_pair() as pair:
        mine, theirs = await pair.stream_pair()
        theirs.set_message_hook(lambda message: False)
        got: list[str] = []
        async with trio.open_nursery() as nursery:

            async def read() -> None:
                for _ in range(2):
                    message = await theirs.receive_message()
                    assert isinstance(message, ErrorMessage)
                    got.append(message.message)

            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            # both queued before the link's writer runs, so they go out in one record
            assert mine.send_nowait(encode(_note("first"))) and mine.send_nowait(encode(_note("second")))
        assert got == ["first", "second"]


class Mute(MemoryTransport):
    """Delivers nothing once ``mute`` is set: a peer that went silent."""

    mute = False

    async def send_record(self, record: bytes) -> None:
        if not self.mute:
            await super().send_record(record)


async def test_the_shell_sleeps_until_the_cores_timer_and_ends_a_silent_link(
    autojump_clock: trio.abc.Clock,
) -> None:
    a_end, b_end = memory_transport_pair()
    mute = Mute(a_end._send, a_end._receive, a_end.remote_address)
    timings = LinkTimings(keepalive_interval=1.0, dead_after=3.0)
    async with link_pair(timings, transports=(mute, b_end)) as pair:
        bob = pair.bob
        start = trio.current_time()
        await trio.testing.wait_all_tasks_blocked()
        assert trio.current_time() == start
        assert bob.core.next_timer() == pytest.approx(start + 1.0)
        await trio.sleep(2.5)
        assert not bob.closed and bob.rtt is not None  # pings answered keep it up
        mute.mute = True
        with trio.fail_after(10):
            await bob.wait_closed()
        # Silent from about 2.5 s; found at the first tick 3 s later.
        assert trio.current_time() - start == pytest.approx(6.0)
        assert bob.error is not None and bob.error.code is ErrorCode.UNREACHABLE
        assert "no traffic" in bob.error.message
