"""Peer links in trio: real loopback WebSockets, and in-memory transports for faults."""

from __future__ import annotations

import contextlib
import functools
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest
import trio
import trio.testing
from attacks import unfinished_activation
from memory_transport import MemoryTransport, memory_transport_pair
from trio_websocket import ConnectionClosed, open_websocket_url

from meshd.net.admission import AdmissionConfig
from meshd.net.events import HandshakeFailed, LinkDown, PeerEvent
from meshd.net.link import LinkTimings
from meshd.net.peers import Peers, PeersConfig, open_peers
from meshd.net.stream import Stream
from meshd.net.transport import StreamTransport
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.message import ErrorMessage
from wire.mux_config import MuxConfig
from wire.tensors import Activation, TensorEntry

ALICE = NodeIdentity.from_private_bytes(b"a" * 32)
BOB = NodeIdentity.from_private_bytes(b"b" * 32)
CAROL = NodeIdentity.from_private_bytes(b"c" * 32)


def activation(step: int, hidden: np.ndarray) -> Activation:
    return Activation.of(
        session="s",
        epoch=0,
        step=step,
        pos=step,
        n_tokens=hidden.shape[0],
        tensors=[TensorEntry.from_array("hidden_states", hidden)],
    )


async def echo(stream: Stream) -> None:
    async for message in stream.messages():
        await stream.send_message(message)


async def echo_bytes(stream: Stream) -> None:
    while data := await stream.receive_some():
        await stream.send_all(data)


# Tests leave streams open at exit: do not wait long for them to finish. And
# keepalives are slowed down so that they cannot mask a lost wake-up: a stall
# shows up as a test timeout instead.
CALM = LinkTimings(keepalive_interval=300, dead_after=900)
QUICK = PeersConfig(drain_timeout=0.1, timings=CALM)


@asynccontextmanager
async def two_peers(
    config: PeersConfig | None = None,
    listener_config: PeersConfig | None = None,
) -> AsyncIterator[tuple[Peers, Peers, str, list[PeerEvent]]]:
    """ALICE and BOB; BOB listens on loopback and records its peer events."""
    events: list[PeerEvent] = []
    config = config or QUICK
    with trio.fail_after(20):
        async with open_peers(BOB, listener_config or config, observer=events.append) as bob:
            async with open_peers(ALICE, config) as alice:
                bob.handle("echo", echo)
                bob.handle("echo-bytes", echo_bytes, raw=True)
                port = await bob.listen("127.0.0.1", 0)
                yield alice, bob, f"127.0.0.1:{port}", events


# ----- over real WebSockets


async def test_activations_cross_a_websocket_link_bit_exact() -> None:
    async with two_peers() as (alice, bob, address, _):
        stream = await alice.open_stream(address, "echo", node_id=BOB.node_id)
        assert stream.remote_node_id == BOB.node_id
        rng = np.random.default_rng(0)
        for step, rows in enumerate([1, 1, 7, 300]):
            hidden = rng.standard_normal((rows, 576), dtype=np.float32)
            await stream.send_message(activation(step, hidden))
            reply = await stream.receive_message()
            assert isinstance(reply, Activation) and reply.step == step
            assert np.array_equal(reply.array(), hidden)
        await stream.send_eof()
        with pytest.raises(trio.EndOfChannel):
            await stream.receive_message()
        await stream.aclose()
        # One link per peer pair: a second stream reuses it.
        again = await alice.open_stream(address, "echo")
        assert again.link is stream.link and len(alice.links) == 1
        await again.aclose()


async def test_a_wrong_mesh_key_is_refused_on_both_sides_with_a_clear_reason() -> None:
    async with two_peers(
        PeersConfig(mesh_key=b"alpha", drain_timeout=0.1, timings=CALM),
        listener_config=PeersConfig(mesh_key=b"beta", drain_timeout=0.1, timings=CALM),
    ) as (alice, _, address, events):
        with pytest.raises(ProtocolError) as info:
            await alice.connect(address)
        assert info.value.code is ErrorCode.UNAUTHORIZED
        assert "mesh key mismatch" in info.value.message
        with trio.fail_after(5):
            while not events:
                await trio.sleep(0.01)
        [event] = events
        assert isinstance(event, HandshakeFailed) and event.inbound
        assert event.error.code is ErrorCode.UNAUTHORIZED
        assert "mesh key mismatch" in event.error.message


