"""The field types of every wire message, defined once with one set of bounds.

Every message module (stage, mesh RPC, SWIM, records, relay) takes its ids,
counts, layers and addresses from here, so a node id or an address means the
same bytes, and is refused past the same length, in every protocol. The codec
derives its per-message limits from these bounds (``wire.bounds``), so the
schema and the decoder cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Annotated, Any, overload

import numpy as np
from pydantic import Field, GetCoreSchemaHandler
from pydantic_core import core_schema

# A node id is 20 bytes of hash, hex (wire.identity); the bound leaves room for a longer hash.
MAX_NODE_ID_LEN = 64
# A DNS name (253) plus ":port"; an IPv6 literal in brackets fits too.
MAX_HOST_PORT_LEN = 262
# A relayed address: `relay-host:port/p2p-circuit/<node id>` (relay.protocol).
MAX_ADDRESS_LEN = MAX_HOST_PORT_LEN + len("/p2p-circuit/") + MAX_NODE_ID_LEN
# Layers of one model; real ones have a few hundred at most.
MAX_LAYERS = 4096
# Token ids are llama.cpp's int32 and never negative.
MAX_TOKEN_ID = (1 << 31) - 1
# One prompt, one prefill or one carried token list: llama.cpp contexts stay far below this.
MAX_TOKENS = 1 << 20

NodeId = Annotated[str, Field(min_length=1, max_length=MAX_NODE_ID_LEN)]
# A model file's content digest (hex), or another content hash.
Digest = Annotated[str, Field(min_length=1, max_length=128)]
Layer = Annotated[int, Field(ge=0, le=MAX_LAYERS)]
LayerCount = Annotated[int, Field(ge=1, le=MAX_LAYERS)]
# Counters, versions, incarnations, sequence numbers, byte counts: a non-negative int64.
Count = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]
Epoch = Count
# A dialable address: HOST:PORT, or a relayed address.
Address = Annotated[str, Field(min_length=1, max_length=MAX_ADDRESS_LEN)]
SessionId = Annotated[str, Field(min_length=1, max_length=128)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
# Positions and counts that llama.cpp keeps as int32.
Int32 = Annotated[int, Field(ge=0, le=(1 << 31) - 1)]
# Free text for people (names, reasons, details).
Text = Annotated[str, Field(max_length=256)]
# A sentence for a person (why a model is not covered): longer than a label, still small.
Prose = Annotated[str, Field(max_length=1024)]
Port = Annotated[int, Field(ge=1, le=65535)]
# A host as one peer saw another (an IP literal; DNS names are at most 253 characters).
Host = Annotated[str, Field(max_length=253)]
# A short label: a role, a state.
Label = Annotated[str, Field(max_length=32)]
Seconds = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]

_INT32 = np.dtype("<i4")


class TokenIds(Sequence[int]):
    """A read-only list of token ids, carried as one msgpack ``bin`` of int32 little-endian.

    On the wire that is 4 bytes a token and one object to decode, instead of
    an array of up to a million msgpack ints, each a Python object; here it
    is a ``Sequence[int]`` (and a numpy ``__array__``), so callers iterate,
    index and compare it like the list it replaces. A field of this type
    accepts the packed bytes (what arrives) or any sequence of ints (what a
    node builds), and refuses negative ids and more than ``MAX_TOKENS``.
    """

    __slots__ = ("packed", "_ints")

    def __init__(self, packed: bytes) -> None:
        self.packed = packed
        self._ints: list[int] | None = None

    @classmethod
    def of(cls, tokens: Sequence[int] | np.ndarray) -> TokenIds:
        """Pack local ids, checked (a bad id here is this process's bug, not a peer's)."""
        if isinstance(tokens, TokenIds):
            return tokens
        array = np.asarray(tokens)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise ValueError("token ids are a flat sequence of ints")
        if len(array) > MAX_TOKENS:
            raise ValueError(f"{len(array)} token ids exceed the limit of {MAX_TOKENS}")
        if array.size and (int(array.min()) < 0 or int(array.max()) > MAX_TOKEN_ID):
            raise ValueError(f"token ids are 0 to {MAX_TOKEN_ID}")
        return cls(array.astype(_INT32).tobytes())

    @classmethod
    def unpack(cls, packed: bytes) -> TokenIds:
        """Check and take ids as they arrive: whole int32s, none negative, at most ``MAX_TOKENS``."""
        if len(packed) % 4:
            raise ValueError(f"packed token ids are 4 bytes each, got {len(packed)} bytes")
        if len(packed) > 4 * MAX_TOKENS:
            raise ValueError(f"{len(packed) // 4} token ids exceed the limit of {MAX_TOKENS}")
        # A negative int32 has the top bit of its last (little-endian) byte set.
        if packed and max(packed[3::4]) >= 0x80:
            raise ValueError("token ids are never negative")
        return cls(packed)

    def array(self) -> np.ndarray:
        """The ids as a read-only int32 numpy view of the packed bytes (no copy)."""
        return np.frombuffer(self.packed, _INT32)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        view = self.array()
        return view if dtype is None else view.astype(dtype)

    def _list(self) -> list[int]:
        if self._ints is None:
            self._ints = self.array().tolist()
        return self._ints

    def __len__(self) -> int:
        return len(self.packed) // 4

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._list()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self.packed == other.packed
        if isinstance(other, list | tuple):
            return self._list() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.packed)

    def __repr__(self) -> str:
        return f"TokenIds({self._list()!r})"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            _validate_tokens,
            serialization=core_schema.plain_serializer_function_ser_schema(list, when_used="always"),
            # The codec reads this to bound the field before unpacking (wire.bounds).
            metadata={"wire_bin_max": 4 * MAX_TOKENS},
        )


def _validate_tokens(value: object) -> TokenIds:
    if type(value) is bytes:  # as they arrive: first, this is on the per-token path
        return TokenIds.unpack(value)
    if isinstance(value, TokenIds):
        return value
    if isinstance(value, list | tuple | np.ndarray):
        try:
            return TokenIds.of(value)
        except (OverflowError, TypeError):
            raise ValueError("token ids are ints from 0 to 2**31 - 1") from None
    raise ValueError(f"token ids are packed int32 bytes or a list of ints, not {type(value).__name__}")


if TYPE_CHECKING:
    # What a field of token ids accepts when a node builds a message (any
    # sequence of ints) and what it gives (a TokenIds is one).
    Tokens = Sequence[int]
else:
    Tokens = TokenIds
