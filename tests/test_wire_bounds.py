"""Hostile bytes against the codec's bounds: object budget, nesting, per-protocol caps,
strings and arrays held to their schema, token lists, schema and codec limits in agreement.

Unit tests of wire/ alone; the real-daemon hostile tests reuse these bounds.
"""

from __future__ import annotations

import random
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wire.meshrpc
from relay.protocol import HOP_PROTOCOL, STOP_PROTOCOL, Connect
from wire.bounds import Bounds
from wire.codec import MessageDecoder
from wire.decode import decode, decode_body
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.limits import DEFAULT_LIMITS, Limits, protocol_limits
from wire.meshrpc import MESH_PROTOCOL, StatusReply
from wire.message import PREFIX_BYTES, Message, encode
from wire.stage import STAGE_PROTOCOL, ChatMessage, Prompt, PromptTokens
from wire.swim import SWIM_PROTOCOL, CapabilityRecord, Sync, SyncEntry
from wire.tensors import Activation
from wire.types import MAX_TOKENS
from wire.walk import walk_headers

SWIM = protocol_limits(SWIM_PROTOCOL)
STAGE = protocol_limits(STAGE_PROTOCOL)
MESH = protocol_limits(MESH_PROTOCOL)

_U32 = struct.Struct(">I")


def framed(body: bytes) -> bytes:
    return _U32.pack(len(body)) + body


def head(tag: str, entries: int) -> bytes:
    """A map of ``entries`` that begins, as every message must, with its type and v."""
    assert entries <= 15
    return bytes([0x80 | entries]) + msgpack.packb("type") + msgpack.packb(tag) + msgpack.packb("v") + b"\x01"


def array16(count: int) -> bytes:
    return b"\xdc" + struct.pack(">H", count)


def refused_with_little_memory(body: bytes, limits: Limits) -> tuple[ProtocolError, int]:
    """Decode ``body`` (already in memory) and return the error and the peak bytes allocated doing so."""
    data = framed(body)
    decoder = MessageDecoder(limits)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as info:
            decoder.decode_whole(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.code is ErrorCode.BAD_REQUEST
    return info.value, peak


# ----- the object budget and nesting, before anything is built


def _swim_bomb() -> bytes:
    # Near SWIM's 4 MiB cap: 16,384 entries (the schema's most), each an array of 240 empty arrays:
    # every container within its schema length and depth, some 4 million objects in all. Unpacked,
    # those are 4 million Python lists (~300 MiB).
    inner = array16(240) + b"\x90" * 240
    body = head("swim.sync", 4) + msgpack.packb("reply") + b"\xc3" + msgpack.packb("entries") + array16(16384)
    return body + inner * 16384


def _deep_bomb(tag: str, size: int) -> bytes:
    # One field nested as deep as the bytes go.
    return head(tag, 3) + msgpack.packb("x") + b"\x91" * (size - 40) + b"\x90"


def _wide_bomb(tag: str, size: int) -> bytes:
    # A tree of small arrays of empty arrays: within an activation's or a prompt's per-array
    # limit everywhere, a million objects.
    leaf = b"\x9f" + b"\x90" * 15
    return head(tag, 3) + msgpack.packb("x") + b"\x9f" * 3 + leaf * ((size - 50) // len(leaf))


@pytest.mark.parametrize(
    ("protocol", "build", "fragment"),
    [
        (SWIM_PROTOCOL, _swim_bomb, f"more than {SWIM.max_objects} msgpack objects"),
        (SWIM_PROTOCOL, lambda: _deep_bomb("swim.ping", 4 << 20), "nesting deeper than"),
        (STAGE_PROTOCOL, lambda: _deep_bomb("prompt", 8 << 20), "nesting deeper than"),
        (STAGE_PROTOCOL, lambda: _wide_bomb("prompt", 8 << 20), "nesting deeper than"),
        # counted, not walked: an activation's receipts are one bin field (``wire.receipt.pack_chain``)
        (STAGE_PROTOCOL, lambda: _deep_bomb("activation", 8 << 20), "msgpack"),
        (STAGE_PROTOCOL, lambda: _wide_bomb("activation", 8 << 20), f"more than {Activation.bounds.objects} msgpack"),
        (STAGE_PROTOCOL, lambda: _deep_bomb("nonesuch", 8 << 20), "unknown message type"),
        (MESH_PROTOCOL, lambda: _wide_bomb("status", 4 << 20), "nesting deeper than"),
    ],
)
def test_an_array_bomb_near_the_cap_is_refused_before_it_is_built(
    protocol: str, build: Callable[[], bytes], fragment: str
) -> None:
    body = build()
    limits = protocol_limits(protocol)
    assert len(body) <= limits.max_message_bytes
    error, peak = refused_with_little_memory(body, limits)
    assert fragment in error.message
    # Unpacked, the same bytes are millions of lists (hundreds of MiB); refused, a few KiB.
    assert peak < 256 << 10, f"peak {peak} bytes"


def test_a_bomb_within_every_container_limit_is_stopped_by_the_total_budget() -> None:
    # Entries of 15 zeros: every array within Sync's limits and depth, one object over SWIM's
    # budget of 2**17 in all, in 128 KiB.
    entries = (SWIM.max_objects - 9) // 16 + 1
    body = head("swim.sync", 4) + msgpack.packb("reply") + b"\xc3" + msgpack.packb("entries") + array16(entries)
    body += (b"\x9f" + b"\x00" * 15) * entries
    error, peak = refused_with_little_memory(body, SWIM)
    assert f"more than {SWIM.max_objects} msgpack objects" in error.message
    # One entry fewer fits the budget: it gets past the walk, to the schema.
    fewer = head("swim.sync", 4) + msgpack.packb("reply") + b"\xc3" + msgpack.packb("entries") + array16(entries - 1)
    fewer += (b"\x9f" + b"\x00" * 15) * (entries - 1)
    with pytest.raises(ProtocolError, match="invalid swim.sync"):
        decode(framed(fewer), SWIM)
    assert peak < 64 << 10


def test_the_walk_counts_objects_exactly() -> None:
    wide = Bounds(str_bytes=1 << 20, bin_bytes=1 << 20, array_len=1 << 16, map_len=1 << 16, depth=64, objects=1 << 40)
    value = {"a": [1, [2, 3], {"b": b"x" * 10}], "c": "d"}
    objects = 1 + 2 * 3 + _count(value) - 1  # the top map, its 3 keys and values, and what the value holds
    assert objects == 18
    body = head("t", 3) + msgpack.packb("x") + msgpack.packb(value)
    pos = len(head("t", 3))
    walk_headers(body, pos, 2, wide, Limits(max_objects=objects), "t")
    with pytest.raises(ProtocolError, match=f"more than {objects - 1} msgpack objects"):
        walk_headers(body, pos, 2, wide, Limits(max_objects=objects - 1), "t")


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=40)
    | st.binary(max_size=300),
    lambda children: st.lists(children, max_size=20) | st.dictionaries(st.text(max_size=8), children, max_size=8),
    max_leaves=200,
)


