"""Stream multiplexing: delivery under any interleaving, flow control, faults."""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.codec import MessageDecoder
from wire.errors import ErrorCode, ProtocolError
from wire.message import ErrorMessage, Message, encode
from wire.mux import Mux
from wire.mux_config import HeldBudget, MuxConfig
from wire.mux_events import CreditAvailable, DataReceived, GoAwayReceived, PongReceived, StreamEnded, StreamOpened, StreamReset
from wire.mux_frames import DATA, GOAWAY, HEADER, OPEN, PING, PONG, RESET, WINDOW
from wire.tensors import Activation, TensorEntry


def connected(
    a_config: MuxConfig | None = None, b_config: MuxConfig | None = None
) -> tuple[Mux, Mux]:
    a = Mux(dialer=True, config=a_config)
    b = Mux(dialer=False, config=b_config)
    b.receive_data(a.data_to_send())
    a.receive_data(b.data_to_send())
    return a, b


def deliver(source: Mux, target: Mux) -> list[object]:
    return target.receive_data(source.data_to_send())


# ----- the delivery property


@dataclass
class Flow:
    """One direction of one stream: what is to be sent, what has arrived."""

    payload: bytes
    messages: list[Message]
    sent: int = 0
    ended: bool = False
    inbox: list[bytes] = field(default_factory=list)
    received: list[Message] = field(default_factory=list)
    decoder: MessageDecoder = field(default_factory=MessageDecoder)
    eof: bool = False


def random_messages(rng: random.Random, tiny_windows: bool) -> list[Message]:
    # Through windows of a few bytes every byte costs a round of credit, so
    # keep those messages short enough for the test to stay quick.
    text_sizes = [0, 10, 100] if tiny_windows else [0, 10, 1000]
    float_counts = [0, 1, 7, 40] if tiny_windows else [0, 1, 7, 576, 5000, 40_000]
    out: list[Message] = []
    for _ in range(rng.randint(0, 5)):
        if rng.random() < 0.5:
            text = "x" * rng.choice(text_sizes)
            out.append(ErrorMessage(code=ErrorCode.OVERLOADED, message=text))
        else:
            size = rng.choice(float_counts)
            array = np.frombuffer(rng.randbytes(size * 4), np.float32).reshape(1, size)
            entry = TensorEntry.from_array("hidden_states", array)
            out.append(
                Activation.of(session="s", epoch=0, step=0, pos=0, n_tokens=1, tensors=[entry])
            )
    return out


