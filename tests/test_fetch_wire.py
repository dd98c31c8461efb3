"""The fetch protocol's messages: every valid one fits the protocol's caps, and past its schema it is refused unread."""

from __future__ import annotations

import pytest

from wire.codec import MessageDecoder
from wire.decode import decode
from wire.errors import ProtocolError
from wire.fetch import (
    FETCH_PROTOCOL,
    FRAME_BYTES,
    MAX_CHUNKS,
    MAX_MANIFEST_BYTES,
    ChunkData,
    ChunkRequest,
    Have,
    HaveRequest,
    ManifestPiece,
    ManifestRequest,
)
from wire.limits import protocol_limits
from wire.message import encode

LIMITS = protocol_limits(FETCH_PROTOCOL)
MODEL = "ab" * 32


@pytest.mark.parametrize("model", [ChunkData, ChunkRequest, Have, HaveRequest, ManifestPiece, ManifestRequest])
def test_every_valid_message_fits_the_protocols_cap(model: type) -> None:
    assert model.bounds.encoded_bytes <= LIMITS.max_message_bytes, model.__name__


@pytest.mark.parametrize(
    "message",
    [
        ChunkData(offset=1 << 40, data=b"\x01" * FRAME_BYTES),
        Have(model=MODEL, chunks=MAX_CHUNKS, bitmap=b"\xff" * (MAX_CHUNKS // 8)),
        ManifestPiece(model=MODEL, total=MAX_MANIFEST_BYTES, offset=0, data=b"\x02" * FRAME_BYTES),
        ChunkRequest(model=MODEL, offset=0, size=4 << 20),
    ],
)
def test_the_largest_messages_round_trip(message: object) -> None:
    assert decode(encode(message), LIMITS) == message  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields",
    [
        {"type": "chunk_data", "v": 1, "offset": 0, "data": b"\0" * (FRAME_BYTES + 1)},
        {"type": "chunk_data", "v": 1, "offset": -1, "data": b"\0"},
        {"type": "chunk_data", "v": 1, "offset": 0, "data": b""},
        {"type": "chunk_request", "v": 1, "model": MODEL, "offset": 0, "size": (64 << 20) + 1},
        {"type": "have", "v": 1, "model": MODEL, "chunks": MAX_CHUNKS + 1, "bitmap": b""},
        {"type": "manifest_piece", "v": 1, "model": MODEL, "total": MAX_MANIFEST_BYTES + 1, "offset": 0, "data": b""},
        {"type": "chunk_request", "v": 1, "model": "x" * 200, "offset": 0, "size": 1},
    ],
)
def test_a_message_past_its_schema_is_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ProtocolError, match=r"^BAD_REQUEST: (invalid \w+ v1 message: |chunk_data v1: undecodable msgpack: )"):
        decode(encode(fields), LIMITS)


def test_an_oversize_frame_is_refused_at_its_length_prefix_before_it_is_buffered() -> None:
    decoder = MessageDecoder(LIMITS)
    frame = encode({"type": "chunk_data", "v": 1, "offset": 0, "data": b"\0" * (2 * FRAME_BYTES)})
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decoder.feed(frame[:4])
    assert decoder.buffered <= 4