async def test_garbage_from_strangers_does_not_disturb_the_node() -> None:
    async with two_peers() as (alice, bob, address, events):
        host, port = address.split(":")
        for junk in (b"\x00" * 100, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x16\x03\x01"):
            tcp = await trio.open_tcp_stream(host, int(port))
            await tcp.send_all(junk)
            await tcp.aclose()
        for records in ([b""], [b"\x01" + bytes(31)], [b"\x02reject", b"x" * 70_000]):
            async with open_websocket_url(f"ws://{address}/") as ws:
                with trio.move_on_after(2), contextlib.suppress(ConnectionClosed):
                    for record in records:
                        await ws.send_message(record)
                    while True:  # the node's REJECT, then it hangs up
                        await ws.get_message()
        with trio.fail_after(5):
            while sum(isinstance(e, HandshakeFailed) for e in events) < 3:
                await trio.sleep(0.01)
        stream = await alice.open_stream(address, "echo", node_id=BOB.node_id)
        await stream.send_message(ErrorMessage(code=ErrorCode.INTERNAL, message="still here"))
        assert (await stream.receive_message()).message == "still here"  # type: ignore[attr-defined]


async def test_dialing_an_expected_node_id_and_reaching_another_key_fails() -> None:
    async with two_peers() as (alice, _, address, _events):
        with pytest.raises(ProtocolError) as info:
            await alice.open_stream(address, "echo", node_id=CAROL.node_id)
        assert info.value.code is ErrorCode.UNAUTHORIZED
        assert BOB.node_id in info.value.message and CAROL.node_id in info.value.message
        assert alice.links == []


async def test_an_unreachable_address_is_a_typed_error(refusing_address: str) -> None:
    async with open_peers(ALICE, QUICK) as alice:
        with pytest.raises(ProtocolError) as info:
            await alice.connect(refusing_address)
        assert info.value.code is ErrorCode.UNREACHABLE and info.value.retryable


SMALL_WINDOWS = PeersConfig(
    mux=MuxConfig(stream_window=64 << 10, link_window=1 << 20), drain_timeout=0.1, timings=CALM
)


async def test_a_stalled_stream_neither_blocks_others_nor_buffers_past_its_window() -> None:
    stalled_streams: list[Stream] = []

    async def never_read(stream: Stream) -> None:
        stalled_streams.append(stream)
        await trio.sleep_forever()

    async with two_peers(SMALL_WINDOWS) as (alice, bob, address, _):
        bob.handle("never-read", never_read)
        stalled = await alice.open_stream(address, "never-read")
        chunk = b"z" * 1024
        accepted = 0

        async def flood() -> None:
            nonlocal accepted
            while True:
                await stalled.send_all(chunk)
                accepted += len(chunk)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            busy = await alice.open_stream(address, "echo")
            hidden = np.ones((1, 8192), np.float32)
            with trio.fail_after(10):
                for step in range(100):
                    await busy.send_message(activation(step, hidden))
                    assert (await busy.receive_message()).step == step  # type: ignore[attr-defined]
            await trio.sleep(0.2)
            link = stalled.link
            # The flood stopped at the peer's stream window: nothing beyond it
            # was accepted, framed, encrypted or queued on this side.
            assert accepted == 64 << 10
            assert link.core.mux.send_capacity(stalled.stream_id) == 0
            assert not link.core.mux.has_output and not link._outbox
            nursery.cancel_scope.cancel()
        [remote] = stalled_streams
        assert sum(len(c) for c in remote._chunks) == 64 << 10


async def test_many_concurrent_streams_each_keep_their_messages_in_order() -> None:
    rng = np.random.default_rng(3)
    payloads = [
        [
            rng.standard_normal((1, int(rng.choice([1, 576, 30_000]))), dtype=np.float32)
            for _ in range(12)
        ]
        for _ in range(16)
    ]
    async with two_peers(SMALL_WINDOWS) as (alice, _, address, _events):

        async def converse(arrays: list[np.ndarray]) -> None:
            stream = await alice.open_stream(address, "echo")
            async with trio.open_nursery() as nursery:

                async def send_all() -> None:
                    for step, array in enumerate(arrays):
                        await stream.send_message(activation(step, array))
                    await stream.send_eof()

                nursery.start_soon(send_all)
                for step, array in enumerate(arrays):
                    reply = await stream.receive_message()
                    assert isinstance(reply, Activation) and reply.step == step
                    assert np.array_equal(reply.array(), array)
            await stream.aclose()

        async with trio.open_nursery() as nursery:
            for arrays in payloads:
                nursery.start_soon(converse, arrays)


async def test_a_bad_message_resets_only_its_stream() -> None:
    async with two_peers() as (alice, _, address, _events):
        good = await alice.open_stream(address, "echo")
        bad = await alice.open_stream(address, "echo")
        await good.send_message(ErrorMessage(code=ErrorCode.INTERNAL, message="one"))
        assert (await good.receive_message()).message == "one"  # type: ignore[attr-defined]
        junk = b"\x92\x01\x02"  # a msgpack array, not a map
        await bad.send_all(struct.pack(">I", len(junk)) + junk)
        with trio.fail_after(5), pytest.raises(ProtocolError) as info:
            await bad.receive_message()
        assert info.value.code is ErrorCode.BAD_REQUEST
        await good.send_message(ErrorMessage(code=ErrorCode.INTERNAL, message="two"))
        assert (await good.receive_message()).message == "two"  # type: ignore[attr-defined]


async def test_a_large_message_is_fragmented_through_small_windows() -> None:
    async with two_peers(SMALL_WINDOWS) as (alice, _, address, _events):
        stream = await alice.open_stream(address, "echo")
        hidden = np.random.default_rng(1).standard_normal((1024, 2048), dtype=np.float32)
        with trio.fail_after(30):
            await stream.send_message(activation(0, hidden))
            reply = await stream.receive_message()
        assert np.array_equal(reply.array(), hidden)  # type: ignore[attr-defined]


async def test_cancelling_a_large_send_resets_only_that_stream() -> None:
    async def never_read(stream: Stream) -> None:
        await trio.sleep_forever()

    async with two_peers(SMALL_WINDOWS) as (alice, bob, address, _events):
        bob.handle("never-read", never_read)
        big = await alice.open_stream(address, "never-read")
        other = await alice.open_stream(address, "echo")
        hidden = np.ones((512, 1024), np.float32)  # 2 MiB: many windows
        with trio.move_on_after(0.2) as scope:
            await big.send_message(activation(0, hidden))
        assert scope.cancelled_caught
        with pytest.raises(ProtocolError) as info:
            await big.send_message(activation(1, hidden[:1]))
        assert info.value.code is ErrorCode.CANCELLED
        await other.send_message(activation(2, hidden[:1]))
        with trio.fail_after(5):
            assert (await other.receive_message()).step == 2  # type: ignore[attr-defined]
        assert not other.link.closed


async def test_cancelled_small_sends_neither_break_the_link_nor_garble_the_stream() -> None:
    async with two_peers() as (alice, _, address, _events):
        stream = await alice.open_stream(address, "echo")
        for step in range(40):
            message = ErrorMessage(code=ErrorCode.INTERNAL, message=str(step))
            if step % 2:
                with trio.CancelScope() as scope:
                    scope.cancel()
                    await stream.send_message(message)
            else:
                await stream.send_message(message)
        with trio.fail_after(5):
            echoed = [(await stream.receive_message()).message for _ in range(40)]  # type: ignore[attr-defined]
        # A send cancelled after its record was sealed still delivers it, in order.
        assert echoed == [str(step) for step in range(40)]
        assert not stream.link.closed


async def test_websocket_records_skip_the_reader_task() -> None:
    """Guards the hot-path shortcut into trio-websocket against upgrades."""
    from meshd.net.transport import _RecordSink

    async with two_peers() as (alice, _, address, _events):
        link = await alice.connect(address)
        assert isinstance(link.transport._ws._send_channel, _RecordSink)  # type: ignore[attr-defined]


async def test_raw_byte_streams_half_close() -> None:
    async with two_peers() as (alice, _, address, _events):
        stream = await alice.open_stream(address, "echo-bytes")
        await stream.send_all(b"hello ")
        await stream.send_all(b"world")
        await stream.send_eof()
        received = b""
        while data := await stream.receive_some(3):
            assert len(data) <= 3
            received += data
        assert received == b"hello world"


async def test_handler_failures_reset_the_stream_with_a_typed_error() -> None:
    async def refuse(stream: Stream) -> None:
        raise ProtocolError(ErrorCode.EPOCH_STALE, "epoch 2 is gone")

    async def crash(stream: Stream) -> None:
        raise RuntimeError("bug")

    async with two_peers() as (alice, bob, address, _):
        bob.handle("refuse", refuse)
        bob.handle("crash", crash)
        expected = {
            "refuse": ErrorCode.EPOCH_STALE,
            "crash": ErrorCode.INTERNAL,
            "nobody-serves-this": ErrorCode.NOT_FOUND,
        }
        for protocol, code in expected.items():
            stream = await alice.open_stream(address, protocol)
            with trio.fail_after(5), pytest.raises(ProtocolError) as info:
                await stream.receive_message()
            assert info.value.code is code


async def test_graceful_shutdown_closes_open_streams_with_the_reason() -> None:
    async def hold(stream: Stream) -> None:
        await trio.sleep_forever()

    config = PeersConfig(drain_timeout=0.2, timings=CALM)
    async with open_peers(ALICE, QUICK) as alice:
        events: list[PeerEvent] = []
        async with open_peers(BOB, config, observer=events.append) as bob:
            bob.handle("hold", hold)
            port = await bob.listen()
            stream = await alice.open_stream(f"127.0.0.1:{port}", "hold")
            await stream.send_message(ErrorMessage(code=ErrorCode.INTERNAL, message="hi"))
            await trio.sleep(0.05)
            await bob.aclose("maintenance window")
        with trio.fail_after(5), pytest.raises(ProtocolError) as info:
            await stream.receive_message()
        assert info.value.code is ErrorCode.UNREACHABLE
        assert "maintenance window" in info.value.message
        assert any(isinstance(e, LinkDown) for e in events)


async def test_simultaneous_dials_settle_on_one_link_both_sides_agree_on() -> None:
    async with open_peers(ALICE, QUICK) as alice, open_peers(BOB, QUICK) as bob:
        for peers in (alice, bob):
            peers.handle("echo", echo)
        alice_port, bob_port = await alice.listen(), await bob.listen()
        links = {}
        async with trio.open_nursery() as nursery:

            async def dial(name: str, peers: Peers, port: int) -> None:
                links[name] = await peers.connect(f"127.0.0.1:{port}")

            nursery.start_soon(dial, "alice", alice, bob_port)
            nursery.start_soon(dial, "bob", bob, alice_port)
        with trio.fail_after(5):
            while len(alice.links) != 1 or len(bob.links) != 1:
                await trio.sleep(0.01)
        [alice_link], [bob_link] = alice.links, bob.links
        lower = min(ALICE.node_id, BOB.node_id)
        # Both kept the link dialed by the lower node id.
        assert alice_link.dialer == (lower == ALICE.node_id)
        assert bob_link.dialer == (lower == BOB.node_id)
        for peers, port, other in ((alice, bob_port, BOB), (bob, alice_port, ALICE)):
            stream = await peers.open_stream(f"127.0.0.1:{port}", "echo", node_id=other.node_id)
            await stream.send_message(ErrorMessage(code=ErrorCode.INTERNAL, message="x"))
            assert (await stream.receive_message()).message == "x"  # type: ignore[attr-defined]
            await stream.aclose()


# ----- over in-memory transports, with faults injected


class Tampering(MemoryTransport):
    """Passes records through, except that it corrupts, repeats or drops them on cue."""

    def __init__(self, inner: MemoryTransport) -> None:
        super().__init__(inner._send, inner._receive, inner.remote_address)
        self.sent = 0
        self.flip_at: int | None = None
        self.repeat_at: int | None = None
        self.black_hole = False
        # seconds each record takes on the way (a link's one-way delay; under the mock clock, exact)
        self.delay = 0.0

    async def send_record(self, record: bytes) -> None:
        self.sent += 1
        if self.black_hole:
            return
        if self.delay:
            await trio.sleep(self.delay)
        if self.sent == self.flip_at:
            record = bytes([record[0] ^ 0x80]) + record[1:]
        await super().send_record(record)
        if self.sent == self.repeat_at:
            await super().send_record(record)


@asynccontextmanager
async def memory_link(
    timings: LinkTimings | None = None,
) -> AsyncIterator[tuple[Peers, Peers, Tampering, list[str]]]:
    """ALICE dials BOB over a tampering in-memory pipe; BOB's handler logs what it reads."""
    seen: list[str] = []

    async def record(stream: Stream) -> None:
        async for message in stream.messages():
            seen.append(message.message)  # type: ignore[attr-defined]

    config = PeersConfig(timings=timings or CALM, drain_timeout=0.1)
    a_end, b_end = memory_transport_pair()
    tampering = Tampering(a_end)
    async with open_peers(ALICE, config) as alice, open_peers(BOB, config) as bob:
        bob.handle("record", record)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(bob.attach, b_end, dialer=False))
            await alice.attach(tampering, dialer=True, node_id=BOB.node_id)
        yield alice, bob, tampering, seen


