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

The parts, each in its module: the per-protocol caps (wire.limits), a schema's bounds (wire.bounds), the
message models, their registry and ``encode`` (wire.message), the header walk (wire.walk) and the
decoding of one body (wire.decode). This module reads them off a stream (``MessageDecoder``).
"""


from __future__ import annotations

from wire.decode import decode_body, model_at_head, oversized, too_large_for
from wire.errors import ProtocolError
from wire.limits import DEFAULT_LIMITS, Limits
from wire.message import LENGTH_PREFIX, MAX_TAG_LEN, PREFIX_BYTES, Message

# A message longer than this has its head read as soon as it arrives, so that
# one whose schema cannot be that long (every control message) is refused
# before its body is buffered; shorter ones are checked whole.
_EARLY_HEAD_AFTER = 64 << 10
_HEAD_PEEK = 5 + 6 + MAX_TAG_LEN + 3


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
            self._failed = oversized(length, self._limits)
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
            model = model_at_head(peek[PREFIX_BYTES:])
        except ProtocolError as exc:
            self._failed = exc
            return
        length = self._need - PREFIX_BYTES
        if length > model.bounds.encoded_bytes:
            self._failed = too_large_for(model.wire_name, length, model.bounds)

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
