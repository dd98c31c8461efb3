"""Framing between the daemon and its engine worker process.

A frame is two big-endian u32 lengths, a msgpack header map, then raw bytes
(activation rows) that travel without being wrapped in msgpack, so neither
side copies them more than the socket does.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

PREFIX = struct.Struct(">II")
MAX_HEADER = 16 << 20
MAX_PAYLOAD = 1 << 30


class FrameError(Exception):
    """A frame that cannot be read: its kind names it in the worker's typed error reply."""

    kind = "BadFrame"


class FrameTooLarge(FrameError):
    kind = "FrameTooLarge"

    def __init__(self, header_len: int, payload_len: int) -> None:
        super().__init__(f"frame too large: header {header_len} bytes (limit {MAX_HEADER}), "
                         f"payload {payload_len} bytes (limit {MAX_PAYLOAD})")
        self.header_len, self.payload_len = header_len, payload_len


def encode_prefix(header: dict[str, Any], payload_len: int) -> bytes:
    head: bytes = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(len(head), payload_len) + head


def parse_prefix(prefix: bytes | bytearray | memoryview) -> tuple[int, int]:
    header_len, payload_len = PREFIX.unpack(prefix)
    if header_len > MAX_HEADER or payload_len > MAX_PAYLOAD:
        raise FrameTooLarge(header_len, payload_len)
    return header_len, payload_len


def decode_header(raw: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The header map; anything else (bad msgpack, trailing bytes, not a map) is a FrameError."""
    try:
        header = msgpack.unpackb(raw, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        # ExtraData, FormatError, StackError and the size limits are all ValueErrors in msgpack >= 1
        raise FrameError(f"undecodable frame header: {exc}") from exc
    if not isinstance(header, dict):
        raise FrameError(f"frame header is a {type(header).__name__}, not a map")
    return header


def frame_parts(head: bytes, payload: bytes | memoryview) -> list[memoryview]:
    """A frame as the parts of one gathered write (sendmsg), so the peer wakes once per frame."""
    return [memoryview(head), memoryview(payload).cast("B")] if len(payload) else [memoryview(head)]


def take_frames(buf: bytearray) -> list[dict[str, Any]]:
    """Takes every whole frame off the front of ``buf`` (bytes as they came off a socket) and returns
    their headers, decoded; a frame's rest stays in ``buf`` until its bytes come."""
    frames = []
    while len(buf) >= PREFIX.size:
        header_len, payload_len = parse_prefix(buf[:PREFIX.size])
        end = PREFIX.size + header_len + payload_len
        if len(buf) < end:
            break
        frames.append(decode_header(buf[PREFIX.size:PREFIX.size + header_len]))
        del buf[:end]
    return frames


def drop_sent(parts: list[memoryview], sent: int) -> None:
    """Takes the ``sent`` bytes a sendmsg wrote off the front of ``parts``."""
    while parts and sent >= len(parts[0]):
        sent -= len(parts[0])
        parts.pop(0)
    if parts and sent:
        parts[0] = parts[0][sent:]
