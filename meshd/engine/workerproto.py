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
    pass


def encode_prefix(header: dict[str, Any], payload_len: int) -> bytes:
    head = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(len(head), payload_len) + head


def parse_prefix(prefix: bytes | bytearray | memoryview) -> tuple[int, int]:
    header_len, payload_len = PREFIX.unpack(prefix)
    if header_len > MAX_HEADER or payload_len > MAX_PAYLOAD:
        raise FrameError(f"frame too large: header {header_len}, payload {payload_len}")
    return header_len, payload_len


def decode_header(raw: bytes | bytearray | memoryview) -> dict[str, Any]:
    header = msgpack.unpackb(raw, raw=False)
    if not isinstance(header, dict):
        raise FrameError("frame header is not a map")
    return header


def frame_parts(head: bytes, payload: bytes | memoryview) -> list[memoryview]:
    """A frame as the parts of one gathered write (sendmsg), so the peer wakes once per frame."""
    return [memoryview(head), memoryview(payload).cast("B")] if len(payload) else [memoryview(head)]


def drop_sent(parts: list[memoryview], sent: int) -> None:
    """Takes the ``sent`` bytes a sendmsg wrote off the front of ``parts``."""
    while parts and sent >= len(parts[0]):
        sent -= len(parts[0])
        parts.pop(0)
    if parts and sent:
        parts[0] = parts[0][sent:]