async def test_a_link_runs_over_any_byte_stream() -> None:
    """As it will over a relay circuit: records framed on a plain byte stream."""
    a_end, b_end = trio.testing.memory_stream_pair()
    async with open_peers(ALICE, QUICK) as alice, open_peers(BOB, QUICK) as bob:
        bob.handle("echo", echo)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                functools.partial(bob.attach, StreamTransport(b_end, "pipe:alice"), dialer=False)
            )
            link = await alice.attach(
                StreamTransport(a_end, "pipe:bob"), dialer=True, node_id=BOB.node_id
            )
        stream = link.open_stream("echo")
        hidden = np.arange(70_000, dtype=np.float32).reshape(1, -1)  # several records
        with trio.fail_after(5):
            await stream.send_message(activation(7, hidden))
            reply = await stream.receive_message()
        assert np.array_equal(reply.array(), hidden)  # type: ignore[attr-defined]


async def test_a_flipped_ciphertext_byte_closes_the_link_and_delivers_no_plaintext() -> None:
    async with memory_link() as (alice, bob, tampering, seen):
        [link] = alice.links
        stream = link.open_stream("record")
        await stream.send_message(ErrorMessage(code=ErrorCode.INTERNAL, message="clean"))
        with trio.fail_after(5):
            while seen != ["clean"]:
                await trio.sleep(0.01)
        tampering.flip_at = tampering.sent + 1
        await stream.send_message(ErrorMessage(code=ErrorCode.INTERNAL, message="tampered"))
        with trio.fail_after(5):
            await link.wait_closed()
            while bob.links:
                await trio.sleep(0.01)
        assert seen == ["clean"]
        with pytest.raises(ProtocolError, match=r"^UNREACHABLE: memory:b hung up$"):
            await stream.send_message(ErrorMessage(code=ErrorCode.INTERNAL, message="after"))


