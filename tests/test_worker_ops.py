"""The engine worker's typed operations (meshd.engine.ops): every op a header round-trips, and a malformed
one, whatever its shape, is a typed BadOp naming the op and the field, never another exception."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.engine import ops
from wire.fastlink import KEY_BYTES
from wire.stage import Sampling

EVERY_OP: list[ops.Op] = [
    ops.Ping(),
    ops.Forward(seq=np.zeros(2, np.int32).tobytes(), pos=np.arange(2, dtype=np.int32).tobytes(),
                tokens=np.asarray([5, 6], np.int32).tobytes(), want=np.asarray([0, 1], np.int8).tobytes(),
                sample=[[1, 0], [1, 0, 7]], history=[ops.SlotHistory(sid=0, tokens=[1, 2])]),
    ops.Remove(seq=1), ops.Remove(seq=1, p0=4, p1=9),
    ops.PrefixKeep(seq=1, upto=64), ops.PrefixCopy(src=1, dst=2, n=32),
    ops.FastOpen(seq=0, tag=1, max_pos=64, prompt_len=3, prompt=[1, 2, 3], span=16, max_draft=4),
    ops.FastLink(seq=0, tag=1, out=True, key=b"k" * KEY_BYTES), ops.FastState(seq=0), ops.FastStats(),
    ops.FastSeal(seq=0, tag=1, until=9), ops.FastInputs(seq=0, tag=1, until=9), ops.FastEnd(seq=0, tag=1),
    ops.SeqPosMax(seq=0),
    ops.SamplerNew(sid=0, params=Sampling(temperature=0.7, seed=3), logprobs=2, history=[4]),
    ops.SamplerFree(sid=0), ops.SamplerGrammar(sid=0, spec={"grammar": "root ::= \"a\""}, generated=[1]),
    ops.Tokenize(text="the cat", special=True), ops.Tokenize(messages=[{"role": "user", "content": "hi"}]),
    ops.Detokenize(tokens=[1, 2]), ops.ChatInfo(), ops.VocabDigest(),
]


@pytest.mark.parametrize("op", EVERY_OP, ids=lambda op: op.op)
def test_every_op_decodes_from_its_header_as_itself(op: ops.Op) -> None:
    assert ops.decode(op.header()) == op


MALFORMED: dict[str, tuple[dict[str, Any], str]] = {
    "an op nobody knows": ({"op": "format_disk"}, "unknown worker op 'format_disk'"),
    "no op at all": ({"seq": 1}, "unknown worker op None"),
    "an op that is not a string": ({"op": 5}, "unknown worker op 5"),
    "a field the op lacks": ({"op": "remove", "seq": 1, "p2": 3}, "bad remove request: p2: Extra inputs"),
    "a field missing": ({"op": "prefix_copy", "src": 1, "dst": 2}, "bad prefix_copy request: n: Field required"),
    "a string for a number": ({"op": "sampler_free", "sid": "0"}, "bad sampler_free request: sid: Input should be"),
    "a sequence past int32": ({"op": "remove", "seq": 2**31}, "bad remove request: seq: Input should be less"),
    "a negative position": ({"op": "remove", "seq": 1, "p0": -5}, "bad remove request: p0: Input should be greater"),
    "rows' positions as a list": ({"op": "forward", "seq": b"", "pos": [0, 1]}, "bad forward request: pos:"),
    "a negative token id, packed": ({"op": "forward", "seq": b"", "pos": b"", "tokens": b"\x00\x00\x00\x80"},
                                    "bad forward request: tokens: Value error, token ids are never negative"),
    "a sample row of one number": ({"op": "forward", "seq": b"", "pos": b"", "sample": [[3]]},
                                   "bad forward request: sample.0: List should have at least 2 items"),
    "history not of samplers": ({"op": "forward", "seq": b"", "pos": b"", "history": [1, 2, 3]},
                                "bad forward request: history.0:"),
    "sampler params not a map": ({"op": "sampler_new", "sid": 0, "params": [1, 2]},
                                 "bad sampler_new request: params:"),
    "a fast link key of another length": ({"op": "fast_link", "seq": 0, "tag": 1, "out": True, "key": b"short"},
                                          "bad fast_link request: key:"),
    "a chat line not of strings": ({"op": "tokenize", "messages": [{"role": 1}]}, "bad tokenize request: messages.0.role"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_op_is_a_bad_op_naming_the_field(name: str) -> None:
    header, said = MALFORMED[name]
    with pytest.raises(ops.BadOp) as refused:
        ops.decode(header)
    assert str(refused.value).startswith(said), str(refused.value)


OP_NAMES = sorted({op.op for op in EVERY_OP} | {"nope"})
values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = sorted({name for op in EVERY_OP for name in op.header()} - {"op"})


@settings(max_examples=400, deadline=None)
@given(header=st.fixed_dictionaries({"op": st.sampled_from(OP_NAMES) | values},
                                    optional={name: values for name in FIELDS}))
def test_whatever_a_header_holds_it_decodes_or_is_a_bad_op(header: dict[str, Any]) -> None:
    try:
        op = ops.decode(header)
    except ops.BadOp as exc:
        assert str(exc).startswith(("unknown worker op", f"bad {header['op']} request: ")), str(exc)
    else:
        assert op.op == header["op"] and ops.decode(op.header()) == op
