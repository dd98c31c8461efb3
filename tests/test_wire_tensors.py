"""The named-tensor envelope: exactness, error bounds, and checks before decompression."""

from __future__ import annotations

import random
import struct

import crc32c
import msgpack
import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from wire.codec import MessageDecoder
from wire.decode import decode
from wire.errors import ErrorCode, ProtocolError
from wire.limits import Limits
from wire.message import encode
from wire.tensors import Activation, TensorEntry, encode_activation, tensor_fields, wire_size

FAST = settings(max_examples=60, deadline=None)

shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=20)
codecs = st.sampled_from(["raw", "zstd"])


def through_the_wire(entry: TensorEntry) -> np.ndarray:
    message = Activation(session="s", epoch=0, step=0, pos=0, n_tokens=1, tensors=[entry])
    received = decode(encode(message))
    assert isinstance(received, Activation)
    return received.array("t")


@FAST
@given(shape=shapes, codec=codecs, data=st.data())
def test_f32_is_bit_exact_for_any_shape_and_codec(
    shape: tuple[int, ...], codec: str, data: st.DataObject
) -> None:
    # Arbitrary bit patterns, NaN payloads and signed zeros included.
    bits = data.draw(hnp.arrays(np.uint32, shape))
    array = bits.view(np.float32)
    out = through_the_wire(TensorEntry.from_array("t", array, "f32", codec))  # type: ignore[arg-type]
    assert out.dtype == np.float32 and out.shape == array.shape
    assert np.array_equal(out.view(np.uint32), bits)


@FAST
@given(shape=shapes, codec=codecs, data=st.data())
def test_f16_is_exact_for_float16_input(
    shape: tuple[int, ...], codec: str, data: st.DataObject
) -> None:
    bits = data.draw(hnp.arrays(np.uint16, shape))
    array = bits.view(np.float16)
    out = through_the_wire(TensorEntry.from_array("t", array, "f16", codec))  # type: ignore[arg-type]
    assert out.dtype == np.float16
    assert np.array_equal(out.view(np.uint16), bits)


@FAST
@given(shape=shapes, codec=codecs, data=st.data())
def test_bf16_is_exact_for_bf16_values_and_rounds_to_nearest_otherwise(
    shape: tuple[int, ...], codec: str, data: st.DataObject
) -> None:
    finite = st.floats(-(2.0**126), 2.0**126, width=32)
    array = data.draw(hnp.arrays(np.float32, shape, elements=finite))
    out = through_the_wire(TensorEntry.from_array("t", array, "bf16", codec))  # type: ignore[arg-type]
    assert out.dtype == np.float32 and out.shape == array.shape
    # Half a unit in the last of bf16's 8 significant bits; subnormals keep
    # bf16's absolute spacing of 2**-133.
    assert np.all(np.abs(out - array) <= np.maximum(np.abs(array) * 2.0**-8, 2.0**-133))
    again = through_the_wire(TensorEntry.from_array("t", out, "bf16", codec))  # type: ignore[arg-type]
    assert np.array_equal(again.view(np.uint32), out.view(np.uint32))


def test_bf16_keeps_nan_and_infinity() -> None:
    array = np.array([np.nan, np.inf, -np.inf, -0.0], np.float32)
    out = through_the_wire(TensorEntry.from_array("t", array, "bf16"))
    assert np.isnan(out[0]) and out[1] == np.inf and out[2] == -np.inf
    assert np.signbit(out[3])


@FAST
@given(shape=shapes, codec=codecs, data=st.data())
def test_q8_0_error_is_within_half_a_step_per_block(
    shape: tuple[int, ...], codec: str, data: st.DataObject
) -> None:
    array = data.draw(hnp.arrays(np.float32, shape, elements=st.floats(-1e5, 1e5, width=32)))
    out = through_the_wire(TensorEntry.from_array("t", array, "q8_0", codec))  # type: ignore[arg-type]
    assert out.dtype == np.float32 and out.shape == array.shape
    flat = array.reshape(-1)
    padded = np.concatenate([flat, np.zeros(-len(flat) % 32, np.float32)]).reshape(-1, 32)
    amax = np.abs(padded).max(axis=1, initial=0).astype(np.float64)
    step = (amax / 127).astype(np.float16).astype(np.float64)
    # Half a step of the stored scale, plus whatever clipping at ±127 steps
    # loses when float16 rounded the scale down (all of it if it underflowed).
    bound = step / 2 + np.abs(amax - 127 * step) + 1e-12
    error = np.abs(out.reshape(-1).astype(np.float64) - flat)
    assert np.all(error <= np.repeat(bound, 32)[: len(flat)])


