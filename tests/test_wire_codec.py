"""Message framing: round trips, hard bounds, typed errors on hostile bytes."""

from __future__ import annotations

import random
import struct
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.codec import MessageDecoder
from wire.decode import decode
from wire.errors import ErrorCode, ProtocolError
from wire.limits import Limits
from wire.message import ErrorMessage, Message, encode, error_from_message, error_message
from wire.tensors import Activation, TensorEntry

FAST = settings(max_examples=100, deadline=None)


def frame(obj: object) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def decode_chunked(data: bytes, cuts: list[int]) -> list[Message]:
    decoder = MessageDecoder()
    out = []
    start = 0
    for cut in sorted(cuts) + [len(data)]:
        decoder.feed(data[start:cut])
        start = max(start, cut)
        while (message := decoder.next_message()) is not None:
            out.append(message)
    assert decoder.buffered == 0
    return out


error_messages = st.builds(
    ErrorMessage,
    code=st.sampled_from(list(ErrorCode)),
    message=st.text(max_size=200),
    retry_after_ms=st.none() | st.integers(0, 86_400_000),
)


@FAST
@given(st.lists(error_messages, max_size=8), st.lists(st.integers(0, 4000), max_size=12))
def test_messages_survive_any_chunking(messages: list[ErrorMessage], cuts: list[int]) -> None:
    data = b"".join(encode(m) for m in messages)
    cuts = [c % (len(data) + 1) for c in cuts]
    assert decode_chunked(data, cuts) == messages


def test_protocol_error_round_trips_through_the_error_message() -> None:
    error = ProtocolError(ErrorCode.OVERLOADED, "busy", retry_after_ms=250)
    back = error_from_message(decode(encode(error_message(error))))  # type: ignore[arg-type]
    assert (back.code, back.message, back.retry_after_ms, back.retryable) == (
        ErrorCode.OVERLOADED,
        "busy",
        250,
        True,
    )


def test_oversized_length_prefix_is_refused_before_any_allocation() -> None:
    decoder = MessageDecoder(Limits(max_message_bytes=1 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as info:
            decoder.feed(struct.pack(">I", 0xFFFFFFFF))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert "exceeds the limit" in info.value.message
    assert peak < 64 << 10
    with pytest.raises(ProtocolError, match=r"^BAD_REQUEST: message of 4294967295 bytes exceeds the limit"):
        decoder.feed(b"more")  # the decoder stays failed


def test_message_after_an_oversized_prefix_is_still_delivered_first() -> None:
    decoder = MessageDecoder(Limits(max_message_bytes=1000))
    good = encode(ErrorMessage(code=ErrorCode.INTERNAL, message="x"))
    decoder.feed(good + struct.pack(">I", 5000))
    assert decoder.next_message() == ErrorMessage(code=ErrorCode.INTERNAL, message="x")
    with pytest.raises(ProtocolError, match=r"^BAD_REQUEST: message of 5000 bytes exceeds the limit of 1000$"):
        decoder.next_message()


@pytest.mark.parametrize(
    ("obj", "fragment"),
    [
        ({"type": "nonesuch", "v": 1}, "unknown message type"),
        ({"type": "error", "v": 99, "code": "INTERNAL", "message": ""}, "unsupported version"),
        ({"v": 1}, "string 'type'"),
        ([1, 2, 3], "must be a msgpack map"),
        ({"type": "error", "v": 1, "code": "INTERNAL"}, "message: Field required"),
        ({"type": "error", "v": 1, "code": "NOPE", "message": ""}, "code"),
        ({"type": "error", "v": 1, "code": "INTERNAL", "message": "", "extra": 1}, "extra"),
        ({"type": "error", "v": True, "code": "INTERNAL", "message": ""}, "int 'v'"),
    ],
)
def test_invalid_messages_are_typed_bad_requests(obj: object, fragment: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(frame(obj))
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert fragment in info.value.message


def test_ext_types_are_refused() -> None:
    body = msgpack.packb({"type": "error", "v": 1, "x": msgpack.ExtType(5, b"abc")})
    with pytest.raises(ProtocolError, match="ext"):
        decode(struct.pack(">I", len(body)) + body)


def test_deep_nesting_is_refused_without_recursion() -> None:
    valid = msgpack.packb({"type": "error", "v": 1, "code": "INTERNAL", "message": ""})
    assert valid[0] == 0x84
    for depth in (50, 5000, 200_000):
        # The same map with a fifth entry, "x", nested ``depth`` arrays deep.
        body = b"\x85" + valid[1:] + b"\xa1x" + b"\x91" * depth + b"\x00"
        with pytest.raises(ProtocolError) as info:
            decode(struct.pack(">I", len(body)) + body)
        assert info.value.code is ErrorCode.BAD_REQUEST


def test_collection_and_string_headers_over_the_schema_are_refused() -> None:
    head = msgpack.packb({"type": "error", "v": 1})[1:]
    huge_array = b"\xdd\xff\xff\xff\xff"  # array32 claiming 4 billion items
    huge_map = b"\xdf\xff\xff\xff\xff"
    huge_str = b"\xdb\xff\xff\xff\xff"
    for value in (huge_array, huge_map, huge_str, msgpack.packb(["x"]), msgpack.packb("y" * 4097)):
        body = b"\x83" + head + b"\xa7message" + value
        with pytest.raises(ProtocolError) as info:
            decode(struct.pack(">I", len(body)) + body)
        assert info.value.code is ErrorCode.BAD_REQUEST


def test_length_prefix_must_match_the_bytes_that_follow() -> None:
    data = encode(ErrorMessage(code=ErrorCode.INTERNAL, message="x"))
    for broken in (data[:-1], data + b"\x00", data[:3]):
        with pytest.raises(ProtocolError,
                           match=r"^BAD_REQUEST: (length prefix says \d+ bytes but \d+ follow|truncated length prefix)$"):
            decode(broken)


def test_registering_the_same_type_twice_is_an_error() -> None:
    with pytest.raises(ValueError, match="already registered"):

        class Imposter(Message, tag="error"):
            pass


def _expect_only_protocol_errors(data: bytes, limits: Limits) -> None:
    decoder = MessageDecoder(limits)
    try:
        decoder.feed(data)
        while decoder.next_message() is not None:
            pass
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000))
def test_random_bytes_give_only_typed_errors(data: bytes) -> None:
    _expect_only_protocol_errors(data, Limits(max_message_bytes=1 << 16))


def test_mutated_messages_give_only_typed_errors() -> None:
    rng = random.Random(3)
    samples = [
        encode(ErrorMessage(code=ErrorCode.OVERLOADED, message="slow down", retry_after_ms=5)),
        encode(
            Activation(
                session="s",
                epoch=1,
                step=2,
                pos=3,
                n_tokens=2,
                tensors=[TensorEntry.from_array("hidden_states", np.ones((2, 8), np.float32))],
                tokens=[1, 2],
            )
        ),
    ]
    for _ in range(3000):
        data = bytearray(rng.choice(samples))
        for _ in range(rng.randint(1, 4)):
            action = rng.random()
            position = rng.randrange(len(data))
            if action < 0.6:
                data[position] = rng.randrange(256)
            elif action < 0.8:
                del data[position : position + rng.randint(1, 8)]
            else:
                data[position:position] = rng.randbytes(rng.randint(1, 8))
        _expect_only_protocol_errors(bytes(data), Limits(max_message_bytes=1 << 16))