async def test_a_link_error_reaches_the_peer_as_the_reason_for_closing() -> None:
    async with memory_link() as (alice, bob, tampering, _):
        [link], [bob_link] = alice.links, bob.links
        # Forge a frame of an unknown type, as the peer's mux would see it.
        link.core.mux._out.append(b"\x63" + bytes(9))
        await link.flush()
        with trio.fail_after(5):
            await link.wait_closed()
            await bob_link.wait_closed()
        assert bob_link.error is not None and "unknown frame type 99" in bob_link.error.message
        assert link.error is not None and "unknown frame type 99" in link.error.message


async def test_a_replayed_record_closes_the_link() -> None:
    async with memory_link() as (alice, bob, tampering, seen):
        [link] = alice.links
        stream = link.open_stream("record")
        tampering.repeat_at = tampering.sent + 1
        await stream.send_message(ErrorMessage(code=ErrorCode.INTERNAL, message="once"))
        with trio.fail_after(5):
            await link.wait_closed()
        assert seen in ([], ["once"])
        assert bob.links == [] and alice.links == []


async def test_a_silent_peer_is_declared_dead(autojump_clock: trio.abc.Clock) -> None:
    timings = LinkTimings(keepalive_interval=1.0, dead_after=3.0)
    async with memory_link(timings) as (alice, bob, tampering, _):
        [link] = bob.links
        stream = link.open_stream("record")
        start = trio.current_time()
        tampering.black_hole = True  # ALICE's records stop arriving at BOB
        with trio.fail_after(10):
            await link.wait_closed()
        assert 3.0 <= trio.current_time() - start <= 5.0
        assert link.error is not None and link.error.code is ErrorCode.UNREACHABLE
        with pytest.raises(ProtocolError, match=r"^UNREACHABLE: memory:a: no traffic from the peer for 3\.0 s$"):
            await stream.receive_message()