def test_q8_0_refuses_magnitudes_its_scale_cannot_hold() -> None:
    with pytest.raises(ValueError):
        TensorEntry.from_array("t", np.array([1e7], np.float32), "q8_0")


def test_q8_0_uses_ggml_block_layout() -> None:
    values = np.arange(32, dtype=np.float32) - 16  # max |x| = 16
    entry = TensorEntry.from_array("t", values, "q8_0")
    assert len(entry.data) == 34
    (scale,) = struct.unpack("<e", entry.data[:2])
    assert scale == np.float16(16 / 127)
    quants = np.frombuffer(entry.data[2:], np.int8)
    assert quants[0] == -127 and quants[-1] == round(15 * 127 / 16)


def test_q8_0_refuses_non_finite_input() -> None:
    with pytest.raises(ValueError):
        TensorEntry.from_array("t", np.array([1.0, np.nan], np.float32), "q8_0")


def test_decode_size_activation_is_validated_end_to_end() -> None:
    hidden = np.random.default_rng(0).standard_normal((1, 576), dtype=np.float32)
    built = Activation.of(
        session="abc",
        epoch=3,
        step=9,
        pos=41,
        n_tokens=1,
        tensors=[TensorEntry.from_array("hidden_states", hidden)],
        tokens=np.array([7]),
        deadline_ms=500,
    )
    validated = Activation(
        session="abc",
        epoch=3,
        step=9,
        pos=41,
        n_tokens=1,
        tensors=[TensorEntry.from_array("hidden_states", hidden)],
        tokens=[7],
        deadline_ms=500,
    )
    assert encode(built) == encode(validated)
    received = decode(encode(built))
    assert received == validated
    assert np.array_equal(received.array("hidden_states"), hidden)  # type: ignore[attr-defined]
    with pytest.raises(ProtocolError) as info:
        received.array("logits")  # type: ignore[attr-defined]
    assert info.value.code is ErrorCode.BAD_REQUEST


def wire_tensor(**overrides: object) -> dict[str, object]:
    data = np.ones(8, np.float32).tobytes()
    tensor: dict[str, object] = {
        "name": "hidden_states",
        "dtype": "f32",
        "shape": [2, 4],
        "codec": "raw",
        "crc32c": crc32c.crc32c(data),
        "data": data,
    }
    tensor.update(overrides)
    return tensor


def activation_bytes(*tensors: dict[str, object]) -> bytes:
    body = msgpack.packb(
        {
            "type": "activation",
            "v": 1,
            "session": "s",
            "epoch": 0,
            "step": 0,
            "pos": 0,
            "n_tokens": 2,
            "tensors": list(tensors),
        }
    )
    return struct.pack(">I", len(body)) + body


def refused(data: bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        message = decode(data)
        for tensor in message.tensors:  # type: ignore[attr-defined]
            tensor.to_array()
    return info.value


def test_a_well_formed_wire_tensor_is_accepted() -> None:
    message = decode(activation_bytes(wire_tensor()))
    assert message.array().shape == (2, 4)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "overrides",
    [
        {"shape": [2, 5]},
        {"shape": [3]},
        {"dtype": "f16"},
        {"dtype": "q8_0"},
        {"shape": [1 << 30, 1 << 30]},
        {"shape": [-1, 8]},
        {"shape": [1] * 9},
        {"dtype": "f64"},
        {"codec": "lz4"},
        {"name": ""},
    ],
)
def test_shape_dtype_and_length_must_agree(overrides: dict[str, object]) -> None:
    assert refused(activation_bytes(wire_tensor(**overrides))).code is ErrorCode.BAD_REQUEST


