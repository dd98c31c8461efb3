"""The named-tensor envelope: numpy arrays on the wire, and the activation message.

A tensor travels as ``{name, dtype, shape, codec, crc32c, data}``. ``data`` is
the little-endian element bytes, optionally zstd-compressed; ``crc32c`` covers
``data`` exactly as carried, so corruption is caught before decompression.
Validation checks that shape × dtype matches the byte length (for zstd, the
frame's declared content size) before anything is decompressed or viewed.

dtypes: ``f32`` (exact), ``f16``, ``bf16`` (decoded widened to float32) and
``q8_0``: ggml's Q8_0 layout, blocks of 32 values each stored as one float16
scale ``d = max|x| / 127`` followed by 32 int8 ``round(x / d)``; the error is
at most half a step ``d`` per value (plus the scale's float16 rounding). A
tensor whose size is not a multiple of 32 has its last block zero-padded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import crc32c as _crc32c
import numpy as np
import zstandard
from pydantic import Field, model_validator

from wire.errors import ErrorCode, ProtocolError
from wire.message import Message, WireModel, encode
from wire.receipt import Chain
from wire.types import Count, Epoch, Int32, SessionId, TokenIds, Tokens

TensorDType = Literal["f32", "f16", "bf16", "q8_0"]
TensorCodec = Literal["raw", "zstd"]

MAX_TENSOR_BYTES = 256 << 20
MAX_DIMS = 8
MAX_TENSORS = 16
# drafted tokens one speculative step may carry: each is a row every stage runs
MAX_DRAFT = 16
Q8_BLOCK = 32
_Q8_BLOCK_BYTES = 2 + Q8_BLOCK
# dtype objects, not strings: numpy parses a string on every call.
_F32 = np.dtype("<f4")
_F16 = np.dtype("<f2")
_U16 = np.dtype("<u2")
_U32 = np.dtype("<u4")
_I32 = np.dtype("<i4")
_Q8_DTYPE = np.dtype([("d", _F16), ("qs", "i1", (Q8_BLOCK,))])
_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}
_Q8_MAX = 127.0 * 65504.0  # beyond this the float16 scale overflows

_crc = _crc32c.crc32c
_zstd_decompressor = zstandard.ZstdDecompressor()
_zstd_compressors: dict[int, zstandard.ZstdCompressor] = {}

Dim = Int32


def wire_size(dtype: TensorDType, count: int) -> int:
    """Bytes that ``count`` elements of ``dtype`` take on the wire before compression."""
    if dtype == "q8_0":
        return -(-count // Q8_BLOCK) * _Q8_BLOCK_BYTES
    return count * _ITEMSIZE[dtype]


def _compress_bound(size: int) -> int:
    # zstd's ZSTD_COMPRESSBOUND, with slack for the frame header.
    return size + (size >> 8) + (((128 << 10) - size) >> 11 if size < (128 << 10) else 0) + 64


class TensorEntry(WireModel):
    """One named tensor inside a message."""

    name: str = Field(min_length=1, max_length=64)
    dtype: TensorDType
    shape: list[Dim] = Field(max_length=MAX_DIMS)
    codec: TensorCodec
    crc32c: int = Field(ge=0, le=0xFFFFFFFF)
    data: bytes = Field(max_length=_compress_bound(MAX_TENSOR_BYTES))

    @model_validator(mode="after")
    def _check_payload(self) -> TensorEntry:
        # Runs on untrusted input; entries built by from_array skip validation.
        count = math.prod(self.shape)
        expected = wire_size(self.dtype, count)
        if expected > MAX_TENSOR_BYTES:
            raise ValueError(f"tensor of {expected} bytes exceeds the limit of {MAX_TENSOR_BYTES}")
        size = len(self.data)
        if self.codec == "raw":
            if size != expected:
                raise ValueError(
                    f"{self.dtype} shape {self.shape} needs {expected} bytes, data has {size}"
                )
        else:
            if size > _compress_bound(expected):
                raise ValueError(f"zstd data of {size} bytes is too large for {expected} bytes")
            try:
                declared = zstandard.frame_content_size(self.data)
            except zstandard.ZstdError:
                raise ValueError("data is not a zstd frame") from None
            if declared != expected:
                raise ValueError(
                    f"{self.dtype} shape {self.shape} needs {expected} bytes, "
                    f"zstd frame declares {declared}"
                )
        if _crc(self.data) != self.crc32c:
            raise ProtocolError(ErrorCode.PAYLOAD_CORRUPT, f"tensor {self.name!r} fails its CRC32C")
        return self

    @classmethod
    def from_array(
        cls,
        name: str,
        array: np.ndarray,
        dtype: TensorDType = "f32",
        codec: TensorCodec = "raw",
        level: int = 1,
    ) -> TensorEntry:
        """Pack ``array`` as ``dtype``. f32 of a float32 array is bit exact."""
        return cls.unvalidated(tensor_fields(name, array, dtype, codec, level))

    def to_array(self) -> np.ndarray:
        """The tensor as a read-only numpy array (float32, or float16 for f16)."""
        raw = self.data if self.codec == "raw" else self._decompress()
        dtype = self.dtype
        if dtype == "f32":
            flat = np.frombuffer(raw, _F32)
        elif dtype == "f16":
            flat = np.frombuffer(raw, _F16)
        elif dtype == "bf16":
            flat = (np.frombuffer(raw, _U16).astype(_U32) << 16).view(_F32)
            flat.flags.writeable = False
        else:
            blocks = np.frombuffer(raw, _Q8_DTYPE)
            values = blocks["qs"] * blocks["d"].astype(_F32)[:, None]
            flat = values.reshape(-1)[: math.prod(self.shape)]
            flat.flags.writeable = False
        return flat.reshape(self.shape)

    def _decompress(self) -> bytes:
        expected = wire_size(self.dtype, math.prod(self.shape))
        try:
            raw = _zstd_decompressor.decompress(self.data, max_output_size=expected)
        except zstandard.ZstdError as exc:
            raise ProtocolError(ErrorCode.PAYLOAD_CORRUPT, f"zstd: {exc}") from None
        if len(raw) != expected:
            raise ProtocolError(
                ErrorCode.PAYLOAD_CORRUPT, f"zstd gave {len(raw)} bytes, expected {expected}"
            )
        return raw


def tensor_fields(
    name: str,
    array: np.ndarray,
    dtype: TensorDType = "f32",
    codec: TensorCodec = "raw",
    level: int = 1,
) -> dict[str, Any]:
    """The wire fields of ``array`` packed as ``dtype``: a ``TensorEntry``'s, or
    what ``encode_activation`` packs without building one."""
    if not 1 <= len(name) <= 64:
        raise ValueError("a tensor name is 1 to 64 characters")
    if array.ndim > MAX_DIMS:
        raise ValueError(f"at most {MAX_DIMS} dimensions")
    raw = _to_wire_bytes(array, dtype)
    if len(raw) > MAX_TENSOR_BYTES:
        raise ValueError(f"tensor of {len(raw)} bytes exceeds the limit of {MAX_TENSOR_BYTES}")
    data = raw if codec == "raw" else _compressor(level).compress(raw)
    return {
        "name": name,
        "dtype": dtype,
        "shape": list(array.shape),
        "codec": codec,
        "crc32c": _crc(data),
        "data": data,
    }


def _compressor(level: int) -> zstandard.ZstdCompressor:
    compressor = _zstd_compressors.get(level)
    if compressor is None:
        compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
        _zstd_compressors[level] = compressor
    return compressor


def _to_wire_bytes(array: np.ndarray, dtype: TensorDType) -> bytes:
    if dtype == "f32":
        return np.ascontiguousarray(array, _F32).tobytes()
    if dtype == "f16":
        return np.ascontiguousarray(array, _F16).tobytes()
    if dtype == "bf16":
        return _bf16_bits(np.ascontiguousarray(array, _F32)).tobytes()
    return _quantize_q8_0(np.ascontiguousarray(array, _F32).reshape(-1))


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    bits = values.view(_U32)
    # Round to nearest, ties to even; NaNs keep their sign and stay quiet NaNs.
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(_U16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(_U16)
    return rounded


def _quantize_q8_0(flat: np.ndarray) -> bytes:
    if not np.isfinite(flat).all():
        raise ValueError("q8_0 cannot carry NaN or infinity")
    padded = -len(flat) % Q8_BLOCK
    if padded:
        flat = np.concatenate([flat, np.zeros(padded, _F32)])
    blocks = flat.reshape(-1, Q8_BLOCK)
    amax = np.abs(blocks).max(axis=1, initial=0.0)
    if amax.max(initial=0.0) > _Q8_MAX:
        raise ValueError(f"q8_0 cannot carry magnitudes above {_Q8_MAX:.3g}")
    # Quantise with the float16 scale that is stored, not the float32 one
    # ggml's reference uses: same layout, and tiny blocks whose scale
    # underflows float16 become zeros instead of garbage.
    scale = (amax / 127.0).astype(_F16)
    wide = scale.astype(_F32)
    inverse = np.divide(1.0, wide, out=np.zeros_like(wide), where=wide > 0)
    scaled = blocks * inverse[:, None]
    # roundf() semantics (halves away from zero), as ggml's quantizer.
    quants = np.clip(np.copysign(np.floor(np.abs(scaled) + 0.5), scaled), -127, 127)
    out = np.empty(len(blocks), _Q8_DTYPE)
    out["d"] = scale
    out["qs"] = quants.astype("i1")
    return out.tobytes()


class Activation(Message, tag="activation"):
    """Hidden states (and optionally token ids) of one step of one session.

    ``deadline_ms`` is the time budget left when sent, relative, because
    volunteers' clocks are not synchronised.
    """

    session: SessionId
    epoch: Epoch
    step: Count
    pos: Int32
    n_tokens: Int32
    tensors: list[TensorEntry] = Field(max_length=MAX_TENSORS)
    tokens: Tokens | None = None
    deadline_ms: Int32 | None = None
    # speculative decoding: the last ``drafts`` rows are drafted tokens, unverified; the
    # stage drops their KV when a later activation starts at one of their positions
    drafts: int = Field(default=0, ge=0, le=MAX_DRAFT)
    # output verification (``wire.receipt``): the signed receipts of this step so far, head first
    # (on the ring: the tail's receipt of the token), in the activation's own frame, packed
    # (``pack_chain``): the receiver unpacks them with its session's epoch and model
    receipts: Chain | None = None

    @model_validator(mode="after")
    def _unique_names(self) -> Activation:
        tensors = self.tensors
        if len(tensors) > 1 and len({t.name for t in tensors}) != len(tensors):
            raise ValueError("tensor names must be unique")
        if self.drafts and self.drafts >= self.n_tokens:
            raise ValueError("drafted rows follow at least one verified row")
        return self

    @classmethod
    def of(
        cls,
        *,
        session: str,
        epoch: int,
        step: int,
        pos: int,
        n_tokens: int,
        tensors: list[TensorEntry],
        tokens: Sequence[int] | np.ndarray | None = None,
        deadline_ms: int | None = None,
        drafts: int = 0,
        receipts: bytes | None = None,
    ) -> Activation:
        """Build from local values without validating them (the receiver does);
        the constructor validates, at a cost that shows on the per-token path."""
        return cls.unvalidated(
            _activation_fields(session, epoch, step, pos, n_tokens, tensors, tokens, deadline_ms, drafts, receipts)
        )

    def tensor(self, name: str) -> TensorEntry:
        for entry in self.tensors:
            if entry.name == name:
                return entry
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"activation has no tensor {name!r}")

    def array(self, name: str = "hidden_states") -> np.ndarray:
        return self.tensor(name).to_array()


def _activation_fields(
    session: str,
    epoch: int,
    step: int,
    pos: int,
    n_tokens: int,
    tensors: list[TensorEntry] | list[dict[str, Any]],
    tokens: Sequence[int] | np.ndarray | None,
    deadline_ms: int | None,
    drafts: int,
    receipts: bytes | None = None,
) -> dict[str, Any]:
    # The order is the model's field order: packed as is, it gives the bytes
    # that packing the model gives.
    return {
        "type": "activation",
        "v": 1,
        "session": session,
        "epoch": epoch,
        "step": step,
        "pos": pos,
        "n_tokens": n_tokens,
        "tensors": tensors,
        # Packed unchecked, as the rest: the receiver validates.
        "tokens": None if tokens is None else TokenIds(np.asarray(tokens, _I32).tobytes()),
        "deadline_ms": deadline_ms,
        "drafts": drafts,
        # packed already (``wire.receipt.pack_chain``): a stage forwards the chain it took in as it came
        "receipts": receipts,
    }


def encode_activation(
    *,
    session: str,
    epoch: int,
    step: int,
    pos: int,
    n_tokens: int,
    tensors: list[dict[str, Any]],
    tokens: Sequence[int] | np.ndarray | None = None,
    deadline_ms: int | None = None,
    drafts: int = 0,
    receipts: bytes | None = None,
) -> bytes:
    """The bytes of ``encode(Activation.of(...))`` with ``tensors`` given as
    ``tensor_fields``, built without any model: the per-token send path.
    A stream takes them as they are (``Stream.send_all``)."""
    return encode(
        _activation_fields(session, epoch, step, pos, n_tokens, tensors, tokens, deadline_ms, drafts, receipts)
    )
