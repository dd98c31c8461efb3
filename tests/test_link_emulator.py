"""The link emulator carries bytes unchanged and in order, a delay later, within its bounds."""

from __future__ import annotations

import functools
import os
import random

import pytest
import trio
import trio.testing
from link_emulator import Counter, LinkEmulator, LinkSpec, Schedule, Waiter, carry


async def test_each_chunk_arrives_one_delay_later(autojump_clock: trio.testing.MockClock) -> None:
    client, src = trio.testing.memory_stream_one_way_pair()
    dst, far = trio.testing.memory_stream_one_way_pair()
    arrivals: list[tuple[float, bytes | bytearray]] = []

    async def receive() -> None:
        while data := await far.receive_some():
            arrivals.append((trio.current_time(), data))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(carry, src, dst, LinkSpec(delay=0.005))
        nursery.start_soon(receive)
        t0 = trio.current_time()
        for i in range(3):
            await client.send_all(b"chunk %d" % i)
            await trio.sleep(0.001)
        await client.aclose()
    assert b"".join(d for _, d in arrivals) == b"chunk 0chunk 1chunk 2"
    assert [round(t - t0, 6) for t, _ in arrivals] == [0.005, 0.006, 0.007]


async def test_jitter_never_reorders_and_adds_at_most_its_width(autojump_clock: trio.testing.MockClock) -> None:
    schedule = Schedule(LinkSpec(delay=0.010, jitter=0.020), random.Random(7))
    dues = [schedule.due(100, now=i * 0.001) for i in range(200)]
    assert dues == sorted(dues)
    assert all(0.010 <= due - i * 0.001 < 0.030 for i, due in enumerate(dues))
    assert max(due - i * 0.001 for i, due in enumerate(dues)) > 0.020  # the jitter is really drawn


def test_a_new_connections_chunks_wait_for_its_handshake() -> None:
    """Nothing arrives before the handshake lets it (not_before); later chunks take the plain delay."""
    schedule = Schedule(LinkSpec(delay=0.005), random.Random(0), not_before=0.015)
    assert schedule.due(10, now=0.0) == pytest.approx(0.015)
    assert schedule.due(10, now=0.001) == pytest.approx(0.015)
    assert schedule.due(10, now=0.020) == pytest.approx(0.025)


def test_rate_cap_serialises_chunks() -> None:
    # 1 MB/s: a 100 kB chunk takes 0.1 s on the wire, and the next one waits for it
    schedule = Schedule(LinkSpec(delay=0.005, rate=1e6), random.Random(0))
    assert schedule.due(100_000, now=0.0) == pytest.approx(0.105)
    assert schedule.due(100_000, now=0.0) == pytest.approx(0.205)
    assert schedule.due(10, now=1.0) == pytest.approx(1.005 + 1e-5)


async def test_a_flood_is_held_to_the_buffer(autojump_clock: trio.testing.MockClock) -> None:
    """A receiver that reads nothing: the proxy stops reading once its buffer is full."""
    spec = LinkSpec(delay=0.001, buffer_bytes=64 << 10, chunk=4 << 10)
    client, src = trio.testing.memory_stream_one_way_pair()
    dst, _far = trio.testing.lockstep_stream_one_way_pair()  # its send_all waits for a reader that never comes
    counter = Counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(carry, src, dst, spec, None, (counter,))
        await client.send_all(os.urandom(1 << 20))
        await trio.sleep(1.0)
        # the queue's chunks, one the writer is sending and one the reader holds
        assert counter.bytes <= spec.buffer_bytes + 2 * spec.chunk
        nursery.cancel_scope.cancel()


def test_bad_specs_are_refused() -> None:
    for bad in ({"delay": -1.0}, {"jitter": -0.1}, {"rate": 0.0}, {"buffer_bytes": 10, "chunk": 100}):
        with pytest.raises(ValueError):
            LinkSpec(**bad)