async def test_keepalive_measures_round_trip_time(autojump_clock: trio.abc.Clock) -> None:
    timings = LinkTimings(keepalive_interval=1.0, dead_after=3.0)
    async with memory_link(timings) as (alice, _, tampering, _):
        [link] = alice.links
        # ALICE's pings take 0.25 s to reach BOB, his pongs come back at once
        tampering.delay = 0.25
        await trio.sleep(2.5)
        assert link.rtt is not None and 0.25 <= link.rtt < 0.26
        assert not link.closed  # pings keep an idle link alive


# ----- bounded dials


@asynccontextmanager
async def silent_listener(upgrade: bool = False) -> AsyncIterator[str]:
    """A host that accepts TCP and then never says a word (or, with ``upgrade``,
    completes the WebSocket upgrade and then stays silent)."""
    held: list[object] = []

    async def hold(stream: trio.SocketStream) -> None:
        held.append(stream)
        if upgrade:
            from trio_websocket import wrap_server_stream

            async with trio.open_nursery() as nursery:
                request = await wrap_server_stream(nursery, stream)
                held.append(await request.accept())
                await trio.sleep_forever()
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(functools.partial(trio.serve_tcp, hold, 0, host="127.0.0.1"))
        yield f"127.0.0.1:{listener.socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("upgrade", "stage"), [(False, "no WebSocket upgrade from"), (True, "no Noise handshake from")])
