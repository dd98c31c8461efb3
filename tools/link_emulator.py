#!/usr/bin/env python3
"""An emulated network link: a userspace TCP proxy adding a one-way delay in each direction.

This kernel has no netem, so a link between two machines is emulated by a
proxy in front of the listening side: every chunk read from one side is
written to the other side `delay` later (plus uniform jitter in [0, jitter),
plus the time a `rate` cap takes to serialise it). Byte order is kept (jitter
never lets a chunk overtake the one before it), so it carries anything that
runs over TCP: meshd links (websocket over TCP, Noise inside) and llama.cpp RPC
alike. A new connection costs what TCP's handshake costs over such a link: the
proxy accepts at once and connects onward at once, but the client's first bytes
reach the far side no sooner than three one-way delays after the connection
began (SYN, SYN-ACK, then the data), and the far side's no sooner than four.
Every direction holds at most `buffer_bytes` in flight: once that much is
waiting for its delay the proxy stops reading, and TCP's own flow control pushes
back on the sender. At most `max_connections` are carried at once; more are
closed on arrival.

    tools/link_emulator.py --listen 127.0.0.1:7001 --to 127.0.0.1:7000 --delay-ms 5

prints `ready HOST:PORT` once it listens, then one line per connection closed.
As a library: `LinkEmulator(target, LinkSpec(delay=0.005)).serve(host, port)`
under `nursery.start`, or `carry(src, dst, spec)` for one direction.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import random
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

import trio
import trio.testing

KIB = 1 << 10


@dataclass(frozen=True)
class LinkSpec:
    """One direction of a link (both directions of a proxied connection get the same)."""

    delay: float = 0.0  # one-way, seconds
    jitter: float = 0.0  # extra delay drawn uniformly from [0, jitter), seconds
    rate: float | None = None  # bytes per second the link serialises at; None: unlimited
    buffer_bytes: int = 4 << 20  # bytes waiting for their delay, at most
    chunk: int = 64 * KIB  # largest read

    def __post_init__(self) -> None:
        if self.delay < 0 or self.jitter < 0:
            raise ValueError("delay and jitter are durations, not negative")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("a rate cap is a positive number of bytes per second")
        if self.chunk <= 0 or self.buffer_bytes < self.chunk:
            raise ValueError("the buffer must hold at least one chunk")


class Schedule:
    """When each chunk of one direction reaches the far side: sans-IO, fed sizes and `now`."""

    def __init__(self, spec: LinkSpec, rng: random.Random, not_before: float = -float("inf")) -> None:
        self.spec = spec
        self.rng = rng
        self.wire_free = -float("inf")  # when the rate-capped wire finishes its last chunk
        # no chunk arrives before this (a new connection's handshake), nor before the chunk ahead of it
        self.last_due = not_before

    def due(self, size: int, now: float) -> float:
        sent = now
        if self.spec.rate is not None:
            sent = max(now, self.wire_free) + size / self.spec.rate
            self.wire_free = sent
        jitter = self.rng.uniform(0.0, self.spec.jitter) if self.spec.jitter else 0.0
        # never before the chunk ahead of it: TCP delivers in order, and so does this link
        self.last_due = max(self.last_due, sent + self.spec.delay + jitter)
        return self.last_due


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class Waiter:
    """Sleeps until a trio deadline within about 0.1 ms: on a timerfd that trio's loop waits on.

    trio hands its timeout to epoll_wait in whole milliseconds, rounded up, so a plain sleep_until woke
    each chunk late: measured here, trio.sleep(5.3 ms) woke 0.86 ms late (median of 50) and this 0.085
    ms, and every link carries a token's rows once per hop, so the link's delay was the asked one plus
    up to a millisecond. (Python 3.13 has os.timerfd_create; this is 3.11's ctypes.) Under trio's
    MockClock, or where timerfd is missing, it is a plain sleep_until.
    """

    def __init__(self) -> None:
        self.fd = -1
        self.libc: ctypes.CDLL | None = None
        if isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock):
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.timerfd_create(1, os.O_NONBLOCK | os.O_CLOEXEC)  # CLOCK_MONOTONIC
        except (OSError, AttributeError):
            return
        if fd >= 0:
            self.fd, self.libc = fd, libc

    def __enter__(self) -> Waiter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    async def until(self, deadline: float) -> None:
        wait = deadline - trio.current_time()
        if self.libc is None or self.fd < 0 or wait <= 0:
            await trio.sleep_until(deadline)
            return
        ns = max(1, int(wait * 1e9))
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(ns // 1_000_000_000, ns % 1_000_000_000))
        if self.libc.timerfd_settime(self.fd, 0, ctypes.byref(spec), None) != 0:
            await trio.sleep_until(deadline)
            return
        await trio.lowlevel.wait_readable(self.fd)
        os.read(self.fd, 8)


@dataclass
class Counter:
    bytes: int = 0
    chunks: int = 0


async def carry(src: trio.abc.ReceiveStream, dst: trio.abc.SendStream, spec: LinkSpec,
                rng: random.Random | None = None, counters: tuple[Counter, ...] = (),
                not_before: float = -float("inf")) -> None:
    """Moves bytes from `src` to `dst`, each chunk `spec`'s delay after it was read, until `src` ends.

    The reader stamps a chunk as it arrives and queues it; the writer sleeps until
    the stamp and sends. The queue holds buffer_bytes // chunk chunks, so the
    reader stops reading (and the sender's TCP window fills) when that much is
    in flight. At the end `dst` is half-closed where it can be, so either side's
    EOF reaches the other. Every counter in `counters` counts what was read. No chunk
    arrives before `not_before` (trio time).
    """
    schedule = Schedule(spec, rng or random.Random(), not_before)
    send, receive = trio.open_memory_channel[tuple[float, bytes | bytearray]](spec.buffer_bytes // spec.chunk)

    async def read() -> None:
        async with send:
            while data := await src.receive_some(spec.chunk):
                for counter in counters:
                    counter.bytes += len(data)
                    counter.chunks += 1
                await send.send((schedule.due(len(data), trio.current_time()), data))

    async def write() -> None:
        async with receive:
            with Waiter() as waiter:
                async for due, data in receive:
                    await waiter.until(due)
                    await dst.send_all(data)
        if isinstance(dst, trio.abc.HalfCloseableStream):
            await dst.send_eof()
        else:
            await dst.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        nursery.start_soon(write)


@dataclass
class LinkEmulator:
    """A listener whose every connection is carried to `target` over an emulated link."""

    target: tuple[str, int]
    spec: LinkSpec
    max_connections: int = 64
    seed: int | None = None
    on_close: Callable[[Counter, Counter], None] | None = None  # told each connection's bytes as it closes
    connections: int = 0  # accepted and carried so far
    refused: int = 0
    up: Counter = field(default_factory=Counter)  # client to target, all connections, as read
    down: Counter = field(default_factory=Counter)
    carrying: int = 0  # connections open now

    async def serve(self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        await self.serve_on(await trio.open_tcp_listeners(port, host=host), task_status=task_status)

    async def serve_on(self, listeners: list[trio.SocketListener], *,
                       task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        rng = random.Random(self.seed)
        async with trio.open_nursery() as nursery:
            task_status.started(listeners[0].socket.getsockname()[1])
            await trio.serve_listeners(functools.partial(self._handle, rng=rng), listeners, handler_nursery=nursery)

    async def _handle(self, client: trio.abc.HalfCloseableStream, rng: random.Random) -> None:
        async with client:
            if self.carrying >= self.max_connections:
                self.refused += 1
                return
            self.carrying += 1
            self.connections += 1
            up, down = Counter(), Counter()
            try:
                try:
                    server = await trio.open_tcp_stream(*self.target)
                except OSError:
                    return  # the client sees its connection closed, as it would with nothing listening
                async with server:
                    # TCP's handshake over the link: the client may send once SYN-ACK is back (two delays),
                    # its bytes arrive one more delay later; the far side answers no sooner
                    began, d = trio.current_time(), self.spec.delay
                    try:
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(carry, client, server, self.spec, random.Random(rng.random()), (up, self.up),
                                               began + 3 * d)
                            nursery.start_soon(carry, server, client, self.spec, random.Random(rng.random()),
                                               (down, self.down), began + 4 * d)
                    except* (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass  # one side reset: both are closed on the way out
            finally:
                self.carrying -= 1
                if self.on_close is not None:
                    self.on_close(up, down)


# ----- command line


class CommandError(Exception):
    """What stops the command, said in one line."""


def host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"'{text}' is not HOST:PORT")
    return host.strip("[]"), int(port)


def milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 60_000:
        raise argparse.ArgumentTypeError(f"must be a number of milliseconds from 0 to 60000, not '{text}'")
    return value / 1000


def positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, not '{text}'")
    return value


def count(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65536:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to 65536, not '{text}'")
    return int(text)


async def run(args: argparse.Namespace) -> None:
    spec = LinkSpec(delay=args.delay_ms, jitter=args.jitter_ms,
                    rate=args.rate_mbit * 1e6 / 8 if args.rate_mbit else None,
                    buffer_bytes=max(int(args.buffer_kib * KIB), LinkSpec.chunk))

    def closed(up: Counter, down: Counter) -> None:
        print(f"closed: {up.bytes} bytes up, {down.bytes} bytes down", flush=True)

    emulator = LinkEmulator(args.to, spec, max_connections=args.max_connections, seed=args.seed, on_close=closed)
    try:
        listeners = await trio.open_tcp_listeners(args.listen[1], host=args.listen[0])
    except OSError as exc:
        raise CommandError(f"cannot listen on {args.listen[0]}:{args.listen[1]}: {exc.strerror}") from None
    async with trio.open_nursery() as nursery:
        port = await nursery.start(emulator.serve_on, listeners)
        print(f"ready {args.listen[0]}:{port} to {args.to[0]}:{args.to[1]} delay {spec.delay * 1000:g} ms", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
        nursery.cancel_scope.cancel()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", type=host_port, required=True, help="HOST:PORT to accept on (port 0: any free one)")
    ap.add_argument("--to", type=host_port, required=True, help="HOST:PORT every connection is carried to")
    ap.add_argument("--delay-ms", type=milliseconds, default=0.0, help="one-way delay in each direction")
    ap.add_argument("--jitter-ms", type=milliseconds, default=0.0, help="extra delay, uniform in [0, this)")
    ap.add_argument("--rate-mbit", type=positive, default=None, help="bandwidth cap per direction, Mbit/s")
    ap.add_argument("--buffer-kib", type=positive, default=4096, help="bytes in flight per direction, KiB")
    ap.add_argument("--max-connections", type=count, default=64, help="connections carried at once")
    ap.add_argument("--seed", type=int, default=None, help="jitter seed")
    args = ap.parse_args()
    try:
        trio.run(run, args)
    except CommandError as exc:
        print(f"link_emulator: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the signal handler is in place
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
