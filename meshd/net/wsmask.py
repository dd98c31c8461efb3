"""WebSocket masking at memory speed for wsproto (and so trio-websocket).

RFC 6455 makes a client XOR every payload byte it sends with a 4-byte key,
and the server undo it. wsproto does that with four strided ``translate``
passes and two copies: 26 µs for a 32 KiB activation, about a tenth of a
whole decode-size round trip through our stack. XOR-ing 32-bit words in
numpy gives the same bytes in 2 µs.

``install`` swaps wsproto's masker class for ours, process-wide (wsproto looks
the class up by name each time it masks a frame); ``stock_masking`` puts
wsproto's own back for a block, so a benchmark can time unmodified
trio-websocket next to our stack.

``binary_frame`` builds a whole binary message's frame without wsproto, for
the links' writes that skip trio-websocket (``WebSocketTransport.
send_record_nowait``): the same bytes wsproto would write, but for the key.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import wsproto.frame_protocol as _frame_protocol

_WORD = np.dtype("<u4")
_STOCK = _frame_protocol.XorMaskerSimple


class WordMasker:
    """Drop-in for wsproto's ``XorMaskerSimple``: same output, same key rotation
    across successive chunks of one frame."""

    __slots__ = ("_key",)

    def __init__(self, masking_key: bytes | bytearray) -> None:
        self._key = bytes(masking_key)

    def process(self, data: bytes | bytearray | memoryview) -> bytearray:
        out = bytearray(data)
        n = len(out)
        if n:
            key = self._key
            words = n >> 2
            if words:
                view = np.frombuffer(out, _WORD, count=words)
                view ^= int.from_bytes(key, "little")
            shift = n & 3
            if shift:
                for i in range(words << 2, n):
                    out[i] ^= key[i & 3]
                # the next chunk of the same frame continues with the next key byte
                self._key = key[shift:] + key[:shift]
        return out


_U16 = struct.Struct(">H")
_U64 = struct.Struct(">Q")
# FIN and the binary opcode: one frame per message
_BINARY_FIN = 0x82
_MASK_BIT = 0x80


def binary_frame(payload: bytes, masked: bool) -> bytes:
    """One RFC 6455 frame carrying ``payload`` as a whole binary message; ``masked`` (a client's
    frame) with a fresh random key."""
    n = len(payload)
    mask = _MASK_BIT if masked else 0
    if n < 126:
        head = bytes((_BINARY_FIN, mask | n))
    elif n < 1 << 16:
        head = bytes((_BINARY_FIN, mask | 126)) + _U16.pack(n)
    else:
        head = bytes((_BINARY_FIN, mask | 127)) + _U64.pack(n)
    if not masked:
        return head + payload
    key = os.urandom(4)
    return head + key + WordMasker(key).process(payload)


def install() -> None:
    _frame_protocol.XorMaskerSimple = WordMasker  # type: ignore[misc,assignment]


@contextmanager
def stock_masking() -> Iterator[None]:
    """wsproto's own masker inside the block; ours again after it."""
    previous = _frame_protocol.XorMaskerSimple
    _frame_protocol.XorMaskerSimple = _STOCK  # type: ignore[misc]
    try:
        yield
    finally:
        _frame_protocol.XorMaskerSimple = previous  # type: ignore[misc]
