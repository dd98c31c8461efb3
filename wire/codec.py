"""Message framing: a 4-byte big-endian length, then one msgpack map.

Every map begins with a ``type`` tag and a schema version ``v``; the pair picks
the pydantic model that validates it. Untrusted bytes are bounded before
anything is built from them, in three steps:

1. the length prefix against the protocol's message cap (``Limits``, per
   protocol: SWIM, mesh RPC, relay and control small, only the stage
   protocol, which carries activations, large), before the body is buffered;
2. the head of the map names the message (``type`` and ``v`` must come first,
   as ``encode`` writes them), and an unknown one is refused unread;
3. the object count and nesting, against that message's ``Bounds``, derived
   once from its schema (a string no longer than its longest string field
   allows, an array no longer than its longest list field, so many objects in
   all): for a message whose schema admits many objects (SWIM, status, route,
   prompt) a walk over the msgpack headers, which builds nothing, refuses it
   before it is unpacked; the per-token messages, whose schemas admit only a
   few hundred objects in containers of a few items, are counted container by
   container as msgpack builds them, which bounds what it can build before
   the refusal to 64 Ki objects and costs a hook call per container instead
   of a Python walk. A body of at most 64 KiB is neither walked nor counted:
   it cannot build more than 64 Ki objects (a few MiB, for a moment)
   whatever it holds, and so a decode-step activation (up to 16 Ki f32
   values) pays for neither.

msgpack then unpacks it with the message's string, binary, array and map
bounds, so a message whose bulk belongs in a ``bin`` field cannot carry
megabytes as a string or an array, and a prompt at the schema's limit
decodes while one past it is refused with the limit named.

Pydantic validates last: models are closed, strict schemas, and every string,
binary and container field must declare a ``max_length`` (registration
refuses one that does not).
Ext types are refused.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from wire.errors import ErrorCode, ProtocolError
from wire.types import TokenIds

LENGTH_PREFIX = struct.Struct(">I")
PREFIX_BYTES = LENGTH_PREFIX.size


@dataclass(frozen=True, slots=True)
class Limits:
    """Hard bounds on the untrusted bytes of one protocol's messages.

    ``max_message_bytes`` is checked at the length prefix, before the body is
    buffered; ``max_objects`` and ``max_depth`` cap the header walk of any
    message, whatever its schema would allow. The per-field lengths come from
    each message's own ``Bounds`` (its schema); the protocol's limits can only
    tighten them.
    """

    max_message_bytes: int = 128 << 20
    max_objects: int = 1 << 20
    max_depth: int = 32

    def tightened(self, other: Limits) -> Limits:
        """The stricter of ``self`` and ``other`` in every bound."""
        return Limits(
            max_message_bytes=min(self.max_message_bytes, other.max_message_bytes),
            max_objects=min(self.max_objects, other.max_objects),
            max_depth=min(self.max_depth, other.max_depth),
        )


DEFAULT_LIMITS = Limits()

_PROTOCOL_LIMITS: dict[str, Limits] = {}


def register_protocol(protocol: str, limits: Limits) -> None:
    """Declare the caps of the messages carried by streams of ``protocol``."""
    if _PROTOCOL_LIMITS.get(protocol, limits) != limits:
        raise ValueError(f"protocol {protocol!r} already has other limits")
    _PROTOCOL_LIMITS[protocol] = limits


def same_protocol_other_version(protocol: str, known: Iterable[str]) -> str | None:
    """The one of ``known`` that names ``protocol`` at another version, if any.

    Protocol names are ``FAMILY/VERSION`` (``meshd/stage/2``): a version changes when a change would
    break peers that speak the old one, so a name of a known family at an unknown version is a peer
    of another meshd release, which deserves to hear so rather than a bare "no handler"."""
    family, sep, version = protocol.rpartition("/")
    if not sep or not family:
        return None
    for name in sorted(known):
        other_family, other_sep, other_version = name.rpartition("/")
        if other_sep and other_family == family and other_version != version:
            return name
    return None


def protocol_limits(protocol: str, link_limits: Limits = DEFAULT_LIMITS) -> Limits:
    """The limits for a stream of ``protocol``: its declared caps, within the link's.

    A protocol nobody declared gets the link's limits (its streams are refused
    by the peer set unless a handler exists, and every handler's protocol is
    declared next to its messages)."""
    declared = _PROTOCOL_LIMITS.get(protocol)
    return link_limits if declared is None else declared.tightened(link_limits)


@dataclass(frozen=True, slots=True)
class Bounds:
    """What one message's schema allows, in msgpack terms: the longest string
    (in UTF-8 bytes: 4 per character the schema counts), binary, array and map
    anywhere in it, its deepest nesting (the top map is depth 1), the most
    objects (every key, value and item) a valid message can hold, and the most
    bytes its encoding can take."""

    str_bytes: int = 0
    bin_bytes: int = 0
    array_len: int = 0
    map_len: int = 0
    depth: int = 0
    objects: int = 1
    encoded_bytes: int = 9


# Objects past this are not counted further: a bound that large is no bound,
# and the protocol's ``max_objects`` caps it.
_MANY = 1 << 40


def _bounds_of_schema(schema: Mapping[str, Any], refs: dict[str, Mapping[str, Any]], where: str) -> Bounds:
    kind = schema["type"]
    if kind == "definitions":
        for definition in schema["definitions"]:
            refs[definition["ref"]] = definition
        return _bounds_of_schema(schema["schema"], refs, where)
    if kind == "definition-ref":
        ref = schema["schema_ref"]
        target = refs.get(ref)
        if target is None:
            raise TypeError(f"{where}: a recursive schema has no bound")
        # Mark it while descending: a schema that reaches itself is unbounded.
        refs[ref] = {"type": "definition-ref", "schema_ref": "<recursion>"}
        try:
            return _bounds_of_schema(target, refs, where)
        finally:
            refs[ref] = target
    if kind == "model":
        return _bounds_of_schema(schema["schema"], refs, schema["cls"].__name__)
    if kind == "model-fields":
        fields = schema["fields"]
        parts = [_bounds_of_schema(f["schema"], refs, f"{where}.{name}") for name, f in fields.items()]
        objects = 1 + len(fields) + sum(p.objects for p in parts)
        encoded = 5 + sum(5 + len(name.encode()) + p.encoded_bytes for name, p in zip(fields, parts, strict=True))
        depth = 1 + max((p.depth for p in parts), default=0)
        # The keys are strings too.
        parts.append(Bounds(str_bytes=max((len(name.encode()) for name in fields), default=0)))
        return _merge(parts, map_len=len(fields), depth=depth, objects=objects, encoded_bytes=encoded)
    if kind in ("default", "nullable", "model-field", "function-after", "function-before", "function-wrap"):
        return _bounds_of_schema(schema["schema"], refs, where)
    if kind in ("int", "float", "bool", "none"):
        return Bounds()
    if kind == "literal":
        return _literal_bounds(schema["expected"], where)
    if kind == "enum":
        return _literal_bounds([member.value for member in schema["members"]], where)
    if kind in ("str", "bytes"):
        length = schema.get("max_length")
        if length is None:
            raise TypeError(f"{where}: a {kind} field on the wire needs a max_length")
        if kind == "str":
            return Bounds(str_bytes=4 * length, encoded_bytes=5 + 4 * length)
        return Bounds(bin_bytes=length, encoded_bytes=5 + length)
    if kind == "function-plain":
        length = schema.get("metadata", {}).get("wire_bin_max")
        if length is None:
            raise TypeError(f"{where}: a custom field type on the wire must declare its wire_bin_max")
        return Bounds(bin_bytes=length, encoded_bytes=5 + length)
    if kind in ("list", "dict"):
        length = schema.get("max_length")
        if length is None:
            raise TypeError(f"{where}: a {kind} field on the wire needs a max_length")
        if kind == "list":
            item = _bounds_of_schema(schema["items_schema"], refs, f"{where}[]")
            return _merge(
                [item],
                array_len=length,
                depth=item.depth + 1,
                objects=1 + length * item.objects,
                encoded_bytes=5 + length * item.encoded_bytes,
            )
        key = _bounds_of_schema(schema["keys_schema"], refs, f"{where}{{key}}")
        value = _bounds_of_schema(schema["values_schema"], refs, f"{where}{{value}}")
        return _merge(
            [key, value],
            map_len=length,
            depth=max(key.depth, value.depth) + 1,
            objects=1 + length * (key.objects + value.objects),
            encoded_bytes=5 + length * (key.encoded_bytes + value.encoded_bytes),
        )
    if kind in ("union", "tagged-union"):
        choices = schema["choices"]
        options = choices.values() if isinstance(choices, dict) else choices
        parts = [
            _bounds_of_schema(option[0] if isinstance(option, tuple) else option, refs, where) for option in options
        ]
        return _merge(
            parts,
            depth=max(p.depth for p in parts),
            objects=max(p.objects for p in parts),
            encoded_bytes=max(p.encoded_bytes for p in parts),
        )
    raise TypeError(f"{where}: cannot bound a {kind!r} field on the wire")


def _literal_bounds(values: list[Any], where: str) -> Bounds:
    if not all(isinstance(value, str | int | bool) for value in values):
        raise TypeError(f"{where}: literals on the wire are strings or ints")
    longest = max((len(v.encode()) for v in values if isinstance(v, str)), default=0)
    return Bounds(str_bytes=longest, encoded_bytes=max(9, 5 + longest))


def _merge(
    parts: list[Bounds], *, array_len: int = 0, map_len: int = 0, depth: int, objects: int, encoded_bytes: int
) -> Bounds:
    return Bounds(
        str_bytes=max([p.str_bytes for p in parts], default=0),
        bin_bytes=max([p.bin_bytes for p in parts], default=0),
        array_len=max([array_len, *(p.array_len for p in parts)]),
        map_len=max([map_len, *(p.map_len for p in parts)]),
        depth=max([depth, *(p.depth for p in parts)]),
        objects=min(objects, _MANY),
        encoded_bytes=min(encoded_bytes, _MANY),
    )


def schema_bounds(model: type[BaseModel]) -> Bounds:
    """The ``Bounds`` of ``model``'s schema; TypeError if a field is unbounded."""
    return _bounds_of_schema(model.__pydantic_core_schema__, {}, model.__name__)


