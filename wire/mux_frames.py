"""The mux's frames (wire.mux): a 10-byte header (type u8, flags u8, stream id u32, length u32,
big-endian) and a payload; the frame types, the most a control frame may carry, SETTINGS entries, and
the error a RESET or GOAWAY carries."""

from __future__ import annotations

import struct

from wire.errors import ErrorCode, ProtocolError, bad_request

HEADER = struct.Struct(">BBII")
HEADER_BYTES = HEADER.size

DATA, OPEN, RESET, WINDOW, PING, PONG, GOAWAY, SETTINGS = range(8)
FIN = 0x1

MAX_WINDOW = (1 << 31) - 1
MAX_PROTOCOL_BYTES = 64
MAX_REASON_BYTES = 1024
MAX_STREAM_ID = (1 << 32) - 1

SETTING = struct.Struct(">HI")
U32 = struct.Struct(">I")
PING_BODY = struct.Struct(">Q")
MIN_FRAME, MAX_FRAME = 64, 16 << 20

CONTROL_LIMITS = {
    OPEN: MAX_PROTOCOL_BYTES,
    RESET: 1 + 32 + MAX_REASON_BYTES,
    WINDOW: 4,
    PING: 8,
    PONG: 8,
    GOAWAY: 4 + 1 + 32 + MAX_REASON_BYTES,
    SETTINGS: 16 * SETTING.size,
}


def pack_error(error: ProtocolError) -> bytes:
    code = error.code.value.encode("ascii")
    reason = error.message.encode()[:MAX_REASON_BYTES]
    return bytes([len(code)]) + code + reason


def unpack_error(payload: bytes) -> ProtocolError:
    if not payload or len(payload) < 1 + payload[0]:
        raise bad_request("truncated error code")
    end = 1 + payload[0]
    try:
        code_text = payload[1:end].decode("ascii")
    except UnicodeDecodeError:
        raise bad_request("error code is not ASCII") from None
    # The reason is only for people to read, and may have been cut mid-character.
    message = payload[end:].decode("utf-8", "replace")
    try:
        code = ErrorCode(code_text)
    except ValueError:
        return ProtocolError(ErrorCode.INTERNAL, f"{code_text[:32]}: {message}")
    return ProtocolError(code, message)
