"""Message framing: a 4-byte big-endian length, then one msgpack map.

Every map carries a ``type`` tag and a schema version ``v``; the pair picks the
pydantic model that validates it. Untrusted bytes are bounded before anything
is allocated for them: the length prefix against the message limit, and every
string, binary, array and map length by msgpack itself. Nesting is bounded by
msgpack's parser, which keeps a fixed stack (1024 levels, no recursion), and
then by the models: they are closed, strict schemas, so validation rejects a
container where none belongs without descending into it. (A registered model
must therefore not declare free-form ``Any``/``dict`` fields.) Ext types are
refused.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Self, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from wire.errors import ErrorCode, ProtocolError

LENGTH_PREFIX = struct.Struct(">I")
PREFIX_BYTES = LENGTH_PREFIX.size


@dataclass(frozen=True, slots=True)
class Limits:
    """Hard bounds applied to untrusted message bytes."""

    max_message_bytes: int = 128 << 20
    max_array_len: int = 1 << 20
    max_map_len: int = 256
    max_str_len: int = 1 << 16


DEFAULT_LIMITS = Limits()


# Bound once: looking them up on every per-token message shows in the profile.
_new = object.__new__
_setattr = object.__setattr__


class WireModel(BaseModel):
    """Base of everything decoded off the wire: frozen, strictly typed, closed."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @classmethod
    def _trusted(cls, fields: dict[str, Any]) -> Self:
        """An instance from values this process made itself: every field given,
        nothing validated (the receiver validates). Does what ``model_construct``
        does for models without aliases or private attributes, at a third of
        its cost, which matters on the per-token path."""
        instance = _new(cls)
        _setattr(instance, "__dict__", fields)
        _setattr(instance, "__pydantic_fields_set__", set(fields))
        _setattr(instance, "__pydantic_extra__", None)
        _setattr(instance, "__pydantic_private__", None)
        return instance


class Message(WireModel):
    """A top-level message; subclasses fix ``type`` and ``v`` and are ``register``ed."""

    type: str
    v: int


MessageT = TypeVar("MessageT", bound=Message)

_REGISTRY: dict[tuple[str, int], type[Message]] = {}
# The compiled validators themselves: model_validate adds a Python layer.
_VALIDATORS: dict[tuple[str, int], Callable[[Any], Message]] = {}
_KNOWN_TYPES: set[str] = set()


def register(model: type[MessageT]) -> type[MessageT]:
    """Class decorator: make ``model`` decodable under its (type, v) defaults."""
    tag = model.model_fields["type"].default
    version = model.model_fields["v"].default
    if not isinstance(tag, str) or not isinstance(version, int):
        raise TypeError(f"{model.__name__} needs literal defaults for 'type' and 'v'")
    key = (tag, version)
    if _REGISTRY.get(key, model) is not model:
        raise ValueError(f"message type {tag!r} v{version} is already registered")
    _REGISTRY[key] = model
    _VALIDATORS[key] = model.__pydantic_validator__.validate_python
    _KNOWN_TYPES.add(tag)
    return model


@register
class ErrorMessage(Message):
    """A typed error sent in place of a reply; see ``error_message``/``error_from_message``."""

    type: Literal["error"] = "error"
    v: Literal[1] = 1
    code: ErrorCode = Field(strict=False)
    message: str = Field(max_length=1024)
    retry_after_ms: int | None = Field(default=None, ge=0, le=86_400_000)


def error_message(error: ProtocolError) -> ErrorMessage:
    return ErrorMessage(
        code=error.code, message=error.message[:1024], retry_after_ms=error.retry_after_ms
    )


def error_from_message(message: ErrorMessage) -> ProtocolError:
    return ProtocolError(message.code, message.message, message.retry_after_ms)


def _fields_of(obj: object) -> dict[str, Any]:
    # A validated model keeps exactly its field values in __dict__, so packing
    # that skips pydantic's serializer, which costs more than the packing.
    if isinstance(obj, WireModel):
        return obj.__dict__
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


def decode_body(body: bytes | memoryview, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate one msgpack map (without its length prefix) into its registered model."""
    if len(body) > limits.max_message_bytes:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"message of {len(body)} bytes exceeds the limit of {limits.max_message_bytes}",
        )
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_message_bytes,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"undecodable msgpack: {exc}") from None
    if type(obj) is not dict:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a message must be a msgpack map")
    tag = obj.get("type")
    version = obj.get("v")
    if type(tag) is not str or type(version) is not int:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a message needs a string 'type' and an int 'v'")
    validate = _VALIDATORS.get((tag, version))
    if validate is None:
        if tag in _KNOWN_TYPES:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"unsupported version {version} of message type {tag!r}"
            )
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown message type {tag[:64]!r}")
    try:
        return validate(obj)
    except ValidationError as exc:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"invalid {tag} v{version} message: {_validation_summary(exc)}"
        ) from None


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


def _oversized(length: int, limits: Limits) -> ProtocolError:
    return ProtocolError(
        ErrorCode.BAD_REQUEST,
        f"message of {length} bytes exceeds the limit of {limits.max_message_bytes}",
    )


class MessageDecoder:
    """Streaming decoder: feed bytes in any chunking, take whole messages out.

    A length prefix over the limit is refused as soon as its four bytes are
    seen, before any of the body is buffered. After an error the decoder is
    spent: the stream it reads can no longer be trusted to be in sync.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self._limits = limits
        # Pending bytes stay as the chunks they arrived in and are joined once,
        # when a message is complete, so a large message is copied once.
        self._chunks: list[bytes | memoryview] = []
        self._buffered = 0
        self._need = 0
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
        try:
            message = decode_body(body, self._limits)
        except ProtocolError as exc:
            self._failed = exc
            raise
        # An oversized next prefix surfaces on the next call, after this
        # well-formed message has been handed out.
        self._read_prefix()
        return message