def run_schedule(seed: int, a_config: MuxConfig, b_config: MuxConfig, n_streams: int) -> None:
    rng = random.Random(seed)
    tiny_windows = (
        min(
            a_config.stream_window,
            b_config.stream_window,
            a_config.link_window,
            b_config.link_window,
        )
        < 1000
    )
    sides = {"a": Mux(dialer=True, config=a_config), "b": Mux(dialer=False, config=b_config)}
    other = {"a": "b", "b": "a"}
    wire = {"a": bytearray(), "b": bytearray()}  # bytes in flight from that side
    # flows[(side, stream_id)] = what ``side`` sends on that stream
    flows: dict[tuple[str, int], Flow] = {}
    for _ in range(n_streams):
        opener = rng.choice("ab")
        stream_id = sides[opener].open_stream("test")
        for side in (opener, other[opener]):
            messages = random_messages(rng, tiny_windows)
            flows[(side, stream_id)] = Flow(b"".join(encode(m) for m in messages), messages)
    opened = {"a": set(), "b": set()}
    for (side, stream_id), _ in flows.items():
        if (stream_id % 2 == 1) == (side == "a"):
            opened[side].add(stream_id)

    def done() -> bool:
        return all(f.ended and f.eof and not f.inbox for f in flows.values()) and not any(
            wire.values()
        )

    def stuck() -> bool:
        """Nothing left that any action could move: flow control deadlocked."""
        if any(wire.values()) or any(m.has_output for m in sides.values()):
            return False
        for (side, stream_id), flow in flows.items():
            if flow.inbox:
                return False
            if stream_id in opened[side] and not flow.ended:
                if flow.sent == len(flow.payload) or sides[side].send_capacity(stream_id):
                    return False
        return True

    steps = 0
    while True:
        # done and deadlocked are both states no action leaves: checking them every few steps finds
        # them as surely (the harness, not the mux, was most of this test's time when it checked each)
        if steps % 32 == 0:
            if done():
                break
            assert not stuck(), "flow control deadlocked"
        steps += 1
        action = rng.random()
        side = rng.choice("ab")
        mux = sides[side]
        if action < 0.35:
            candidates = [
                (sid, f)
                for (s, sid), f in flows.items()
                if s == side and sid in opened[side] and not f.ended
            ]
            if candidates:
                stream_id, flow = rng.choice(candidates)
                capacity = mux.send_capacity(stream_id)
                take = min(
                    capacity, len(flow.payload) - flow.sent, rng.choice([1, 100, 10_000, 1 << 20])
                )
                if rng.random() < 0.05:
                    with pytest.raises(ValueError):
                        mux.send_data(stream_id, b"\0" * (capacity + 1))
                end = flow.sent + take == len(flow.payload) and rng.random() < 0.5
                mux.send_data(stream_id, flow.payload[flow.sent : flow.sent + take], end=end)
                flow.sent += take
                flow.ended = end
        elif action < 0.7:
            wire[side] += mux.data_to_send()
            if wire[side]:
                size = rng.randint(1, len(wire[side]))
                chunk = bytes(wire[side][:size])
                del wire[side][:size]
                target = other[side]
                for event in sides[target].receive_data(chunk):
                    assert not isinstance(event, StreamReset), event
                    if isinstance(event, StreamOpened):
                        opened[target].add(event.stream_id)
                    elif isinstance(event, DataReceived):
                        flows[(side, event.stream_id)].inbox.append(bytes(event.data))
                    elif isinstance(event, StreamEnded):
                        flows[(side, event.stream_id)].eof = True
        else:
            candidates = [(sid, f) for (s, sid), f in flows.items() if s == other[side] and f.inbox]
            if candidates:
                stream_id, flow = rng.choice(candidates)
                chunk = flow.inbox.pop(0)
                cut = rng.randint(1, len(chunk))
                if cut < len(chunk):
                    flow.inbox.insert(0, chunk[cut:])
                flow.decoder.feed(chunk[:cut])
                while (message := flow.decoder.next_message()) is not None:
                    flow.received.append(message)
                mux.consumed(stream_id, cut)
    for flow in flows.values():
        assert flow.received == flow.messages
        assert flow.decoder.buffered == 0
    assert sides["a"].stream_count == sides["b"].stream_count == 0


configs = st.builds(
    MuxConfig,
    stream_window=st.sampled_from([1, 7, 1000, 65_536, 1 << 20]),
    link_window=st.sampled_from([1, 100, 50_000, 1 << 22]),
    max_frame=st.sampled_from([64, 100, 4096, 65_536]),
    max_streams=st.just(64),
)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), a_config=configs, b_config=configs, n_streams=st.integers(1, 6))
def test_every_message_arrives_intact_and_in_order_under_any_interleaving(
    seed: int, a_config: MuxConfig, b_config: MuxConfig, n_streams: int
) -> None:
    run_schedule(seed, a_config, b_config, n_streams)


# ----- flow control


def test_a_sender_never_exceeds_the_stream_window() -> None:
    a, b = connected(b_config=MuxConfig(stream_window=1000, link_window=10_000))
    stream_id = a.open_stream("x")
    assert a.send_capacity(stream_id) == 1000
    a.send_data(stream_id, b"x" * 1000)
    assert a.send_capacity(stream_id) == 0
    with pytest.raises(ValueError):
        a.send_data(stream_id, b"y")
    events = deliver(a, b)
    assert sum(len(e.data) for e in events if isinstance(e, DataReceived)) == 1000
    b.consumed(stream_id, 499)
    assert deliver(b, a) == []  # below half a window: no update yet
    b.consumed(stream_id, 1)
    assert deliver(b, a) == [CreditAvailable(stream_id)]
    assert a.send_capacity(stream_id) == 500


