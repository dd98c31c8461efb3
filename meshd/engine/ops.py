"""The engine worker's operations, typed: what the daemon asks of its worker, one closed model each.

A request travels as its ``header()`` (a msgpack map, ``meshd.engine.workerproto``),
with any rows in the frame's payload. The worker reads every header back with
``decode``, which checks it against the op's schema before a handler sees it: a
field missing, of another type, out of its bounds, or one the op does not have,
and an op nobody knows, are ``BadOp`` (the worker's typed InvalidInput reply),
never a KeyError deep in a handler. Field types come from the wire's one
vocabulary (``wire.types``); numbers that come from peers (positions, ids) are
bounded there. Replies and the worker's unasked events stay maps.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from meshd.engine.workerproto import MAX_HEADER
from wire.fastlink import KEY_BYTES
from wire.stage import Sampling
from wire.types import MAX_TOKEN_ID, MAX_TOKENS, Int32, TokenId, TokenIds


def _packed_ids(value: bytes) -> bytes:
    TokenIds.unpack(value)  # whole int32s, none negative, at most MAX_TOKENS
    return value


# int32 arrays as their bytes (sequence ids, positions, a want mask): one object, not a list of ints
Packed = Annotated[bytes, Field(max_length=4 * MAX_TOKENS)]
# token ids as their int32 bytes, checked as ``wire.types.TokenIds`` are
PackedIds = Annotated[bytes, Field(max_length=4 * MAX_TOKENS), AfterValidator(_packed_ids)]
Ids = Annotated[list[TokenId], Field(max_length=MAX_TOKENS)]
# ids to make text of: as many as a frame holds (the reply, not the request, may be what is too large)
FrameIds = Annotated[list[TokenId], Field(max_length=MAX_HEADER)]
# a KV position where -1 means "to the end" (llama.cpp's p1)
PosOrEnd = Annotated[int, Field(ge=-1, le=(1 << 31) - 1)]
# a drafted row's draft, -1 where the row's draft is unknown
Draft = Annotated[int, Field(ge=-1, le=MAX_TOKEN_ID)]
# a prompt's text or a chat message's, up to what one header holds (the stage bounded it by its budget first)
PromptText = Annotated[str, Field(max_length=MAX_HEADER)]


class Closed(BaseModel):
    # closed and strict, as the wire's messages are: a field the op does not have, or a value of
    # another type ("5" for 5), is refused, not coerced
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Op(Closed):
    op: str

    def header(self) -> dict[str, Any]:
        """The op as the map the worker reads back (``decode``)."""
        return self.model_dump()


class Ping(Op):
    op: Literal["ping"] = "ping"


class SlotHistory(Closed):
    """Tokens a sampler reads into its penalty history before it samples (the prompt's, at the tail)."""

    sid: Int32
    tokens: Ids


class Forward(Op):
    """One batched engine call. ``sample`` lists [output row, sampler id] or, for a drafted row,
    [output row, sampler id, the draft after it]: the tail samples those rows (``Worker.op_forward``)."""

    op: Literal["forward"] = "forward"
    seq: Packed
    pos: Packed
    tokens: PackedIds | None = None
    want: Packed | None = None
    sample: Annotated[list[Annotated[list[Draft], Field(min_length=2, max_length=3)]],
                      Field(max_length=MAX_TOKENS)] = []
    history: Annotated[list[SlotHistory], Field(max_length=MAX_TOKENS)] = []
    return_logits: bool = False


class Remove(Op):
    """Drops positions [p0, p1) of a sequence's KV (p1 -1: to its end); the whole of it ends a fast session on it."""

    op: Literal["remove"] = "remove"
    seq: Int32
    p0: Int32 = 0
    p1: PosOrEnd = -1


class PrefixKeep(Op):
    op: Literal["prefix_keep"] = "prefix_keep"
    seq: Int32
    upto: Int32


class PrefixCopy(Op):
    op: Literal["prefix_copy"] = "prefix_copy"
    src: Int32
    dst: Int32
    n: Int32


class FastOpen(Op):
    """A session whose rows go worker to worker (meshd.engine.fastpath)."""

    op: Literal["fast_open"] = "fast_open"
    seq: Int32
    tag: Int32
    max_pos: Int32
    prompt_len: Int32
    max_tokens: Int32 = 0
    start: Int32 = 0
    carry: Int32 = 0
    gets_ids: bool = False
    # the head: the prompt's ids; the tail: the prompt's ids as its sampler's penalty history
    prompt: Ids | None = None
    history: Ids | None = None
    chunk: Annotated[int, Field(ge=1, le=(1 << 31) - 1)] = 128
    # positions a signed span covers (0: receipts off), and the most drafts after a token (0: none)
    span: Int32 = 0
    max_draft: Int32 = 0


class FastLink(Op):
    """One of a fast session's connections, whose descriptor comes with the request."""

    op: Literal["fast_link"] = "fast_link"
    seq: Int32
    tag: Int32
    out: bool
    key: Annotated[bytes, Field(min_length=KEY_BYTES, max_length=KEY_BYTES)]


class FastState(Op):
    op: Literal["fast_state"] = "fast_state"
    seq: Int32


class FastStats(Op):
    op: Literal["fast_stats"] = "fast_stats"


class FastSeal(Op):
    op: Literal["fast_seal"] = "fast_seal"
    seq: Int32
    tag: Int32
    until: Int32


class FastInputs(Op):
    op: Literal["fast_inputs"] = "fast_inputs"
    seq: Int32
    tag: Int32
    until: Int32


class FastEnd(Op):
    op: Literal["fast_end"] = "fast_end"
    seq: Int32
    tag: Int32


class SeqPosMax(Op):
    op: Literal["seq_pos_max"] = "seq_pos_max"
    seq: Int32


class SamplerNew(Op):
    """A sampler for sequence ``sid`` (one before it is replaced), which reads ``history`` first."""

    op: Literal["sampler_new"] = "sampler_new"
    sid: Int32
    params: Sampling
    # how many of the likeliest tokens' log-probabilities its picks carry (None: no logprobs)
    logprobs: Int32 | None = None
    history: Ids = []


class SamplerFree(Op):
    op: Literal["sampler_free"] = "sampler_free"
    sid: Int32


class SamplerGrammar(Op):
    """Constrains a sampler by a grammar (``meshd.engine.chat``'s spec); ``generated`` is read by it first."""

    op: Literal["sampler_grammar"] = "sampler_grammar"
    sid: Int32
    spec: dict[str, Any]
    generated: Ids = []


class Tokenize(Op):
    """The prompt's ids: of ``text`` (``special``: its special tokens' text are the tokens), or of
    ``messages`` in the model's chat template."""

    op: Literal["tokenize"] = "tokenize"
    text: PromptText | None = None
    messages: Annotated[list[dict[str, PromptText]], Field(max_length=MAX_TOKENS)] | None = None
    special: bool = False


class Detokenize(Op):
    op: Literal["detokenize"] = "detokenize"
    tokens: FrameIds


class ChatInfo(Op):
    op: Literal["chat_info"] = "chat_info"


class VocabDigest(Op):
    op: Literal["vocab_digest"] = "vocab_digest"


AnyOp = (Ping | Forward | Remove | PrefixKeep | PrefixCopy | FastOpen | FastLink | FastState | FastStats | FastSeal
         | FastInputs | FastEnd | SeqPosMax | SamplerNew | SamplerFree | SamplerGrammar | Tokenize | Detokenize
         | ChatInfo | VocabDigest)
_OPS: TypeAdapter[AnyOp] = TypeAdapter(Annotated[AnyOp, Field(discriminator="op")])


class BadOp(Exception):
    """A request header that is no op of the worker's: its message names the op and the field."""


def decode(header: dict[str, Any]) -> AnyOp:
    """The op ``header`` is, checked against its schema; BadOp says what is wrong with it."""
    try:
        return _OPS.validate_python(header)
    except ValidationError as exc:
        name = header.get("op")
        error = exc.errors(include_url=False)[0]
        if error["type"] in ("union_tag_invalid", "union_tag_not_found"):
            raise BadOp(f"unknown worker op {name!r}") from None
        where = ".".join(str(part) for part in error["loc"][1:]) or "the request"
        raise BadOp(f"bad {name} request: {where}: {error['msg']}") from None
