"""The header walk: every header of a msgpack map checked against a message's ``Bounds`` and a
protocol's ``Limits`` without building anything (wire.decode walks a long message whose schema admits
many objects before msgpack unpacks it)."""

from __future__ import annotations

import struct

from wire.bounds import Bounds
from wire.errors import bad_request
from wire.limits import Limits

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
# Bytes after the header byte of the fixed-size scalars 0xc0..0xdf: nil,
# bool, float32/64, (u)int8..64. Absent: ext (refused), 0xc1 (never used) and
# the variable-length kinds, handled one by one.
_SCALAR_TAIL = {
    0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8,
    0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,
}  # fmt: skip


def walk_headers(data: bytes | memoryview, pos: int, remaining: int, bounds: Bounds, limits: Limits, name: str) -> None:
    """Check every header of the msgpack map ``data`` from ``pos`` (inside the
    top map, ``remaining`` keys and values left) against ``bounds`` and
    ``limits``, building nothing. Objects are counted at their container's
    header, so a container claiming more than the budget is refused before
    any of its items is read.

    Cost, measured on this project's shared 2-core box (load 6-14, so noisy):
    ~0.3 us an object, payloads skipped in O(1). A SWIM push-pull bomb at the
    2**17-object budget is refused after ~45 ms (an unbounded unpack of the
    same 4 MiB took seconds and hundreds of MiB). An activation (~35 objects,
    its bulk one ``bin``) would take 9-28 us against 14-20 us for msgpack to
    unpack it, which is why the per-token messages are never walked (see
    ``_register`` and ``_SMALL_BODY``).
    """
    max_objects = min(bounds.objects, limits.max_objects)
    max_depth = min(bounds.depth, limits.max_depth)
    max_str = bounds.str_bytes
    max_bin = bounds.bin_bytes
    max_array = bounds.array_len
    max_map = bounds.map_len
    # The top map's entries are counted already; its head (type and v) is read.
    objects = 1 + remaining + 4
    stack: list[int] = []
    depth = 1
    count = 0
    try:
        while True:
            if not remaining:
                if not stack:
                    break
                remaining = stack.pop()
                depth -= 1
                continue
            remaining -= 1
            b = data[pos]
            if b < 0x80 or b >= 0xE0:  # positive and negative fixints
                pos += 1
                continue
            if b >= 0xA0:
                if b < 0xC0:  # fixstr
                    length = b & 0x1F
                    if length > max_str:
                        raise bad_request(f"{name}: a string of {length} bytes exceeds the schema's limit of {max_str}")
                    pos += 1 + length
                    continue
                tail = _SCALAR_TAIL.get(b)
                if tail is not None:
                    pos += 1 + tail
                    continue
                if b == 0xC4 or b == 0xD9:  # bin8, str8
                    length = data[pos + 1]
                    pos += 2
                elif b == 0xC5 or b == 0xDA:  # bin16, str16
                    length = _U16.unpack_from(data, pos + 1)[0]
                    pos += 3
                elif b == 0xC6 or b == 0xDB:  # bin32, str32
                    length = _U32.unpack_from(data, pos + 1)[0]
                    pos += 5
                elif b == 0xDC or b == 0xDE:  # array16, map16
                    count = _U16.unpack_from(data, pos + 1)[0]
                    pos += 3
                elif b == 0xDD or b == 0xDF:  # array32, map32
                    count = _U32.unpack_from(data, pos + 1)[0]
                    pos += 5
                elif b == 0xC1:
                    raise bad_request(f"{name}: byte 0xc1 is not msgpack")
                else:
                    raise bad_request(f"{name}: msgpack ext types are not allowed")
                if b < 0xC7:
                    if length > max_bin:
                        raise bad_request(f"{name}: a binary of {length} bytes exceeds the schema's limit of {max_bin}")
                    pos += length
                    continue
                if b < 0xDC:
                    if length > max_str:
                        raise bad_request(f"{name}: a string of {length} bytes exceeds the schema's limit of {max_str}")
                    pos += length
                    continue
                is_map = b >= 0xDE
            else:  # fixmap, fixarray
                count = b & 0x0F
                pos += 1
                is_map = b < 0x90
            # A container of ``count`` items (maps: keys and values).
            if is_map:
                if count > max_map:
                    raise bad_request(f"{name}: a map of {count} entries exceeds the schema's limit of {max_map}")
                count *= 2
            elif count > max_array:
                raise bad_request(f"{name}: an array of {count} items exceeds the schema's limit of {max_array}")
            if depth >= max_depth:
                raise bad_request(f"{name}: nesting deeper than {max_depth} levels")
            objects += count
            if objects > max_objects:
                raise bad_request(f"{name}: more than {max_objects} msgpack objects")
            if count:
                stack.append(remaining)
                remaining = count
                depth += 1
    except (IndexError, struct.error):
        raise bad_request(f"{name}: truncated msgpack") from None
    if pos != len(data):
        raise bad_request(f"{name}: {'truncated msgpack' if pos > len(data) else 'bytes after the message'}")