def test_the_link_window_bounds_all_streams_together() -> None:
    a, b = connected(b_config=MuxConfig(stream_window=1000, link_window=1500))
    first, second = a.open_stream("x"), a.open_stream("x")
    a.send_data(first, b"x" * 1000)
    assert a.send_capacity(second) == 500
    deliver(a, b)
    b.consumed(first, 1000)
    deliver(b, a)
    assert a.send_capacity(second) == 1000


def test_an_unread_stream_holds_only_its_own_window() -> None:
    a, b = connected(b_config=MuxConfig(stream_window=1000, link_window=4000))
    stalled, busy = a.open_stream("x"), a.open_stream("x")
    a.send_data(stalled, b"s" * 1000)
    deliver(a, b)
    for _ in range(20):
        a.send_data(busy, b"b" * 1000)
        events = deliver(a, b)
        assert [len(e.data) for e in events if isinstance(e, DataReceived)] == [1000]
        b.consumed(busy, 1000)
        deliver(b, a)
    assert a.send_capacity(stalled) == 0


def test_overrunning_a_stream_window_resets_only_that_stream() -> None:
    a, b = connected(b_config=MuxConfig(stream_window=100, link_window=10_000))
    bad, good = a.open_stream("x"), a.open_stream("x")
    deliver(a, b)
    forged = HEADER.pack(DATA, 0, bad, 101) + b"x" * 101
    events = b.receive_data(forged + HEADER.pack(DATA, 0, good, 5) + b"hello")
    assert isinstance(events[0], StreamReset) and events[0].stream_id == bad
    assert events[1] == DataReceived(good, memoryview(b"hello"))
    reply = a.receive_data(b.data_to_send())
    assert [type(e) for e in reply] == [StreamReset]
    assert reply[0].error.code is ErrorCode.BAD_REQUEST and reply[0].remote
    a.send_data(good, b" again")
    assert [bytes(e.data) for e in deliver(a, b)] == [b" again"]


def test_data_after_the_end_resets_the_stream() -> None:
    a, b = connected()
    stream_id = a.open_stream("x")
    a.send_data(stream_id, b"bye", end=True)
    deliver(a, b)
    events = b.receive_data(HEADER.pack(DATA, 0, stream_id, 1) + b"!")
    assert isinstance(events[0], StreamReset)


# ----- streams


def test_stream_ids_follow_the_openers_parity() -> None:
    a, b = connected()
    assert [a.open_stream("x") for _ in range(3)] == [1, 3, 5]
    assert [b.open_stream("x") for _ in range(3)] == [2, 4, 6]
    events = deliver(a, b)
    assert [e.stream_id for e in events] == [1, 3, 5]
    assert all(isinstance(e, StreamOpened) and e.protocol == "x" for e in events)


