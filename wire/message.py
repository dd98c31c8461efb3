"""Messages: the models every protocol's messages are (``WireModel``, ``Message``), the registry that
maps a map's head (``type`` and ``v``) to its model, and ``encode``: a 4-byte big-endian length, then
one msgpack map that begins with ``type`` and ``v``.

A subclass of ``Message`` with a tag registers itself: its ``Bounds`` are derived from its schema
(wire.bounds), and whether it is walked or counted when long (wire.decode) is decided once.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, ClassVar, Literal, Self

import msgpack
from pydantic import BaseModel, ConfigDict, Field

from wire.bounds import Bounds, schema_bounds
from wire.errors import ErrorCode, ProtocolError
from wire.types import TokenIds

LENGTH_PREFIX = struct.Struct(">I")
PREFIX_BYTES = LENGTH_PREFIX.size

# A schema whose containers are few and narrow enough that this many objects
# bound everything msgpack can build before it has completed more containers
# than the schema allows is ``counted`` instead of walked (see ``_register``).
_COUNTED_OBJECTS = 1 << 16
# msgpack's parser keeps at most this many containers open (a fixed stack, no recursion).
_MSGPACK_STACK = 1024


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
        if not tag or len(tag) > MAX_TAG_LEN or not tag.isascii():
            raise ValueError(f"a message tag is 1 to {MAX_TAG_LEN} ASCII characters, not {tag!r}")
        if not 0 <= version <= 0x7F:
            raise ValueError(f"a message version is 0 to 127, not {version}")
        key = (tag, version)
        if key in REGISTRY:
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


MAX_TAG_LEN = 31  # a fixstr: the head of every message is then a few fixed bytes

TYPE_KEY = b"\xa4type"
V_KEY = b"\xa1v"
# The first bytes of every registered message as ``encode`` writes them (a
# fixmap of its field count, then type and v) -> (model, head length). Most
# messages are read through this one lookup.
HEADS: dict[bytes, tuple[type[Message], int]] = {}


def _head_bytes(tag: str, version: int, entries: int) -> bytes:
    raw = tag.encode()
    return bytes([0x80 | entries]) + TYPE_KEY + bytes([0xA0 | len(raw)]) + raw + V_KEY + bytes([version])


_PENDING: dict[type[Message], tuple[str, int]] = {}
REGISTRY: dict[tuple[str, int], type[Message]] = {}
KNOWN_TYPES: set[str] = set()


def _register(model: type[Message], key: tuple[str, int]) -> None:
    model.bounds = bounds = schema_bounds(model)
    # The per-token messages (an activation: a few hundred objects at most, containers
    # of at most 20 items) are bounded by counting containers as msgpack completes
    # them, a hook call per container (3-6 us on a 32 KiB activation), instead of
    # walking every header in Python first (9-28 us; see ``walk_headers``), and only
    # past a small body (wire.decode). Before the count refuses, msgpack holds at most the
    # completed containers plus its open ones, each with at most ``fanout``
    # items: ``_COUNTED_OBJECTS`` at worst.
    fanout = max(bounds.array_len, 2 * bounds.map_len)
    model.counted = (bounds.objects + _MSGPACK_STACK) * fanout <= _COUNTED_OBJECTS
    model.wire_name = f"{key[0]} v{key[1]}"
    # The compiled validator itself: model_validate adds a Python layer.
    model.wire_validate = model.__pydantic_validator__.validate_python
    REGISTRY[key] = model
    KNOWN_TYPES.add(key[0])
    if len(model.model_fields) <= 0x0F:
        HEADS[_head_bytes(*key, len(model.model_fields))] = (model, len(_head_bytes(*key, 0)))


def registered(tag: str, version: int = 1) -> type[Message] | None:
    """The message class registered under ``tag`` and ``version``, if any."""
    return REGISTRY.get((tag, version))


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
