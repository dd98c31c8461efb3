"""The wire vocabulary: field types defined once, the message base, the unvalidated
constructor checked against pydantic's own, packed token ids, pinned encodings."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import relay.protocol
import wire.meshrpc
import wire.stage
import wire.swim
from wire.bounds import schema_bounds
from wire.credit import WorkGive, WorkSummary
from wire.decode import decode
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.meshrpc import RouteReply, RouteStage, StatusRequest
from wire.message import ErrorMessage, Message, WireModel, encode, registered
from wire.receipt import NO_PREV, Receipt
from wire.stage import Open, PeerRef, Prompt, PromptTokens, Sampling, Token
from wire.swim import Alive, CapabilityRecord, ModelInfo, Ping, ServedRange, Sync, SyncEntry
from wire.tensors import Activation, TensorEntry, encode_activation, tensor_fields
from wire.types import MAX_TOKENS, TokenIds

ROOT = Path(__file__).resolve().parent.parent
FAST = settings(max_examples=60, deadline=None)

# ----- one definition of each field type


def test_the_shared_field_types_are_defined_only_in_wire_types() -> None:
    shared = ("NodeId", "Digest", "Layer", "Epoch", "Address", "SessionId", "TokenId", "Count", "Text")
    pattern = re.compile(rf"^_?({'|'.join(shared)}|Seq|Role)\s*=\s*Annotated\[", re.MULTILINE)
    offenders = []
    for room in ("wire", "relay", "meshd"):
        for path in sorted((ROOT / room).rglob("*.py")):
            if path == ROOT / "wire" / "types.py":
                continue
            offenders += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in pattern.finditer(path.read_text())]
    assert offenders == []


def test_every_module_uses_the_same_node_id_bounds() -> None:
    too_long = "a" * 65
    for build in (
        lambda: wire.meshrpc.RouteStage(node_id=too_long, address="h:1", start=0, end=1),
        lambda: wire.stage.PeerRef(address="h:1", node_id=too_long),
        lambda: relay.protocol.Connect(target=too_long),
        lambda: wire.swim.Suspect(node=too_long, incarnation=0, accuser="b"),
    ):
        with pytest.raises(ValueError):
            build()


# ----- the message base


def test_a_message_header_sets_its_tag_and_version_first_and_registers_it() -> None:
    class Probe(Message, tag="test.probe", version=3):
        value: int

    message = Probe(value=7)
    assert (message.type, message.v) == ("test.probe", 3)
    assert list(Probe.model_fields)[:2] == ["type", "v"]
    assert registered("test.probe", 3) is Probe
    assert decode(encode(message)) == message
    with pytest.raises(ValueError):
        Probe(type="other", value=1)  # type: ignore[arg-type]


def test_a_message_without_a_tag_is_an_abstract_base() -> None:
    class Base(Message):
        pass

    with pytest.raises(ProtocolError, match="unknown message type"):
        decode(encode(Base()))

    class Concrete(Base, tag="test.concrete"):
        pass

    assert registered("test.concrete") is Concrete


def test_a_message_field_without_a_bound_is_refused_at_class_creation() -> None:
    with pytest.raises(TypeError, match="needs a max_length"):

        class Unbounded(Message, tag="test.unbounded"):
            text: str

    with pytest.raises(TypeError, match="needs a max_length"):

        class UnboundedList(Message, tag="test.unbounded_list"):
            items: list[int]


@pytest.mark.parametrize("tag", ["", "x" * 32, "caf\u00e9"])
def test_a_message_tag_fits_the_fixed_head(tag: str) -> None:
    with pytest.raises(ValueError, match="message tag"):

        class Bad(Message, tag=tag):
            pass


def test_every_registered_schema_bounds_its_field_names_as_strings() -> None:
    for model in (Open, Prompt, Activation, Sync, RouteReply, relay.protocol.Reserved, ErrorMessage):
        bounds = schema_bounds(model)
        assert bounds.str_bytes >= max(len(name) for name in model.model_fields)
        assert bounds.map_len >= len(model.model_fields)


# ----- the unvalidated constructor, against pydantic's model_construct

session_ids = st.text("0123456789abcdef", min_size=1, max_size=24)
counts = st.integers(0, (1 << 63) - 1)
small = st.integers(0, (1 << 31) - 1)


def _same_as_model_construct(model: type[WireModel], fields: dict[str, Any]) -> None:
    ours = model.unvalidated(dict(fields))
    theirs = model.model_construct(**fields)
    assert ours.__dict__ == theirs.__dict__
    assert list(ours.__dict__) == list(theirs.__dict__)
    assert ours.model_fields_set == theirs.model_fields_set
    # Every attribute pydantic keeps on an instance (what pickling takes), not only the fields.
    assert ours.__getstate__() == theirs.__getstate__()
    assert ours == theirs and theirs == ours
    assert ours.model_dump() == theirs.model_dump()
    if isinstance(ours, Message):
        assert isinstance(theirs, Message)
        assert encode(ours) == encode(theirs)
        # What was valid stays valid: the receiver gets an equal, validated message.
        assert decode(encode(ours)) == ours


@FAST
@given(session_ids, counts, st.integers(0, 1 << 20), st.integers(0, MAX_TOKENS - 1), st.binary(max_size=64))
def test_unvalidated_token_matches_model_construct(session: str, epoch: int, index: int, token: int, piece: bytes) -> None:
    fields = {"type": "token", "v": 1, "session": session, "epoch": epoch, "index": index, "token": token, "piece": piece,
              "receipts": None, "logprob": None, "top_logprobs": None}
    _same_as_model_construct(Token, fields)


@FAST
@given(
    session_ids,
    counts,
    counts,
    small,
    st.integers(1, 8),
    st.sampled_from(["f32", "f16", "bf16", "q8_0"]),
    st.sampled_from(["raw", "zstd"]),
    st.none() | st.lists(st.integers(0, (1 << 31) - 1), max_size=8),
    st.none() | small,
)
def test_unvalidated_activation_matches_model_construct(
    session: str,
    epoch: int,
    step: int,
    pos: int,
    rows: int,
    dtype: Any,
    codec: Any,
    tokens: list[int] | None,
    deadline_ms: int | None,
) -> None:
    array = np.linspace(-1.0, 1.0, rows * 8, dtype=np.float32).reshape(rows, 8)
    entry_fields = tensor_fields("hidden_states", array, dtype, codec)
    _same_as_model_construct(TensorEntry, entry_fields)
    fields = {
        "type": "activation",
        "v": 1,
        "session": session,
        "epoch": epoch,
        "step": step,
        "pos": pos,
        "n_tokens": rows,
        "tensors": [TensorEntry.unvalidated(dict(entry_fields))],
        "tokens": None if tokens is None else TokenIds.of(tokens),
        "deadline_ms": deadline_ms,
        "drafts": 0,
        "receipts": None,
    }
    _same_as_model_construct(Activation, fields)
    # The model-free send path gives the same bytes.
    built = Activation.of(
        session=session, epoch=epoch, step=step, pos=pos, n_tokens=rows, tensors=[TensorEntry.unvalidated(dict(entry_fields))],
        tokens=tokens, deadline_ms=deadline_ms,
    )
    assert encode(built) == encode_activation(
        session=session, epoch=epoch, step=step, pos=pos, n_tokens=rows, tensors=[entry_fields], tokens=tokens,
        deadline_ms=deadline_ms,
    )


IDENTITY = NodeIdentity.from_private_bytes(bytes(range(32)))
STAGE_IDENTITY = NodeIdentity.from_private_bytes(bytes(range(32, 64)))
RECORD = CapabilityRecord.create(
    IDENTITY,
    5,
    addresses=["10.0.0.1:7000"],
    models=[ModelInfo(digest="ab" * 32, name="tiny", n_layers=30, bytes_per_layer=1 << 20, kv_bytes_per_token=256)],
    served=[ServedRange(model="ab" * 32, start=0, end=30)],
)


@FAST
@given(counts, counts, st.lists(st.sampled_from(["alive", "suspect", "dead", "left"]), max_size=4), st.booleans())
def test_unvalidated_swim_messages_match_model_construct(seq: int, version: int, states: list[str], reply: bool) -> None:
    alive = {"kind": "alive", "record": RECORD}
    _same_as_model_construct(Alive, alive)
    ping = {"type": "swim.ping", "v": 1, "seq": seq, "version": version, "gossip": [Alive.unvalidated(dict(alive))]}
    _same_as_model_construct(Ping, ping)
    entries = [SyncEntry.unvalidated({"record": RECORD, "state": state}) for state in states]
    _same_as_model_construct(Sync, {"type": "swim.sync", "v": 1, "reply": reply, "entries": entries})


def test_unvalidated_nested_defaults_match_model_construct() -> None:
    fields = Open(session="s", epoch=1, model_digest="d", layer_begin=0, layer_end=4).__dict__
    _same_as_model_construct(Open, dict(fields))
    _same_as_model_construct(Sampling, dict(Sampling().__dict__))
    _same_as_model_construct(PeerRef, {"address": "h:1", "node_id": None})


# ----- packed token ids


@FAST
@given(st.lists(st.integers(0, (1 << 31) - 1), max_size=300))
def test_token_ids_round_trip_packed_as_int32(tokens: list[int]) -> None:
    message = PromptTokens(session="s", epoch=0, tokens=tokens)
    assert isinstance(message.tokens, TokenIds)
    assert message.tokens == tokens and list(message.tokens) == tokens and len(message.tokens) == len(tokens)
    assert np.asarray(message.tokens, np.int32).tolist() == tokens
    back = decode(encode(message))
    assert isinstance(back, PromptTokens) and back == message and back.tokens == tokens
    # One bin: the ids and a few bytes of header, not an array of msgpack ints.
    assert bytes(message.tokens.packed) in encode(message)
    assert message.tokens.packed == np.asarray(tokens, "<i4").tobytes()


@pytest.mark.parametrize(
    ("tokens", "fragment"),
    [
        ([-1], "0 to"),
        ([1 << 31], "0 to"),
        ([1.5], "flat sequence of ints"),
        ([[1]], "flat sequence of ints"),
        (b"\x01\x00\x00", "4 bytes each"),
        (b"\x00\x00\x00\x80", "never negative"),
        (b"\x00" * (4 * MAX_TOKENS + 4), "exceed the limit"),
        ("1234", "packed int32 bytes or a list"),
    ],
)
def test_token_ids_out_of_bounds_are_refused(tokens: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        PromptTokens(session="s", epoch=0, tokens=tokens)  # type: ignore[arg-type]


# ----- the wire format stays byte-identical (hex produced by the code before the change; in
# wire_pins.txt, `open` and `record_ping` were made anew when Open gained wire_codec and the
# record assignment_version; `record_ping` again when the record gained `holds`, gpu_memory_bytes
# and gpu_layers, ModelInfo `whole` and layer_bytes, and the election vote; `open`, `activation`
# and `activation_fields` when Open gained speculate and max_draft and Activation drafts; `record_ping`
# when ModelInfo gained `cuts`; `open` again when it gained receipts and check, output verification's;
# `token`, `activation` and `activation_fields` when receipts moved inside them, meshd/stage/2;
# `open` when it gained fast, the fast path's, meshd/stage/4; `record_ping` when the record gained
# the tracker's signed `placement`, meshd/mesh/authority; `route` when RouteReply gained the replicas
# of its stages, for the asker's spot checks; `record_ping` when the record gained `numerics`; `open`
# when it gained payer, the credit ledger's voucher, meshd/stage/5, and `work_give` is the ledger's summary;
# `record_ping` when ModelInfo gained `hub`, the hub file a volunteer fetches from, meshd.fetch.hub; `record_ping`
# again when the record gained `offload`, what its stage put on a GPU and where; `open` when it gained
# chat_template and logprobs, and `token` logprob and top_logprobs, meshd/stage/6; `work_give` when the
# receipt gained t_us, the stage's own time, meshd/receipt/4 and meshd/stage/7)

_PINNED = {
    "error": "0000003d85a474797065a56572726f72a17601a4636f6465aa4f5645524c4f41444544a76d657373616765a46275"
    "7379ae72657472795f61667465725f6d73ccfa",
    # made anew when StatusRequest gained its offset (status comes in pages)
    "status_request": "0000002083a474797065ae7374617475735f72657175657374a17601a66f666673657400",
}


def _pinned_samples() -> dict[str, Message]:
    return {
        "error": ErrorMessage(code=ErrorCode.OVERLOADED, message="busy", retry_after_ms=250),
        "status_request": StatusRequest(),
    }


@pytest.mark.parametrize("name", sorted(_PINNED))
def test_encodings_are_pinned(name: str) -> None:
    assert encode(_pinned_samples()[name]).hex() == _PINNED[name]


def test_richer_encodings_are_pinned() -> None:
    pinned = Path(__file__).with_name("wire_pins.txt").read_text().split()
    expected = dict(zip(pinned[::2], pinned[1::2], strict=True))
    samples: dict[str, bytes] = {
        "open": encode(
            Open(
                session="s1", epoch=3, model_digest="ab" * 32, layer_begin=0, layer_end=12,
                next=PeerRef(address="10.0.0.2:7000", node_id="c" * 40), max_tokens=16, stop=["\n\n"],
            )
        ),
        "token": encode(Token(session="s1", epoch=3, index=0, token=42, piece=b"hi")),
        "route": encode(
            RouteReply(
                model="ab" * 32, n_layers=30,
                stages=[RouteStage(node_id="c" * 40, address="10.0.0.2:7000", start=0, end=30)], seconds_per_token=0.01,
            )
        ),
        "connect": encode(relay.protocol.Connect(target="d" * 40)),
        "activation": encode(
            Activation.of(
                session="s1", epoch=3, step=7, pos=9, n_tokens=1,
                tensors=[TensorEntry.from_array("hidden_states", np.arange(8, dtype=np.float32).reshape(1, 8))],
            )
        ),
        "activation_fields": encode_activation(
            session="s1", epoch=3, step=7, pos=9, n_tokens=1,
            tensors=[tensor_fields("hidden_states", np.arange(8, dtype=np.float32).reshape(1, 8), "q8_0", "zstd")],
        ),
        "record_ping": encode(Ping(seq=1, version=5, gossip=[Alive(record=RECORD)])),
        "work_give": encode(WorkGive(summaries=[WorkSummary.create(
            IDENTITY, "ab" * 32, 0, 12, 9, 7, True, 1_800_000_000,
            Receipt.build("s1", 3, 15, 1, "ab" * 32, 0, 12, b"i" * 16, b"o" * 16, b"h" * 16, NO_PREV,
                          STAGE_IDENTITY.public_key, STAGE_IDENTITY))])),
    }
    assert {name: data.hex() for name, data in samples.items()} == expected


def test_a_typed_error_survives_the_new_base() -> None:
    error = ProtocolError(ErrorCode.NOT_FOUND, "nope")
    back = decode(encode(ErrorMessage(code=error.code, message=error.message)))
    assert isinstance(back, ErrorMessage) and back.code is ErrorCode.NOT_FOUND