def test_large_messages_are_fragmented_into_frames_and_reassembled() -> None:
    a, b = connected(b_config=MuxConfig(max_frame=4096))
    stream_id = a.open_stream("x")
    payload = bytes(range(256)) * 1000
    a.send_data(stream_id, payload, end=True)
    wire = a.data_to_send()
    frames = []
    offset = 0
    while offset < len(wire):
        kind, _, _, length = HEADER.unpack_from(wire, offset)
        frames.append((kind, length))
        offset += HEADER.size + length
    assert all(length <= 4096 for kind, length in frames if kind == DATA)
    assert len([f for f in frames if f[0] == DATA]) == -(-len(payload) // 4096)
    events = b.receive_data(wire)
    assert b"".join(bytes(e.data) for e in events if isinstance(e, DataReceived)) == payload
    assert isinstance(events[-1], StreamEnded)


def test_concurrent_streams_are_capped_on_both_sides() -> None:
    a, b = connected(b_config=MuxConfig(max_streams=2))
    a.open_stream("x")
    a.open_stream("x")
    with pytest.raises(ProtocolError) as info:
        a.open_stream("x")
    assert info.value.code is ErrorCode.OVERLOADED
    # A peer that ignores the cap gets the excess stream refused.
    _, b2 = connected(b_config=MuxConfig(max_streams=1))
    forged = HEADER.pack(OPEN, 0, 1, 1) + b"x" + HEADER.pack(OPEN, 0, 3, 1) + b"x"
    events = b2.receive_data(forged)
    assert [type(e) for e in events] == [StreamOpened]
    kind, _, stream_id, _ = HEADER.unpack_from(b2.data_to_send())
    assert (kind, stream_id) == (RESET, 3)


def test_streams_close_when_both_sides_end_and_ids_are_not_reused() -> None:
    a, b = connected()
    stream_id = a.open_stream("x")
    a.end_stream(stream_id)
    deliver(a, b)
    b.end_stream(stream_id)
    assert deliver(b, a) == [StreamEnded(stream_id)]
    assert not a.is_open(stream_id) and not b.is_open(stream_id)
    with pytest.raises(ProtocolError, match=r"^BAD_REQUEST: peer reopened stream 1$"):
        b.receive_data(HEADER.pack(OPEN, 0, stream_id, 1) + b"x")


def test_reset_reaches_the_peer_with_its_code_and_reason() -> None:
    a, b = connected()
    stream_id = a.open_stream("x")
    deliver(a, b)
    b.reset_stream(stream_id, ProtocolError(ErrorCode.EPOCH_STALE, "epoch 3 < 4"))
    [event] = deliver(b, a)
    assert isinstance(event, StreamReset) and event.remote
    assert (event.error.code, event.error.message) == (ErrorCode.EPOCH_STALE, "epoch 3 < 4")
    assert not a.is_open(stream_id)


def test_a_long_non_ascii_reason_is_cut_but_still_delivered() -> None:
    a, b = connected()
    stream_id = a.open_stream("x")
    deliver(a, b)
    b.reset_stream(stream_id, ProtocolError(ErrorCode.NOT_FOUND, "é" * 2000))
    [event] = deliver(b, a)
    assert isinstance(event, StreamReset) and event.error.code is ErrorCode.NOT_FOUND
    assert event.error.message.startswith("é" * 500)


def test_ping_returns_a_pong_with_the_send_time() -> None:
    a, b = connected()
    a.send_ping(12.5)
    deliver(a, b)
    assert deliver(b, a) == [PongReceived(12.5)]


def test_goaway_refuses_new_streams_and_resets_unprocessed_ones() -> None:
    a, b = connected()
    early = a.open_stream("x")
    deliver(a, b)
    late = a.open_stream("x")  # in flight when b says goodbye
    b.goaway(ProtocolError(ErrorCode.UNREACHABLE, "shutting down"))
    events = deliver(b, a)
    assert isinstance(events[0], GoAwayReceived) and events[0].last_stream_id == early
    assert [e.stream_id for e in events if isinstance(e, StreamReset)] == [late]
    with pytest.raises(ProtocolError, match=r"^UNREACHABLE: peer is going away: shutting down$"):
        a.open_stream("x")
    assert a.is_open(early)


# ----- link errors and fuzzing


@pytest.mark.parametrize(
    "frame",
    [
        HEADER.pack(99, 0, 0, 0),  # unknown type
        HEADER.pack(DATA, 0, 1, 1 << 30),  # longer than max_frame
        HEADER.pack(WINDOW, 0, 0, 4) + struct.pack(">I", 0),  # zero increment
        HEADER.pack(DATA, 0x80, 1, 0),  # unknown flag
        HEADER.pack(DATA, 0, 7, 1) + b"x",  # never opened
        HEADER.pack(OPEN, 0, 1, 1) + b"x",  # our own parity
    ],
)
def test_a_malformed_frame_is_a_typed_link_error_with_a_goaway(frame: bytes) -> None:
    a, b = connected()
    with pytest.raises(ProtocolError) as info:
        a.receive_data(frame)
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert a.error is info.value
    events = b.receive_data(a.data_to_send())
    assert isinstance(events[0], GoAwayReceived)
    assert events[0].error.message == info.value.message
    with pytest.raises(ProtocolError) as again:  # the link stays failed, for the reason it failed
        a.open_stream("x")
    assert again.value is info.value


def test_frames_before_settings_are_a_link_error() -> None:
    b = Mux(dialer=False)
    with pytest.raises(ProtocolError, match=r"^BAD_REQUEST: frame type 1 before SETTINGS$"):
        b.receive_data(HEADER.pack(OPEN, 0, 1, 1) + b"x")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_give_only_typed_errors(data: bytes) -> None:
    a, _ = connected()
    try:
        a.receive_data(data)
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)