async def test_a_dial_to_a_silent_host_ends_at_its_deadline_naming_the_stage(
    autojump_clock: trio.abc.Clock, upgrade: bool, stage: str
) -> None:
    async with silent_listener(upgrade) as address, open_peers(ALICE, QUICK) as alice:
        events: list[PeerEvent] = []
        alice._observer = events.append
        started = trio.current_time()
        with pytest.raises(ProtocolError) as info:
            await alice.connect(address)
        assert trio.current_time() - started == pytest.approx(QUICK.dial_timeout, abs=0.5)
        assert info.value.code is ErrorCode.UNREACHABLE
        assert info.value.message == f"{stage} {address} within 5 s"
        assert [type(e) for e in events] == [HandshakeFailed]
        assert alice.links == []


async def test_a_dial_whose_syn_is_never_answered_ends_at_its_deadline(autojump_clock: trio.abc.Clock) -> None:
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        address = f"127.0.0.1:{full.getsockname()[1]}"
        # Fill the accept queue: further SYNs are dropped, so connect() hangs.
        fillers = []
        for _ in range(3):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(full.getsockname())
            fillers.append(sock)
        try:
            async with open_peers(ALICE, QUICK) as alice:
                with pytest.raises(ProtocolError) as info:
                    await alice.connect(address)
            assert info.value.message == f"no TCP connection to {address} within 5 s"
        finally:
            for sock in fillers:
                sock.close()