# Bound once: looking them up on every per-token message shows in the profile.
_new = object.__new__
_setattr = object.__setattr__


class WireModel(BaseModel):
    """Base of everything decoded off the wire: frozen, strictly typed, closed."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @classmethod
    def unvalidated(cls, fields: dict[str, Any]) -> Self:
        """An instance built from values that are already valid, without validating them again.

        For data this process made itself or took from a validated model (the
        receiver validates what it gets): the per-token path and a gossip
        round build many, and validating them again was most of their cost.
        ``fields`` must give every field, in the model's field order, and is
        kept as the instance's field dict (not copied): then the result equals
        ``model_construct(**fields)`` in fields, fields-set, equality and
        encoding (tests/test_wire_types.py checks that against pydantic), at
        a third of its cost. Nothing is checked: invalid values make an
        invalid instance, which the receiver refuses.
        """
        # What model_construct sets for a model without aliases, private
        # attributes or extras; pydantic is pinned below 3 for this.
        instance = _new(cls)
        _setattr(instance, "__dict__", fields)
        _setattr(instance, "__pydantic_fields_set__", set(fields))
        _setattr(instance, "__pydantic_extra__", None)
        _setattr(instance, "__pydantic_private__", None)
        return instance


class Message(WireModel):
    """A top-level message. A subclass names its tag and version in its header,

        class Open(Message, tag="open"):          # version 1
        class Open(Message, tag="open", version=2):

    which fixes its ``type`` and ``v`` fields (the first two of the map),
    derives its ``Bounds`` from its schema and registers it with the codec.
    A subclass without a tag is an abstract base for others.
    """

    type: str = ""
    v: int = 0

    bounds: ClassVar[Bounds]
    wire_name: ClassVar[str]
    counted: ClassVar[bool]
    wire_validate: ClassVar[Callable[[Any], Message]]

    def __init_subclass__(cls, *, tag: str | None = None, version: int = 1, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if tag is None:
            return
        if not tag or len(tag) > _MAX_TAG_LEN or not tag.isascii():
            raise ValueError(f"a message tag is 1 to {_MAX_TAG_LEN} ASCII characters, not {tag!r}")
        if not 0 <= version <= 0x7F:
            raise ValueError(f"a message version is 0 to 127, not {version}")
        key = (tag, version)
        if key in _REGISTRY:
            raise ValueError(f"message type {tag!r} v{version} is already registered")
        # Before pydantic collects the fields: the tag and version become literal fields with
        # defaults, in the base's place (first), so the map starts with them.
        if "__annotations__" not in cls.__dict__:
            cls.__annotations__ = {}
        cls.__annotations__["type"] = Literal[tag]
        cls.__annotations__["v"] = Literal[version]
        cls.type = tag
        cls.v = version
        _PENDING[cls] = key

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        key = _PENDING.pop(cls, None)
        if key is not None:
            _register(cls, key)


_MAX_TAG_LEN = 31  # a fixstr: the head of every message is then a few fixed bytes

_TYPE_KEY = b"\xa4type"
_V_KEY = b"\xa1v"
# The first bytes of every registered message as ``encode`` writes them (a
# fixmap of its field count, then type and v) -> (model, head length). Most
# messages are read through this one lookup.
_HEADS: dict[bytes, tuple[type[Message], int]] = {}


def _head_bytes(tag: str, version: int, entries: int) -> bytes:
    raw = tag.encode()
    return bytes([0x80 | entries]) + _TYPE_KEY + bytes([0xA0 | len(raw)]) + raw + _V_KEY + bytes([version])


_PENDING: dict[type[Message], tuple[str, int]] = {}
_REGISTRY: dict[tuple[str, int], type[Message]] = {}
_KNOWN_TYPES: set[str] = set()


def _register(model: type[Message], key: tuple[str, int]) -> None:
    model.bounds = bounds = schema_bounds(model)
    # The per-token messages (an activation: a few hundred objects at most, containers
    # of at most 20 items) are bounded by counting containers as msgpack completes
    # them, a hook call per container (3-6 us on a 32 KiB activation), instead of
    # walking every header in Python first (9-28 us; see ``_walk``), and only
    # past ``_SMALL_BODY``. Before the count refuses, msgpack holds at most the
    # completed containers plus its open ones, each with at most ``fanout``
    # items: ``_COUNTED_OBJECTS`` at worst.
    fanout = max(bounds.array_len, 2 * bounds.map_len)
    model.counted = (bounds.objects + _MSGPACK_STACK) * fanout <= _COUNTED_OBJECTS
    model.wire_name = f"{key[0]} v{key[1]}"
    # The compiled validator itself: model_validate adds a Python layer.
    model.wire_validate = model.__pydantic_validator__.validate_python
    _REGISTRY[key] = model
    _KNOWN_TYPES.add(key[0])
    if len(model.model_fields) <= 0x0F:
        _HEADS[_head_bytes(*key, len(model.model_fields))] = (model, len(_head_bytes(*key, 0)))


def registered(tag: str, version: int = 1) -> type[Message] | None:
    """The message class registered under ``tag`` and ``version``, if any."""
    return _REGISTRY.get((tag, version))


def _fields_of(obj: object) -> Any:
    # A validated model keeps exactly its field values in __dict__, so packing
    # that skips pydantic's serializer, which costs more than the packing.
    if isinstance(obj, WireModel):
        return obj.__dict__
    if type(obj) is TokenIds:
        return obj.packed
    raise TypeError(f"cannot encode {type(obj).__name__} on the wire")


_packer = msgpack.Packer(default=_fields_of, use_bin_type=True)


def encode(message: Message | dict[str, Any]) -> bytes:
    """Length-prefixed msgpack bytes of ``message``: a model, or its plain field
    map in field order, which packs to the same bytes without a model."""
    body: bytes = _packer.pack(message)
    return LENGTH_PREFIX.pack(len(body)) + body


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(ErrorCode.BAD_REQUEST, f"msgpack ext type {code} is not allowed")


def _validation_summary(error: ValidationError) -> str:
    parts = []
    for item in error.errors(include_url=False, include_input=False)[:3]:
        where = ".".join(str(p) for p in item["loc"]) or "message"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
# Bytes after the header byte of the fixed-size scalars 0xc0..0xdf: nil,
# bool, float32/64, (u)int8..64. Absent: ext (refused), 0xc1 (never used) and
# the variable-length kinds, handled one by one.
_SCALAR_TAIL = {
    0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8,
    0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,
}  # fmt: skip


def _walk(data: bytes | memoryview, pos: int, remaining: int, bounds: Bounds, limits: Limits, name: str) -> None:
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
                        raise _bad(f"{name}: a string of {length} bytes exceeds the schema's limit of {max_str}")
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
                    raise _bad(f"{name}: byte 0xc1 is not msgpack")
                else:
                    raise _bad(f"{name}: msgpack ext types are not allowed")
                if b < 0xC7:
                    if length > max_bin:
                        raise _bad(f"{name}: a binary of {length} bytes exceeds the schema's limit of {max_bin}")
                    pos += length
                    continue
                if b < 0xDC:
                    if length > max_str:
                        raise _bad(f"{name}: a string of {length} bytes exceeds the schema's limit of {max_str}")
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
                    raise _bad(f"{name}: a map of {count} entries exceeds the schema's limit of {max_map}")
                count *= 2
            elif count > max_array:
                raise _bad(f"{name}: an array of {count} items exceeds the schema's limit of {max_array}")
            if depth >= max_depth:
                raise _bad(f"{name}: nesting deeper than {max_depth} levels")
            objects += count
            if objects > max_objects:
                raise _bad(f"{name}: more than {max_objects} msgpack objects")
            if count:
                stack.append(remaining)
                remaining = count
                depth += 1
    except (IndexError, struct.error):
        raise _bad(f"{name}: truncated msgpack") from None
    if pos != len(data):
        raise _bad(f"{name}: {'truncated msgpack' if pos > len(data) else 'bytes after the message'}")


def _head(body: bytes | memoryview) -> tuple[str, int, int, int]:
    """``(tag, version, position after the head, entries left)`` of a message map."""
    size = len(body)
    if not size:
        raise _bad("an empty message")
    b = body[0]
    if 0x80 <= b <= 0x8F:
        entries, pos = b & 0x0F, 1
    elif b == 0xDE and size >= 3:
        entries, pos = _U16.unpack_from(body, 1)[0], 3
    elif b == 0xDF and size >= 5:
        entries, pos = _U32.unpack_from(body, 1)[0], 5
    else:
        raise _bad("a message must be a msgpack map")
    head = bytes(body[pos : pos + 6 + _MAX_TAG_LEN + 3])
    if entries < 2 or not head.startswith(_TYPE_KEY) or len(head) < 6:
        raise _bad("a message map begins with a string 'type' and an int 'v'")
    b = head[5]
    if not 0xA0 <= b <= 0xBF:
        raise _bad(f"a message type is a string of at most {_MAX_TAG_LEN} bytes")
    end = 6 + (b & 0x1F)
    try:
        tag = head[6:end].decode()
    except UnicodeDecodeError:
        raise _bad("a message type is UTF-8") from None
    if head[end : end + 2] != _V_KEY or len(head) < end + 3:
        raise _bad("a message map begins with a string 'type' and an int 'v'")
    version = head[end + 2]
    if version > 0x7F:
        if 0xCC <= version <= 0xCF:  # an unsigned int, but none is registered that high
            raise _unsupported(tag, "over 127")
        raise _bad("a message map begins with a string 'type' and an int 'v'")
    return tag, version, pos + end + 3, entries - 2


def _unsupported(tag: str, version: int | str) -> ProtocolError:
    if tag in _KNOWN_TYPES:
        return _bad(f"unsupported version {version} of message type {tag!r}")
    return _bad(f"unknown message type {tag[:64]!r}")


# A body this small builds at most this many objects whatever it holds (some
# 5 MiB of Python objects, freed when validation refuses them): so it is
# neither walked nor counted, and a decode-step activation, the per-token
# path, pays for no bound but its length. Measured on this shared box: the
# counting hooks cost 3-6 us on a 32 KiB activation's 14-20 us unpack, a walk
# 9-28 us; the stack's round trip of that activation is 300-800 us.
_SMALL_BODY = 64 << 10
# A schema whose containers are few and narrow enough that this many objects
# bound everything msgpack can build before it has completed more containers
# than the schema allows is ``counted`` instead of walked (see ``_register``).
_COUNTED_OBJECTS = 1 << 16
# msgpack's parser keeps at most this many containers open (a fixed stack, no recursion).
_MSGPACK_STACK = 1024


def _container_budget(budget: int, name: str) -> Callable[[Any], Any]:
    """A msgpack ``object_hook``/``list_hook`` that refuses the message once more
    than ``budget`` containers are complete."""
    built = 0

    def count(container: Any) -> Any:
        nonlocal built
        built += 1
        if built > budget:
            raise _bad(f"{name}: more than {budget} msgpack objects")
        return container

    return count


def decode_body(body: bytes | memoryview, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate one msgpack map (without its length prefix) into its registered model.

    Every bound is checked on the headers before anything is unpacked; see the
    module's docstring."""
    if len(body) > limits.max_message_bytes:
        raise _bad(f"message of {len(body)} bytes exceeds the limit of {limits.max_message_bytes}")
    # The usual head (a fixmap, a tag of at most 31 bytes) is a few bytes at fixed places.
    known = _HEADS.get(bytes(body[: 10 + (body[6] & 0x1F)])) if len(body) > 10 else None
    if known is not None:
        model, pos = known
        entries = (body[0] & 0x0F) - 2
    else:
        tag, version, pos, entries = _head(body)
        found = _REGISTRY.get((tag, version))
        if found is None:
            raise _unsupported(tag, version)
        model = found
    bounds = model.bounds
    name = model.wire_name
    if len(body) > bounds.encoded_bytes:
        raise _too_large_for(name, len(body), bounds)
    if entries + 2 > bounds.map_len:
        raise _bad(f"{name}: a map of {entries + 2} entries exceeds the schema's limit of {bounds.map_len}")
    hook: Callable[[Any], Any] | None = None
    if len(body) > _SMALL_BODY:
        if model.counted:
            hook = _container_budget(min(bounds.objects, limits.max_objects), name)
        else:
            _walk(body, pos, 2 * entries, bounds, limits, name)
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
        raise _bad(f"{name}: undecodable msgpack: {exc}") from None
    try:
        return model.wire_validate(obj)
    except ValidationError as exc:
        raise _bad(f"invalid {name} message: {_validation_summary(exc)}") from None