def test_mutated_traffic_gives_only_typed_errors() -> None:
    rng = random.Random(11)
    for _ in range(400):
        a, b = connected(b_config=MuxConfig(stream_window=5000))
        streams = [a.open_stream("p") for _ in range(3)]
        for stream_id in streams:
            a.send_data(stream_id, rng.randbytes(rng.randint(0, 3000)), end=rng.random() < 0.5)
        a.send_ping(1.0)
        wire = bytearray(a.data_to_send())
        for _ in range(rng.randint(1, 3)):
            wire[rng.randrange(len(wire))] = rng.randrange(256)
        try:
            b.receive_data(bytes(wire))
            b.data_to_send()
        except ProtocolError as exc:
            assert isinstance(exc.code, ErrorCode)


# ----- what a peer can make us queue or hold


def frames(data: bytes) -> list[tuple[int, int]]:
    """(type, stream id) of each frame in ``data``."""
    out = []
    offset = 0
    while offset < len(data):
        kind, _, stream_id, length = HEADER.unpack_from(data, offset)
        out.append((kind, stream_id))
        offset += HEADER.size + length
    return out


def ping(n: int) -> bytes:
    return HEADER.pack(PING, 0, 0, 8) + struct.pack(">Q", n)


def test_pings_beyond_the_budget_go_unanswered_until_the_next_tick() -> None:
    _, b = connected(b_config=MuxConfig(max_pongs=3, ping_flood=10))
    b.receive_data(b"".join(ping(n) for n in range(8)))
    assert [k for k, _ in frames(b.data_to_send())] == [PONG] * 3
    b.handle_timer(1.0)
    b.receive_data(ping(9))
    assert [k for k, _ in frames(b.data_to_send())] == [PONG]


def test_a_ping_flood_ends_the_link() -> None:
    """A peer that pings and never reads (CVE-2019-9512) makes us queue a
    bounded number of PONGs, then loses the link."""
    _, b = connected(b_config=MuxConfig(max_pongs=3, ping_flood=10))
    with pytest.raises(ProtocolError) as info:
        b.receive_data(b"".join(ping(n) for n in range(1000)))
    assert info.value.code is ErrorCode.OVERLOADED and "PING flood" in info.value.message
    assert frames(b.data_to_send()) == [(GOAWAY, 0)]


def test_keepalive_pings_of_an_honest_peer_are_always_answered() -> None:
    a, b = connected()
    for tick in range(100):
        a.send_ping(float(tick))
        deliver(a, b)
        b.send_ping(float(tick))
        assert PongReceived(float(tick)) in deliver(b, a)
        deliver(a, b)


def test_a_flood_of_refused_opens_ends_the_link() -> None:
    """CVE-2019-9514: every refused OPEN queues a RESET for the peer."""
    _, b = connected(b_config=MuxConfig(max_streams=0, reset_flood=20))
    opens = b"".join(HEADER.pack(OPEN, 0, 2 * n + 1, 1) + b"x" for n in range(100))
    with pytest.raises(ProtocolError) as info:
        b.receive_data(opens)
    assert "RESET flood" in info.value.message
    sent = frames(b.data_to_send())
    assert sent[-1] == (GOAWAY, 0) and len(sent) == 1


def test_a_flood_of_opens_the_application_resets_ends_the_link() -> None:
    _, b = connected(b_config=MuxConfig(reset_flood=5))
    with pytest.raises(ProtocolError, match=r"^OVERLOADED: RESET flood \(6 refused or reset streams in one interval\)$"):
        for n in range(20):
            (event,) = b.receive_data(HEADER.pack(OPEN, 0, 2 * n + 1, 7) + b"unknown")
            assert isinstance(event, StreamOpened)
            b.reset_stream(event.stream_id, ProtocolError(ErrorCode.NOT_FOUND, "no handler"))
    assert b.error is not None and "RESET flood" in b.error.message


def test_resets_from_the_peer_count_towards_the_flood() -> None:
    a, b = connected(b_config=MuxConfig(reset_flood=5))
    with pytest.raises(ProtocolError, match=r"^OVERLOADED: RESET flood \(6 refused or reset streams in one interval\)$"):
        for _ in range(10):
            stream_id = a.open_stream("x")
            a.reset_stream(stream_id, ProtocolError(ErrorCode.CANCELLED, "never mind"))
            deliver(a, b)
    assert b.error is not None and "RESET flood" in b.error.message