def test_crc_mismatch_is_payload_corrupt() -> None:
    error = refused(activation_bytes(wire_tensor(crc32c=1234)))
    assert error.code is ErrorCode.PAYLOAD_CORRUPT


def test_duplicate_tensor_names_are_refused() -> None:
    assert refused(activation_bytes(wire_tensor(), wire_tensor())).code is ErrorCode.BAD_REQUEST


def zstd_tensor(raw: bytes, shape: list[int], **compress: object) -> dict[str, object]:
    data = zstandard.ZstdCompressor(**compress).compress(raw)  # type: ignore[arg-type]
    return wire_tensor(codec="zstd", shape=shape, data=data, crc32c=crc32c.crc32c(data))


def test_zstd_frame_must_declare_the_size_the_shape_implies() -> None:
    raw = np.ones(8, np.float32).tobytes()
    assert decode(activation_bytes(zstd_tensor(raw, [2, 4]))).array().shape == (2, 4)  # type: ignore[attr-defined]
    # A bomb: a few bytes that would expand to 64 MiB under a tiny shape.
    bomb = zstd_tensor(bytes(64 << 20), [2, 4])
    assert len(bomb["data"]) < 10_000  # type: ignore[arg-type]
    assert refused(activation_bytes(bomb)).code is ErrorCode.BAD_REQUEST
    no_size = zstd_tensor(raw, [2, 4], write_content_size=False)
    assert refused(activation_bytes(no_size)).code is ErrorCode.BAD_REQUEST


def test_wire_size_matches_what_from_array_produces() -> None:
    for dtype in ("f32", "f16", "bf16", "q8_0"):
        for count in (0, 1, 31, 32, 33, 576):
            entry = TensorEntry.from_array("t", np.zeros(count, np.float32), dtype)  # type: ignore[arg-type]
            assert len(entry.data) == wire_size(dtype, count)  # type: ignore[arg-type]


def test_mutated_activations_give_only_typed_errors() -> None:
    rng = random.Random(5)
    entries = [
        TensorEntry.from_array("hidden_states", np.ones((2, 40), np.float32), dtype, codec)  # type: ignore[arg-type]
        for dtype in ("f32", "f16", "bf16", "q8_0")
        for codec in ("raw", "zstd")
    ]
    samples = [
        encode(Activation(session="s", epoch=0, step=0, pos=0, n_tokens=2, tensors=[entry]))
        for entry in entries
    ]
    for _ in range(3000):
        data = bytearray(rng.choice(samples))
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        decoder = MessageDecoder(Limits(max_message_bytes=1 << 16))
        try:
            decoder.feed(bytes(data))
            message = decoder.next_message()
            if message is not None:
                for tensor in message.tensors:  # type: ignore[attr-defined]
                    tensor.to_array()
        except ProtocolError as exc:
            assert isinstance(exc.code, ErrorCode)


@FAST
@given(
    shape=shapes,
    dtype=st.sampled_from(["f32", "f16", "bf16"]),
    codec=codecs,
    tokens=st.none() | st.lists(st.integers(0, 1 << 20), max_size=5),
    deadline=st.none() | st.integers(0, 1 << 20),
    data=st.data(),
)
def test_encoding_an_activation_without_models_gives_the_model_s_bytes(
    shape: tuple[int, ...],
    dtype: str,
    codec: str,
    tokens: list[int] | None,
    deadline: int | None,
    data: st.DataObject,
) -> None:
    array = data.draw(hnp.arrays(np.float32, shape, elements=st.floats(-1e4, 1e4, width=32)))
    header = dict(session="s", epoch=3, step=7, pos=11, n_tokens=2, tokens=tokens, deadline_ms=deadline)
    model = Activation.of(**header, tensors=[TensorEntry.from_array("t", array, dtype, codec)])  # type: ignore[arg-type]
    direct = encode_activation(**header, tensors=[tensor_fields("t", array, dtype, codec)])  # type: ignore[arg-type]
    assert direct == encode(model)
    assert decode(direct) == model