def decode(data: bytes | memoryview, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode exactly one length-prefixed message."""
    if len(data) < PREFIX_BYTES:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "truncated length prefix")
    (length,) = LENGTH_PREFIX.unpack_from(data)
    if length > limits.max_message_bytes:
        raise _oversized(length, limits)
    if len(data) != PREFIX_BYTES + length:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"length prefix says {length} bytes but {len(data) - PREFIX_BYTES} follow",
        )
    return decode_body(memoryview(data)[PREFIX_BYTES:], limits)


def _too_large_for(name: str, length: int, bounds: Bounds) -> ProtocolError:
    return _bad(f"a {name} message of {length} bytes exceeds the {bounds.encoded_bytes} its schema allows")


def _model_at_head(body: bytes) -> type[Message]:
    tag, version, _, _ = _head(body)
    model = _REGISTRY.get((tag, version))
    if model is None:
        raise _unsupported(tag, version)
    return model


# A message longer than this has its head read as soon as it arrives, so that
# one whose schema cannot be that long (every control message) is refused
# before its body is buffered; shorter ones are checked whole.
_EARLY_HEAD_AFTER = 64 << 10
_HEAD_PEEK = 5 + 6 + _MAX_TAG_LEN + 3


def _oversized(length: int, limits: Limits) -> ProtocolError:
    return ProtocolError(
        ErrorCode.BAD_REQUEST,
        f"message of {length} bytes exceeds the limit of {limits.max_message_bytes}",
    )


class MessageDecoder:
    """Streaming decoder: feed bytes in any chunking, take whole messages out.

    A length prefix over the limit is refused as soon as its four bytes are
    seen, before any of the body is buffered; a long message whose schema
    cannot be that long, as soon as its head is (``_EARLY_HEAD_AFTER``).
    After an error the decoder is spent: the stream it reads can no longer be
    trusted to be in sync.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self._limits = limits
        # Pending bytes stay as the chunks they arrived in and are joined once,
        # when a message is complete, so a large message is copied once.
        self._chunks: list[bytes | memoryview] = []
        self._buffered = 0
        self._need = 0
        self._head_unread = False
        self._failed: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held that do not yet form a whole message."""
        return self._buffered

    def feed(self, data: bytes | memoryview) -> None:
        if self._failed is not None:
            raise self._failed
        if data:
            self._chunks.append(data)
            self._buffered += len(data)
            if not self._need:
                self._read_prefix()
            if self._head_unread:
                self._check_head()
            if self._failed is not None:
                raise self._failed

    def decode_whole(self, data: bytes | memoryview) -> Message | None:
        """``feed`` then ``next_message``, short-cut for the usual case where
        ``data`` is exactly one whole message and nothing is pending."""
        if self._buffered or self._failed is not None or len(data) < PREFIX_BYTES:
            self.feed(data)
            return self.next_message()
        (length,) = LENGTH_PREFIX.unpack_from(data)
        if PREFIX_BYTES + length != len(data) or length > self._limits.max_message_bytes:
            self.feed(data)
            return self.next_message()
        try:
            return decode_body(memoryview(data)[PREFIX_BYTES:], self._limits)
        except ProtocolError as exc:
            self._failed = exc
            raise

    def _first(self, at_least: int) -> bytes | memoryview:
        first = self._chunks[0]
        if len(first) < at_least:
            first = b"".join(self._chunks)
            self._chunks[:] = [first]
        return first

    def _read_prefix(self) -> None:
        if self._buffered < PREFIX_BYTES:
            return
        (length,) = LENGTH_PREFIX.unpack_from(self._first(PREFIX_BYTES))
        if length > self._limits.max_message_bytes:
            self._failed = _oversized(length, self._limits)
        else:
            self._need = PREFIX_BYTES + length
            self._head_unread = length > _EARLY_HEAD_AFTER

    def _check_head(self) -> None:
        if self._buffered < PREFIX_BYTES + _HEAD_PEEK:
            return
        self._head_unread = False
        peek = b""
        for chunk in self._chunks:
            peek += bytes(chunk[: PREFIX_BYTES + _HEAD_PEEK - len(peek)])
            if len(peek) >= PREFIX_BYTES + _HEAD_PEEK:
                break
        try:
            model = _model_at_head(peek[PREFIX_BYTES:])
        except ProtocolError as exc:
            self._failed = exc
            return
        length = self._need - PREFIX_BYTES
        if length > model.bounds.encoded_bytes:
            self._failed = _too_large_for(model.wire_name, length, model.bounds)

    def next_message(self) -> Message | None:
        """The next whole message, or None until more bytes arrive."""
        if self._failed is not None:
            raise self._failed
        need = self._need
        if not need or self._buffered < need:
            return None
        first = self._first(need)
        body = memoryview(first)[PREFIX_BYTES:need]
        if len(first) == need:
            del self._chunks[0]
        else:
            self._chunks[0] = memoryview(first)[need:]
        self._buffered -= need
        self._need = 0
        self._head_unread = False
        try:
            message = decode_body(body, self._limits)
        except ProtocolError as exc:
            self._failed = exc
            raise
        # An oversized next prefix surfaces on the next call, after this
        # well-formed message has been handed out.
        self._read_prefix()
        return message


class ErrorMessage(Message, tag="error"):
    """A typed error sent in place of a reply; see ``error_message``/``error_from_message``."""

    code: ErrorCode = Field(strict=False)
    message: str = Field(max_length=1024)
    retry_after_ms: int | None = Field(default=None, ge=0, le=86_400_000)


def error_message(error: ProtocolError) -> ErrorMessage:
    return ErrorMessage(
        code=error.code, message=error.message[:1024], retry_after_ms=error.retry_after_ms
    )


def error_from_message(message: ErrorMessage) -> ProtocolError:
    return ProtocolError(message.code, message.message, message.retry_after_ms)