def _count(value: Any) -> int:
    if isinstance(value, list):
        return 1 + sum(_count(v) for v in value)
    if isinstance(value, dict):
        return 1 + sum(1 + _count(v) for v in value.values())
    return 1


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=200, deadline=None)
@given(msgpack_values, st.integers(0, 400))
def test_the_walk_agrees_with_msgpack_on_any_value(value: Any, cut: int) -> None:
    wide = Bounds(str_bytes=1 << 20, bin_bytes=1 << 20, array_len=1 << 16, map_len=1 << 16, depth=64, objects=1 << 40)
    prefix = head("t", 3) + msgpack.packb("x")
    body = prefix + msgpack.packb(value, use_bin_type=True)
    objects = 1 + 2 * 3 + _count(value) - 1
    walk_headers(body, len(head("t", 3)), 2, wide, Limits(max_objects=objects, max_depth=1 + _depth(value)), "t")
    if _depth(value) > 0:
        with pytest.raises(ProtocolError, match="nesting"):
            walk_headers(body, len(head("t", 3)), 2, wide, Limits(max_depth=1 + _depth(value) - 1), "t")
    if cut < len(body) - len(prefix):
        # Any truncation is a typed error, never an IndexError or a pass.
        with pytest.raises(ProtocolError, match="truncated|after"):
            walk_headers(body[: len(body) - cut - 1], len(head("t", 3)), 2, wide, DEFAULT_LIMITS, "t")


# ----- per-protocol caps: small everywhere but the stage protocol, and large only in bin fields


def test_each_protocol_has_its_cap_within_the_link() -> None:
    assert SWIM.max_message_bytes == MESH.max_message_bytes == 4 << 20
    assert protocol_limits(HOP_PROTOCOL).max_message_bytes == protocol_limits(STOP_PROTOCOL).max_message_bytes == 4 << 10
    assert STAGE.max_message_bytes == 128 << 20
    link = Limits(max_message_bytes=1 << 20)
    assert protocol_limits(STAGE_PROTOCOL, link).max_message_bytes == 1 << 20
    assert protocol_limits("meshd/nonesuch/1", link) == link