async def echo_server(nursery: trio.Nursery) -> int:
    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                while data := await stream.receive_some():
                    await stream.send_all(data)
                await stream.send_eof()
            except trio.BrokenResourceError:
                pass

    listeners = await nursery.start(functools.partial(trio.serve_tcp, echo, 0, host="127.0.0.1"))
    return int(listeners[0].socket.getsockname()[1])


async def test_sockets_round_trip_unchanged_and_no_faster_than_the_link_allows() -> None:
    delay = 0.003
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await echo_server(nursery)
            emulator = LinkEmulator(("127.0.0.1", port), LinkSpec(delay=delay, jitter=0.001, buffer_bytes=256 << 10))
            proxy = await nursery.start(emulator.serve, "127.0.0.1", 0)
            payload = os.urandom(3 << 20)
            t0 = trio.current_time()
            async with await trio.open_tcp_stream("127.0.0.1", proxy) as stream:
                await stream.send_all(b"ping")
                assert await stream.receive_some() == b"ping"
                # lower bounds only (a busy machine may add to them, never take away): a new connection's
                # first bytes wait for TCP's handshake over the link, three delays, and the answer one more
                assert trio.current_time() - t0 >= 4 * delay
                t1 = trio.current_time()
                await stream.send_all(b"pong")
                assert await stream.receive_some() == b"pong"
                assert trio.current_time() - t1 >= 2 * delay
                got = bytearray()

                async def send() -> None:
                    await stream.send_all(payload)
                    await stream.send_eof()

                nursery.start_soon(send)
                while data := await stream.receive_some():
                    got += data
            assert bytes(got) == payload
            assert emulator.up.bytes == emulator.down.bytes == len(payload) + 8
            nursery.cancel_scope.cancel()


async def test_the_real_clock_waits_on_a_timerfd_never_before_the_deadline() -> None:
    """trio's own sleeps reach epoll in whole milliseconds; the writer's waiter wakes on a timerfd instead,
    and a chunk still never leaves before its time."""
    with trio.fail_after(30), Waiter() as waiter:
        assert waiter.fd >= 0
        for i in range(20):
            deadline = trio.current_time() + 0.0005 + i * 0.0001
            await waiter.until(deadline)
            assert trio.current_time() >= deadline
        await waiter.until(trio.current_time() - 1)  # a deadline passed: no wait, and no error
    assert waiter.fd == -1


async def test_under_the_mock_clock_the_waiter_sleeps_on_it(autojump_clock: trio.testing.MockClock) -> None:
    with Waiter() as waiter:
        assert waiter.fd == -1
        t0 = trio.current_time()
        await waiter.until(t0 + 5.0)
        assert trio.current_time() == t0 + 5.0


async def test_connections_beyond_the_limit_are_closed_on_arrival() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await echo_server(nursery)
            emulator = LinkEmulator(("127.0.0.1", port), LinkSpec(), max_connections=2)
            proxy = await nursery.start(emulator.serve, "127.0.0.1", 0)
            kept = [await trio.open_tcp_stream("127.0.0.1", proxy) for _ in range(2)]
            for s in kept:  # both carried
                await s.send_all(b"x")
                assert await s.receive_some() == b"x"
            extra = await trio.open_tcp_stream("127.0.0.1", proxy)
            assert await extra.receive_some() == b""
            assert emulator.refused == 1
            await kept[0].aclose()
            while emulator.carrying > 1:  # the proxy notices the close
                await trio.sleep(0.01)
            again = await trio.open_tcp_stream("127.0.0.1", proxy)
            await again.send_all(b"y")
            assert await again.receive_some() == b"y"
            for s in [kept[1], extra, again]:
                await s.aclose()
            nursery.cancel_scope.cancel()


async def test_an_unreachable_target_closes_the_client() -> None:
    with trio.socket.socket() as s:
        await s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # bound, never listening: connections to it are refused
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                emulator = LinkEmulator(("127.0.0.1", dead), LinkSpec())
                proxy = await nursery.start(emulator.serve, "127.0.0.1", 0)
                async with await trio.open_tcp_stream("127.0.0.1", proxy) as stream:
                    assert await stream.receive_some() == b""
                nursery.cancel_scope.cancel()