@pytest.mark.parametrize("upgrade", [False, True])
async def test_cancelling_a_hung_dial_returns_at_once(autojump_clock: trio.abc.Clock, upgrade: bool) -> None:
    """Nothing on the dial path shields itself: Ctrl-C must not wait for a silent host."""
    async with silent_listener(upgrade) as address, open_peers(ALICE, QUICK) as alice:
        with trio.CancelScope() as scope:
            scope.deadline = trio.current_time() + 1.0
            await alice.connect(address)
        assert scope.cancelled_caught
        assert trio.current_time() - scope.deadline < 0.01
        cancelled_at = trio.current_time()
    # and leaving open_peers does not wait either
    assert trio.current_time() - cancelled_at < 0.01


# ----- admission


async def raw_connect(address: str, source: str = "127.0.0.1") -> trio.SocketStream:
    host, port = address.rsplit(":", 1)
    sock = trio.socket.socket()
    await sock.bind((source, 0))
    await sock.connect((host, int(port)))
    return trio.SocketStream(sock)


async def closed_by_peer(stream: trio.SocketStream) -> bool:
    """Whether the node has hung up on ``stream`` (EOF or reset), without sending it anything."""
    try:
        while data := await stream.receive_some(65536):
            del data
    except trio.BrokenResourceError:
        pass
    return True


async def test_an_idle_connection_is_dropped_at_the_preauth_deadline(autojump_clock: trio.abc.Clock) -> None:
    async with two_peers() as (_alice, bob, address, _events):
        idle = await raw_connect(address)
        opened = trio.current_time()
        with trio.fail_after(30):
            assert await closed_by_peer(idle)
        assert trio.current_time() - opened == pytest.approx(QUICK.admission.preauth_timeout, abs=0.5)
        assert bob._admission is not None and bob._admission.preauth == 0


async def test_a_big_frame_before_the_handshake_is_refused_early() -> None:
    """1 MiB − 1 of one WebSocket message from a stranger: the node hangs up
    after a few KiB instead of buffering it (close code 1009)."""
    async with two_peers() as (alice, bob, address, _events):
        async with open_websocket_url(f"ws://{address}/", max_message_size=1 << 20) as ws:
            with trio.fail_after(5), contextlib.suppress(ConnectionClosed, trio.BrokenResourceError):
                await ws.send_message(b"\x01" + bytes((1 << 20) - 2))
                await ws.get_message()
            assert ws.closed is not None and ws.closed.code == 1009
        stream = await alice.open_stream(address, "echo", node_id=BOB.node_id)
        await stream.send_message(activation(0, np.ones((64, 256), np.float32)))
        assert isinstance(await stream.receive_message(), Activation)


CAPPED = PeersConfig(
    drain_timeout=0.1, timings=CALM, admission=AdmissionConfig(max_preauth=4, max_preauth_per_source=2)
)


async def test_a_flood_of_idle_connections_displaces_itself_and_an_honest_dialer_still_gets_in() -> None:
    async with two_peers(listener_config=CAPPED) as (alice, bob, address, _events):
        same_source = [await raw_connect(address) for _ in range(3)]
        # the third from one source displaces the first
        with trio.fail_after(5):
            assert await closed_by_peer(same_source[0])
        others = [await raw_connect(address, f"127.0.0.{n}") for n in (2, 3, 3)]
        # all four places are taken by now; the heaviest source gives one up
        assert bob._admission is not None
        with trio.fail_after(5):
            while bob._admission.preauth > 4:
                await trio.sleep(0.01)
        assert bob._admission.preauth <= 4
        stream = await alice.open_stream(address, "echo", node_id=BOB.node_id)
        await stream.send_message(ErrorMessage(code=ErrorCode.INTERNAL, message="in"))
        assert (await stream.receive_message()).message == "in"  # type: ignore[attr-defined]
        for s in same_source + others:
            await s.aclose()