def test_a_relay_message_over_its_cap_is_refused_at_the_length_prefix() -> None:
    decoder = MessageDecoder(protocol_limits(HOP_PROTOCOL))
    with pytest.raises(ProtocolError, match="exceeds the limit of 4096"):
        decoder.feed(_U32.pack(5000))
    assert decode(encode(Connect(target="a" * 40)), protocol_limits(HOP_PROTOCOL)) == Connect(target="a" * 40)


@pytest.mark.parametrize(
    ("tag", "limits", "fragment"),
    [
        # Schemas that allow megabytes in all (many records, many tensors), not in one string.
        ("swim.ping", SWIM, "a string of 1048576 bytes exceeds the schema's limit of 1356"),
        # counted (its receipts are one bin field): msgpack's own max_str_len refuses it
        ("activation", STAGE, "1048576 exceeds max_str_len(512)"),
        # Schemas whose whole message is smaller than the string.
        ("dial_back", MESH, "exceeds the 2136 its schema allows"),
        ("hop", STAGE, "exceeds the 766 its schema allows"),  # 747 before Hop gained start (the prefix cache)
    ],
)
def test_a_megabyte_string_is_refused_in_a_message_whose_schema_has_none(tag: str, limits: Limits, fragment: str) -> None:
    body = head(tag, 3) + msgpack.packb("x") + msgpack.packb("y" * (1 << 20))
    error, peak = refused_with_little_memory(body, limits)
    assert fragment in error.message
    assert peak < 64 << 10


def test_an_activation_carries_megabytes_only_in_bin_fields() -> None:
    many = head("activation", 3) + msgpack.packb("tensors") + msgpack.packb([0] * 100_000)
    error, _ = refused_with_little_memory(many, STAGE)
    assert "16" in error.message  # MAX_TENSORS: the longest list an activation has (its receipts are bytes)


# ----- token lists: packed, and bounded


def test_a_token_list_packs_to_four_bytes_a_token() -> None:
    tokens = list(range(100_000))
    data = encode(PromptTokens(session="s", epoch=0, tokens=tokens))
    # (the rest of the message, its grammar and generated count included, is under 96 bytes)
    assert len(data) < 4 * len(tokens) + 96
    back = decode(data, STAGE)
    assert isinstance(back, PromptTokens) and back.tokens == tokens


def test_a_token_list_over_the_limit_is_refused_before_it_is_built() -> None:
    packed = b"\x01\x00\x00\x00" * (MAX_TOKENS + 1)
    body = head("prompt_tokens", 5) + msgpack.packb("session") + msgpack.packb("s") + msgpack.packb("epoch") + b"\x00"
    body += msgpack.packb("tokens") + msgpack.packb(packed, use_bin_type=True)
    error, peak = refused_with_little_memory(body, STAGE)
    assert str(4 * MAX_TOKENS) in error.message
    assert peak < 64 << 10


def test_a_token_list_as_a_long_msgpack_array_is_refused() -> None:
    body = head("prompt", 5) + msgpack.packb("session") + msgpack.packb("s") + msgpack.packb("epoch") + b"\x00"
    body += msgpack.packb("tokens") + msgpack.packb(list(range(MAX_TOKENS)))
    error, _ = refused_with_little_memory(body, STAGE)
    assert "exceeds the schema's limit of 256" in error.message


def test_negative_packed_token_ids_are_a_typed_error() -> None:
    body = encode(PromptTokens(session="s", epoch=0, tokens=[1, 2]))
    # the last token's packed bytes, its sign bit set
    last = (2).to_bytes(4, "little")
    assert body.count(last) == 1
    bad = body.replace(last, b"\x02\x00\x00\xff")
    with pytest.raises(ProtocolError, match="never negative"):
        decode(bad, STAGE)


# ----- schema and codec limits agree


@pytest.mark.parametrize("chars", [70_000, 1 << 22])
@pytest.mark.parametrize("char", ["a", "\u00e9", "\U0001f600"])
def test_a_prompt_up_to_the_schema_limit_decodes(chars: int, char: str) -> None:
    prompt = Prompt(session="s", epoch=0, text=char * chars)
    back = decode(encode(prompt), STAGE)
    assert isinstance(back, Prompt) and back.text is not None and len(back.text) == chars


def test_a_prompt_over_the_schema_limit_is_a_typed_error_naming_the_limit() -> None:
    fields = Prompt(session="s", epoch=0, text="").__dict__ | {"text": "a" * ((1 << 22) + 1)}
    with pytest.raises(ProtocolError) as info:
        decode(encode(fields), STAGE)
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert "4194304" in info.value.message


