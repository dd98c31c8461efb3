"""Decoding one message body: its head picks the registered model (wire.message), every bound is
checked on the bytes before msgpack unpacks them (the header walk, wire.walk, or a count of the
containers msgpack completes), msgpack unpacks within the schema's string, binary, array and map
bounds, and pydantic validates last. See wire.codec for the whole scheme."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgpack
from pydantic import ValidationError

from wire.bounds import Bounds
from wire.errors import ErrorCode, ProtocolError, bad_request
from wire.limits import DEFAULT_LIMITS, Limits
from wire.message import HEADS, KNOWN_TYPES, LENGTH_PREFIX, MAX_TAG_LEN, PREFIX_BYTES, REGISTRY, TYPE_KEY, V_KEY, Message
from wire.walk import walk_headers

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(ErrorCode.BAD_REQUEST, f"msgpack ext type {code} is not allowed")


def _validation_summary(error: ValidationError) -> str:
    parts = []
    for item in error.errors(include_url=False, include_input=False)[:3]:
        where = ".".join(str(p) for p in item["loc"]) or "message"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def _head(body: bytes | memoryview) -> tuple[str, int, int, int]:
    """``(tag, version, position after the head, entries left)`` of a message map."""
    size = len(body)
    if not size:
        raise bad_request("an empty message")
    b = body[0]
    if 0x80 <= b <= 0x8F:
        entries, pos = b & 0x0F, 1
    elif b == 0xDE and size >= 3:
        entries, pos = _U16.unpack_from(body, 1)[0], 3
    elif b == 0xDF and size >= 5:
        entries, pos = _U32.unpack_from(body, 1)[0], 5
    else:
        raise bad_request("a message must be a msgpack map")
    head = bytes(body[pos : pos + 6 + MAX_TAG_LEN + 3])
    if entries < 2 or not head.startswith(TYPE_KEY) or len(head) < 6:
        raise bad_request("a message map begins with a string 'type' and an int 'v'")
    b = head[5]
    if not 0xA0 <= b <= 0xBF:
        raise bad_request(f"a message type is a string of at most {MAX_TAG_LEN} bytes")
    end = 6 + (b & 0x1F)
    try:
        tag = head[6:end].decode()
    except UnicodeDecodeError:
        raise bad_request("a message type is UTF-8") from None
    if head[end : end + 2] != V_KEY or len(head) < end + 3:
        raise bad_request("a message map begins with a string 'type' and an int 'v'")
    version = head[end + 2]
    if version > 0x7F:
        if 0xCC <= version <= 0xCF:  # an unsigned int, but none is registered that high
            raise _unsupported(tag, "over 127")
        raise bad_request("a message map begins with a string 'type' and an int 'v'")
    return tag, version, pos + end + 3, entries - 2


def _unsupported(tag: str, version: int | str) -> ProtocolError:
    if tag in KNOWN_TYPES:
        return bad_request(f"unsupported version {version} of message type {tag!r}")
    return bad_request(f"unknown message type {tag[:64]!r}")


# A body this small builds at most this many objects whatever it holds (some
# 5 MiB of Python objects, freed when validation refuses them): so it is
# neither walked nor counted, and a decode-step activation, the per-token
# path, pays for no bound but its length. Measured on this shared box: the
# counting hooks cost 3-6 us on a 32 KiB activation's 14-20 us unpack, a walk
# 9-28 us; the stack's round trip of that activation is 300-800 us.
_SMALL_BODY = 64 << 10

def _container_budget(budget: int, name: str) -> Callable[[Any], Any]:
    """A msgpack ``object_hook``/``list_hook`` that refuses the message once more
    than ``budget`` containers are complete."""
    built = 0

    def count(container: Any) -> Any:
        nonlocal built
        built += 1
        if built > budget:
            raise bad_request(f"{name}: more than {budget} msgpack objects")
        return container

    return count


def decode_body(body: bytes | memoryview, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate one msgpack map (without its length prefix) into its registered model.

    Every bound is checked on the headers before anything is unpacked; see the
    module's docstring."""
    if len(body) > limits.max_message_bytes:
        raise bad_request(f"message of {len(body)} bytes exceeds the limit of {limits.max_message_bytes}")
    # The usual head (a fixmap, a tag of at most 31 bytes) is a few bytes at fixed places.
    known = HEADS.get(bytes(body[: 10 + (body[6] & 0x1F)])) if len(body) > 10 else None
    if known is not None:
        model, pos = known
        entries = (body[0] & 0x0F) - 2
    else:
        tag, version, pos, entries = _head(body)
        found = REGISTRY.get((tag, version))
        if found is None:
            raise _unsupported(tag, version)
        model = found
    bounds = model.bounds
    name = model.wire_name
    if len(body) > bounds.encoded_bytes:
        raise too_large_for(name, len(body), bounds)
    if entries + 2 > bounds.map_len:
        raise bad_request(f"{name}: a map of {entries + 2} entries exceeds the schema's limit of {bounds.map_len}")
    hook: Callable[[Any], Any] | None = None
    if len(body) > _SMALL_BODY:
        if model.counted:
            hook = _container_budget(min(bounds.objects, limits.max_objects), name)
        else:
            walk_headers(body, pos, 2 * entries, bounds, limits, name)
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            max_str_len=bounds.str_bytes,
            max_bin_len=bounds.bin_bytes,
            max_array_len=bounds.array_len,
            max_map_len=bounds.map_len,
            max_ext_len=0,
            object_hook=hook,
            list_hook=hook,
        )
    except ProtocolError:
        raise
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        raise bad_request(f"{name}: undecodable msgpack: {exc}") from None
    try:
        return model.wire_validate(obj)
    except ValidationError as exc:
        raise bad_request(f"invalid {name} message: {_validation_summary(exc)}") from None


def decode(data: bytes | memoryview, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode exactly one length-prefixed message."""
    if len(data) < PREFIX_BYTES:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "truncated length prefix")
    (length,) = LENGTH_PREFIX.unpack_from(data)
    if length > limits.max_message_bytes:
        raise oversized(length, limits)
    if len(data) != PREFIX_BYTES + length:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"length prefix says {length} bytes but {len(data) - PREFIX_BYTES} follow",
        )
    return decode_body(memoryview(data)[PREFIX_BYTES:], limits)


def too_large_for(name: str, length: int, bounds: Bounds) -> ProtocolError:
    return bad_request(f"a {name} message of {length} bytes exceeds the {bounds.encoded_bytes} its schema allows")


def model_at_head(body: bytes) -> type[Message]:
    tag, version, _, _ = _head(body)
    model = REGISTRY.get((tag, version))
    if model is None:
        raise _unsupported(tag, version)
    return model



def oversized(length: int, limits: Limits) -> ProtocolError:
    return ProtocolError(
        ErrorCode.BAD_REQUEST,
        f"message of {length} bytes exceeds the limit of {limits.max_message_bytes}",
    )