async def test_inbound_connections_stay_under_the_fd_budget() -> None:
    async with two_peers(listener_config=CAPPED) as (alice, bob, address, _events):
        assert bob._admission is not None
        bob._admission.max_inbound = 2
        link = await alice.connect(address, node_id=BOB.node_id)
        idle = [await raw_connect(address, f"127.0.0.{n}") for n in (2, 3, 4)]
        with trio.fail_after(5):
            while bob._admission.inbound > 2:
                await trio.sleep(0.01)
        # the authenticated link is never displaced by strangers
        assert link.usable and bob._admission.inbound == 2
        for s in idle:
            await s.aclose()


# ----- what an authenticated peer can make us hold


PATIENT = PeersConfig(first_message_timeout=2.0, drain_timeout=0.1, timings=CALM)


async def test_a_stream_without_a_first_message_is_reset_at_its_deadline(autojump_clock: trio.abc.Clock) -> None:
    async with two_peers(listener_config=PATIENT) as (alice, _bob, address, _events):
        stream = await alice.open_stream(address, "echo", node_id=BOB.node_id)
        await stream.send_all(struct.pack(">I", 100) + b"\x80")  # a message that never ends
        opened = trio.current_time()
        with pytest.raises(ProtocolError) as info:
            await stream.receive_message()
        assert info.value.code is ErrorCode.DEADLINE_EXCEEDED
        assert trio.current_time() - opened == pytest.approx(PATIENT.first_message_timeout, abs=0.5)
        # raw byte protocols have no first message to wait for
        raw = await alice.open_stream(address, "echo-bytes", node_id=BOB.node_id)
        await trio.sleep(2 * PATIENT.first_message_timeout)
        await raw.send_all(b"still open")
        assert await raw.receive_some() == b"still open"


HOLDING = PeersConfig(
    mux=MuxConfig(stream_window=256 << 10, link_window=1 << 20, max_held=2 << 20),
    max_held_bytes=3 << 20,
    first_message_timeout=2.0,
    drain_timeout=0.1,
    timings=CALM,
)


async def test_never_finished_messages_hold_at_most_the_budget_and_are_reset() -> None:
    """8 streams each sending the start of a 24 MiB message and never the rest."""
    async with two_peers(listener_config=HOLDING) as (alice, bob, address, _events):
        link = await alice.connect(address, node_id=BOB.node_id)
        streams = [link.open_stream("echo") for _ in range(8)]
        pushed = [0] * len(streams)

        message = unfinished_activation(24 << 20)
        chunk = 64 << 10

        async def push(i: int) -> None:
            with contextlib.suppress(ProtocolError, trio.ClosedResourceError):
                for start in range(0, len(message), chunk):
                    await streams[i].send_all(message[start:start + chunk])
                    pushed[i] += min(chunk, len(message) - start)
                await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            for i in range(len(streams)):
                nursery.start_soon(push, i)
            with trio.fail_after(5):
                while not bob.links:
                    await trio.sleep(0.01)
            mux = bob.links[0].core.mux
            with trio.fail_after(10):
                while mux.held < HOLDING.mux.max_held:
                    await trio.sleep(0.01)
            await trio.sleep(0.3)  # the peer has had time to use any credit left
            bound = HOLDING.mux.link_window + HOLDING.mux.max_held + HOLDING.mux.max_frame
            assert sum(pushed) <= bound
            assert mux.held <= bound
            # the first-message deadline resets them all and frees what they held
            with trio.fail_after(10):
                while mux.held or bob._held.held:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        stream = await alice.open_stream(address, "echo", node_id=BOB.node_id)
        await stream.send_message(ErrorMessage(code=ErrorCode.INTERNAL, message="after"))
        assert (await stream.receive_message()).message == "after"  # type: ignore[attr-defined]