def test_chat_messages_up_to_the_schema_limit_decode() -> None:
    prompt = Prompt(session="s", epoch=0, messages=[ChatMessage(role="user", content="b" * (1 << 20))] * 4)
    back = decode(encode(prompt), STAGE)
    assert back == prompt


# ----- big honest messages take the walk and pass; mutated ones give only typed errors

IDENTITIES = [NodeIdentity.from_private_bytes(bytes([i]) * 32) for i in range(40)]
RECORDS = [CapabilityRecord.create(identity, 1, addresses=[f"10.0.0.{i}:7000"]) for i, identity in enumerate(IDENTITIES)]


def _big_sync() -> Sync:
    return Sync(reply=True, entries=[SyncEntry(record=r, state="alive") for r in RECORDS])


def test_honest_messages_past_the_small_size_are_walked_and_decode() -> None:
    sync = _big_sync()
    data = encode(sync)
    assert len(data) > 4 << 10
    assert decode(data, SWIM) == sync
    status = StatusReply(node_id="a" * 40, term=1, members=[], coverage=[])
    assert decode(encode(status), MESH) == status


def test_mutated_walked_messages_give_only_typed_errors() -> None:
    rng = random.Random(11)
    samples: list[Message] = [_big_sync(), Activation.of(session="s", epoch=0, step=0, pos=0, n_tokens=2, tensors=[])]
    encoded = [encode(m) for m in samples]
    for _ in range(600):
        data = bytearray(rng.choice(encoded))
        for _ in range(rng.randint(1, 4)):
            position = rng.randrange(4, len(data))
            data[position] = rng.randrange(256)
        decoder = MessageDecoder(SWIM)
        try:
            decoder.feed(bytes(data))
            decoder.next_message()
        except ProtocolError as exc:
            assert isinstance(exc.code, ErrorCode)


def test_wire_meshrpc_reexports_the_swim_protocol() -> None:
    assert wire.meshrpc.SWIM_PROTOCOL == SWIM_PROTOCOL


def test_decode_body_refuses_a_map_that_does_not_begin_with_its_type() -> None:
    body = msgpack.packb({"v": 1, "type": "error", "code": "INTERNAL", "message": ""})
    with pytest.raises(ProtocolError, match="begins with"):
        decode_body(body)


# ----- a message longer than its schema allows is refused at its head, before its body is buffered


def test_a_control_message_claiming_megabytes_is_refused_at_its_head() -> None:
    from wire.stage import Cancel

    assert Cancel.bounds.encoded_bytes < 1 << 10
    decoder = MessageDecoder(STAGE)
    body_head = encode(Cancel(session="s", epoch=1))[PREFIX_BYTES:][:20]
    decoder.feed(_U32.pack(100 << 20))  # within the stage protocol's cap: buffering would begin
    with pytest.raises(ProtocolError, match="exceeds the 588 its schema allows"):
        decoder.feed(body_head + b"\x00" * 40)
    assert decoder.buffered < 100


def test_an_unknown_message_claiming_megabytes_is_refused_at_its_head() -> None:
    decoder = MessageDecoder(STAGE)
    decoder.feed(_U32.pack(100 << 20) + head("nonesuch", 3))
    with pytest.raises(ProtocolError, match="unknown message type"):
        decoder.feed(b"\x00" * 64)


def test_a_long_activation_is_buffered_and_decoded() -> None:
    import numpy as np

    from wire.tensors import TensorEntry

    activation = Activation.of(
        session="s", epoch=0, step=0, pos=0, n_tokens=64,
        tensors=[TensorEntry.from_array("hidden_states", np.ones((64, 1024), np.float32))],
    )
    data = encode(activation)
    decoder = MessageDecoder(STAGE)
    for start in range(0, len(data), 1000):
        decoder.feed(data[start : start + 1000])
    assert decoder.next_message() == activation


def test_a_bomb_no_longer_than_the_small_body_costs_at_most_its_length() -> None:
    # Neither walked nor counted (the per-token path pays for neither): 64 KiB of empty
    # arrays builds at most 64 Ki of them, a few MiB, and is refused.
    body = _wide_bomb("activation", 64 << 10)
    assert len(body) <= 64 << 10
    _, peak = refused_with_little_memory(body, STAGE)
    assert peak < 8 << 20, f"peak {peak} bytes"
    # One byte more is counted (an activation's receipts are one bin field, so its schema is as
    # shallow as counting covers), and refused at the schema's object count.
    error, peak = refused_with_little_memory(_wide_bomb("activation", (64 << 10) + 40), STAGE)
    assert f"more than {Activation.bounds.objects} msgpack objects" in error.message
    assert peak < 1 << 20