def fill(sender: Mux, receiver: Mux, stream_ids: list[int], chunk: bytes, hold: bool) -> int:
    """Send until no credit is left, the receiver consuming (and holding) everything."""
    sent = 0
    for _ in range(10_000):
        moved = False
        for stream_id in stream_ids:
            room = sender.send_capacity(stream_id)
            if room:
                sender.send_data(stream_id, chunk[:room])
                sent += min(room, len(chunk))
                moved = True
        for event in deliver(sender, receiver):
            if isinstance(event, DataReceived):
                receiver.consumed(event.stream_id, len(event.data))
                if hold:
                    receiver.set_held(event.stream_id, receiver_held(receiver, event.stream_id) + len(event.data))
        deliver(receiver, sender)
        if not moved:
            return sent
    raise AssertionError("credit never ran out")


def receiver_held(mux: Mux, stream_id: int) -> int:
    return mux._streams[stream_id].held


HOLD = MuxConfig(stream_window=256 << 10, link_window=1 << 20, max_held=2 << 20)


def test_bytes_held_in_unfinished_messages_are_bounded_per_link() -> None:
    """8 streams of never-finished messages: the peer can make us keep at most
    the link window plus the held budget (and one frame: the application reports
    what it holds just after it consumed it), not a stream window per stream forever."""
    a, b = connected(b_config=HOLD)
    streams = [a.open_stream("x") for _ in range(8)]
    sent = fill(a, b, streams, bytes(64 << 10), hold=True)
    assert HOLD.max_held <= sent <= HOLD.link_window + HOLD.max_held + HOLD.max_frame
    assert b.held == sent
    # the messages finish: the held credit comes back and data flows again
    for stream_id in streams:
        b.set_held(stream_id, 0)
    deliver(b, a)
    assert a.send_capacity(streams[0]) > 0


def test_without_holding_credit_keeps_flowing() -> None:
    a, b = connected(b_config=HOLD)
    stream_id = a.open_stream("x")
    sent = 0
    for _ in range(100):
        room = a.send_capacity(stream_id)
        assert room > 0
        a.send_data(stream_id, bytes(room))
        sent += room
        for event in deliver(a, b):
            if isinstance(event, DataReceived):
                b.consumed(stream_id, len(event.data))
        deliver(b, a)
    assert sent > HOLD.link_window + HOLD.max_held


def test_one_message_up_to_the_budget_completes() -> None:
    a, b = connected(b_config=HOLD)
    stream_id = a.open_stream("x")
    message = HOLD.max_held + HOLD.link_window // 2
    sent = 0
    for _ in range(10_000):
        room = min(a.send_capacity(stream_id), message - sent)
        if sent == message:
            break
        assert room > 0, f"stalled after {sent} of {message} bytes"
        a.send_data(stream_id, bytes(room))
        sent += room
        for event in deliver(a, b):
            if isinstance(event, DataReceived):
                b.consumed(stream_id, len(event.data))
                b.set_held(stream_id, receiver_held(b, stream_id) + len(event.data))
        deliver(b, a)
    assert sent == message


def test_the_node_budget_is_shared_by_its_links_and_freed_when_a_link_ends() -> None:
    budget = HeldBudget(1 << 20)
    first_sender, first = connected(b_config=HOLD)
    second_sender, second = connected(b_config=HOLD)
    first.node_budget = second.node_budget = budget
    one = [first_sender.open_stream("x") for _ in range(4)]
    two = [second_sender.open_stream("x") for _ in range(4)]
    sent = fill(first_sender, first, one, bytes(64 << 10), hold=True)
    sent += fill(second_sender, second, two, bytes(64 << 10), hold=True)
    assert sent <= 2 * (HOLD.link_window + HOLD.max_frame) + budget.limit
    assert budget.held == first.held + second.held == sent
    first.release_held()
    assert budget.held == second.held
    # a reset stream holds nothing any more
    second.reset_stream(two[0], ProtocolError(ErrorCode.CANCELLED, "gone"))
    assert budget.held == second.held < sent
