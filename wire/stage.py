"""Messages of the stage protocol: how an asker drives a session along a route.

One control stream per (asker, stage) carries open / prompt / cancel and the
replies; the tail streams tokens on its control stream. Between stages, one
hop stream per session carries ``Activation`` messages downstream, and a ring
stream carries each sampled token from the tail back to the head.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Annotated, Literal

from pydantic import Field

from wire.credit import Voucher
from wire.fastlink import KEY_BYTES, TOKEN_BYTES
from wire.limits import Limits, register_protocol
from wire.message import Message, WireModel
from wire.receipt import Chain
from wire.sketch import MAX_SKETCH_K
from wire.tensors import MAX_DRAFT, TensorCodec, TensorEntry
from wire.types import MAX_TOKENS, Address, Digest, Epoch, Int32, Layer, NodeId, SessionId, Text, TokenId, Tokens

# 2: a tail waits for the asker's PromptTokens before it samples, receipts are meshd/receipt/2 and
# ride inside the activations and tokens they speak of, not in messages of their own; a peer of /1
# would stall or fail on all three, so the peer set tells it the versions differ instead
# 3: receipts sign meshd/receipt/3 bytes (a fixed layout): a peer of /2 would find every signature bad
# 4: the fast path (Open.fast, Hop.fast): a peer of /3 would refuse both fields
# 5: Open.payer, the member whose credit a session asks on (wire.credit.Voucher), and the prefix cache
# (Prompt.cache, Hop.start, CacheLookup/CacheFound/CacheUse, StageInfo.cache_tokens): a peer of /4 would
# refuse them
# 6: the model's own chat template and grammars (Open.chat_template, Opened.chat, Prompt.special and
# grammar, PromptTokens.grammar and generated), logprobs (Open.logprobs, Token.logprob and
# top_logprobs): a peer of /5 would refuse them
# 7: receipts sign meshd/receipt/4 bytes, with the stage's own time on the rows (Receipt.t_us), 4 bytes
# longer: a peer of /6 would read every chain as garbage
STAGE_PROTOCOL = "meshd/stage/7"

# the most stages a route can have: every stage holds at least one layer
MAX_ROUTE = 1 << 10

# Control and hop streams: activations are large (in one bin each), every
# other message is held to its schema's bounds by the codec.
register_protocol(STAGE_PROTOCOL, Limits(max_message_bytes=128 << 20, max_objects=1 << 16, max_depth=8))


class PeerRef(WireModel):
    address: Address
    node_id: NodeId | None = None


class Sampling(WireModel):
    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_k: int = Field(default=0, ge=0, le=1 << 20)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repeat_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    repeat_last_n: int = Field(default=64, ge=-1, le=1 << 20)
    seed: int = Field(default=0, ge=0, le=(1 << 32) - 1)


# OpenAI's top_logprobs bound
MAX_TOP_LOGPROBS = 20
# the largest of the 71 templates in llama.cpp's models/templates is 16.7 KiB (gpt-oss)
MAX_TEMPLATE = 256 << 10
# a tool-call grammar grows with the tools' schemas: llama.cpp's for 16 tools of a few fields each is ~20 KiB
MAX_GRAMMAR = 1 << 20


class ChatTemplate(WireModel):
    """The model's chat template as its head read it from the GGUF (``tokenizer.chat_template`` and the
    ``tool_use`` variant; "" where the file has none), and the BOS and EOS it names: what an asker needs
    to render a chat request itself (meshd.engine.chat)."""

    template: Annotated[str, Field(max_length=MAX_TEMPLATE)] = ""
    tool_use_template: Annotated[str, Field(max_length=MAX_TEMPLATE)] = ""
    bos_token: Annotated[str, Field(max_length=256)] = ""
    eos_token: Annotated[str, Field(max_length=256)] = ""
    # the tokenizer adds them itself: a rendered prompt does not carry them twice
    add_bos: bool = False
    add_eos: bool = False


class GrammarTrigger(WireModel):
    type: Literal["word", "pattern", "pattern_full", "token"]
    value: Annotated[str, Field(max_length=4096)]


class Grammar(WireModel):
    """A GBNF grammar the tail's sampler obeys (llama.cpp's grammar sampler): a tool call's or a JSON
    schema's, from llama.cpp's common/chat. A lazy one waits for a trigger (a word, a pattern or a
    token) before it constrains anything."""

    gbnf: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR)]
    lazy: bool = False
    triggers: list[GrammarTrigger] = Field(default_factory=list, max_length=64)
    # strings the template treats as single tokens (a trigger word that is one is matched by id)
    preserved_tokens: list[Annotated[str, Field(max_length=256)]] = Field(default_factory=list, max_length=256)
    # what the template put after the prompt for the answer to continue from; with prefill the
    # grammar reads it first (as llama.cpp does for tool-call and output-format grammars)
    generation_prompt: Annotated[str, Field(max_length=4096)] = ""
    prefill: bool = False


class ChatMessage(WireModel):
    role: Annotated[str, Field(min_length=1, max_length=32)]
    content: Annotated[str, Field(max_length=1 << 20)]


class StageInfo(WireModel):
    """What a stage serves, as its ``Opened`` says."""

    node_id: NodeId
    model_digest: Digest
    model_name: str = Field(max_length=256)
    layer_begin: Layer
    layer_end: Layer
    n_layer: Layer
    # floats per token row the stage takes and puts out (the engine's, from the loaded model)
    stage_width: int = Field(ge=1, le=1 << 20)
    ready: bool
    # its layers route by token id (DeepSeek V4's hash-routed layers): its activations must carry the ids
    needs_tokens: bool = False
    # the numerics its engine computes with (build and backend): a replica's bytes are comparable only
    # within one ("": not said)
    numerics: Text = ""
    # the KV tokens its prefix cache keeps of finished sessions' prompts (0: it keeps none)
    cache_tokens: int = Field(default=0, ge=0, le=1 << 30)


class Open(Message, tag="open"):
    """Opens (or, with a higher epoch, re-opens) a session on one stage of a route."""

    session: SessionId
    epoch: Epoch
    # what the asker expects the stage to serve (from the route); None: whatever it serves,
    # and the asker checks the ``StageInfo`` in ``Opened``
    model_digest: Digest | None = None
    layer_begin: Layer | None = None
    layer_end: Layer | None = None
    next: PeerRef | None = None
    head: PeerRef | None = None
    # the one node whose hop (or, at the head, ring) stream feeds this session: the
    # previous stage (at the head, the tail); None: the opener feeds it itself
    upstream: NodeId | None = None
    sampling: Sampling = Sampling()
    max_tokens: int = Field(default=256, ge=1, le=1 << 20)
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list, max_length=16)
    # how this session's hidden states travel on every hop: a stage sends them so and refuses
    # anything else before it decompresses or dequantises a byte
    wire_dtype: Literal["f32", "f16", "q8_0"] = "f32"
    wire_codec: TensorCodec = "raw"
    # speculative decoding: the tail drafts up to ``max_draft`` tokens by prompt lookup (n-grams
    # of the session's own tokens) or with its draft model; exact under greedy and seeded sampling alike
    speculate: Literal["off", "ngram", "model"] = "off"
    max_draft: int = Field(default=8, ge=1, le=MAX_DRAFT)
    # output verification: every stage signs a receipt of each step (``wire.receipt``), checks the
    # chain that comes with its input, and the tail sends the whole route's chain to the asker
    receipts: bool = False
    # a check session (the asker's spot check on a replica): fed by its opener, no next stage;
    # each step's receipt goes back to the opener
    check: bool = False
    # a check session across numerics fingerprints (wire.sketch): each receipt comes with a sketch of
    # the step's output, its rows' ``sketch`` largest entries (at the tail: each pick's likeliest tokens)
    sketch: int = Field(default=0, ge=0, le=MAX_SKETCH_K)
    # the fast path (wire.fastlink): the session's rows go from engine worker to engine worker on
    # connections of their own, not through the daemons; the asker asks for it on every stage of
    # a route whose hops are all direct, without receipts or speculation
    fast: bool = False
    # the member on whose credit the opener asks (an identity of `meshd ask`'s or the front door's own,
    # vouched for by its member): the stage ranks the session by that member's credit under contention
    payer: Voucher | None = None
    # the head answers with its model's chat template (Opened.chat): the asker renders the chat itself
    chat_template: bool = False
    # the tail tells each token's log-probability and this many of the likeliest tokens' (None: none)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class Opened(Message, tag="opened"):
    session: SessionId
    epoch: Epoch
    info: StageInfo
    chat: ChatTemplate | None = None


class Prompt(Message, tag="prompt"):
    """To the head: chat messages, raw text or token ids (a re-prefill after a failover)."""

    session: SessionId
    epoch: Epoch
    messages: list[ChatMessage] | None = Field(default=None, max_length=256)
    text: str | None = Field(default=None, max_length=1 << 22)
    tokens: Tokens | None = None
    generated: int = Field(default=0, ge=0, le=1 << 20)
    # how many stages after the head get the token ids with the rows: up to the last whose layers
    # route by token id (its ``StageInfo.needs_tokens``); the others get rows only
    carry_tokens: int = Field(default=0, ge=0, le=MAX_ROUTE)
    # the prefix cache: the head tokenizes and answers ``PromptTokens``, then runs nothing until the
    # asker's ``CacheUse`` says from which position the prompt's rows begin
    cache: bool = False
    # text is a chat the asker rendered with the model's template: its special tokens are parsed
    special: bool = False
    # a one-stage route: the grammar its sampler obeys (on a longer route it rides in PromptTokens)
    grammar: Grammar | None = None


class PromptTokens(Message, tag="prompt_tokens"):
    """From the head to the asker: the prompt as token ids; from the asker to the tail: its sampler's
    penalty history and its drafter's text (no stage between them is sent the ids it does not need)."""

    session: SessionId
    epoch: Epoch
    tokens: Tokens
    # to the tail: the grammar its sampler obeys, and how many of the tokens' last ones were generated
    # before (a failover's re-prefill), which the grammar reads first
    grammar: Grammar | None = None
    generated: int = Field(default=0, ge=0, le=1 << 20)


class FastOffer(WireModel):
    """A fast session's connection to the next stage: the single-use token its preamble brings,
    and the key its frames are sealed with. Both ride only inside the Noise link between the two
    stages."""

    token: Annotated[bytes, Field(min_length=TOKEN_BYTES, max_length=TOKEN_BYTES)]
    key: Annotated[bytes, Field(min_length=KEY_BYTES, max_length=KEY_BYTES)]


class Hop(Message, tag="hop"):
    """First message on a stage-to-stage stream: which session it carries."""

    session: SessionId
    epoch: Epoch
    ring: bool = False
    # the tail samples once it has seen this many positions
    prompt_tokens: int = Field(default=0, ge=0, le=1 << 20)
    # how many stages from this one on get the token ids with the rows (``Prompt.carry_tokens``,
    # one less each hop): a stage the count does not reach gets rows only
    carry_tokens: int = Field(default=0, ge=0, le=MAX_ROUTE)
    # a fast session: the rows come on the connection this offer names, and the stream only says
    # (by ending) when the sending stage is gone
    fast: FastOffer | None = None
    # the prefix cache: the session's rows begin at this position; the positions before it are the
    # receiving stage's own cached KV, found by the asker's ``CacheLookup`` (a stage holding fewer fails it)
    start: int = Field(default=0, ge=0, le=1 << 20)


class TopLogprob(WireModel):
    token: TokenId
    logprob: float = Field(le=0.0)
    piece: bytes = Field(max_length=1 << 10)


class Token(Message, tag="token"):
    session: SessionId
    epoch: Epoch
    index: int = Field(ge=0, le=1 << 20)
    token: TokenId
    piece: bytes = Field(max_length=1 << 10)
    # with receipts on: the route's receipts of the step that sampled this token, head first
    receipts: Chain | None = None
    # with Open.logprobs: the token's log-probability under the model (its raw logits), and the likeliest
    # tokens' (the grammar and the sampling parameters change the pick, not these)
    logprob: float | None = Field(default=None, le=0.0)
    top_logprobs: list[TopLogprob] | None = Field(default=None, max_length=MAX_TOP_LOGPROBS)


class Done(Message, tag="done"):
    session: SessionId
    epoch: Epoch
    reason: Literal["eog", "max_tokens", "stop"]
    generated: int = Field(ge=0, le=1 << 20)
    # speculative decoding at the tail: tokens drafted, and how many of them its sampler agreed with
    drafted: int = Field(default=0, ge=0, le=1 << 24)
    accepted: int = Field(default=0, ge=0, le=1 << 24)


class Cancel(Message, tag="cancel"):
    session: SessionId
    epoch: Epoch


class Released(Message, tag="released"):
    session: SessionId


class InputsRequest(Message, tag="inputs_request"):
    """To a stage with receipts on: the input rows it kept of the steps before position ``until``
    (it forgets them once sent), so the asker can run them again on a replica."""

    session: SessionId
    epoch: Epoch
    until: Int32


class Seal(Message, tag="seal"):
    """To every stage of a fast session with receipts on, once the answer is in: the session's rows end
    at position ``until``, so the stage signs its last span up to there (``wire.receipt.SPAN``)."""

    session: SessionId
    epoch: Epoch
    until: Int32


class StepInput(WireModel):
    pos: Int32
    n_tokens: int = Field(ge=1, le=MAX_TOKENS)
    tensor: TensorEntry | None = None
    tokens: Tokens | None = None


# an Inputs message stays far below the stream's message cap; more follow with ``more``
MAX_INPUTS_BYTES = 16 << 20


class Inputs(Message, tag="inputs"):
    session: SessionId
    epoch: Epoch
    steps: list[StepInput] = Field(max_length=1 << 12)
    more: bool = False


class MetricsRequest(Message, tag="metrics_request"):
    pass


class Metrics(Message, tag="metrics"):
    values: dict[Annotated[str, Field(max_length=64)], float] = Field(max_length=64)


# The prefix cache keys prompts by blocks of this many token ids: a key per block, each chained to the
# one before, so equal keys mean equal prefixes. A prefix is reused to its last whole block: an agent's
# next turn loses at most this many tokens less one of its reuse.
PREFIX_BLOCK = 32
# the most keys one lookup carries (a prompt of PREFIX_BLOCK x this many tokens)
MAX_PREFIX_KEYS = 1 << 12
PREFIX_KEY_BYTES = 16

PrefixKey = Annotated[bytes, Field(min_length=PREFIX_KEY_BYTES, max_length=PREFIX_KEY_BYTES)]


def prefix_keys(tokens: list[int] | tuple[int, ...]) -> list[bytes]:
    """The keys of a prompt's whole blocks: key i hashes key i - 1 and block i's ids."""
    keys: list[bytes] = []
    key = b""
    for start in range(0, min(len(tokens), PREFIX_BLOCK * MAX_PREFIX_KEYS) - PREFIX_BLOCK + 1, PREFIX_BLOCK):
        block = b"".join(int(t).to_bytes(4, "little") for t in tokens[start:start + PREFIX_BLOCK])
        key = hashlib.blake2b(key + block, digest_size=PREFIX_KEY_BYTES).digest()
        keys.append(key)
    return keys


class CacheLookup(Message, tag="cache_lookup"):
    """To every stage of a session with ``Prompt.cache``, before any row runs: the prompt's prefix keys.
    The stage copies the KV of the longest prefix it keeps of the same asker's earlier sessions into
    the session's sequence and says how many positions that is (``CacheFound``). Keys are the asker's
    word, so a stage keeps and finds entries per asker: a wrong key hurts the answers of its sender alone."""

    session: SessionId
    epoch: Epoch
    keys: list[PrefixKey] = Field(max_length=MAX_PREFIX_KEYS)


class CacheFound(Message, tag="cache_found"):
    session: SessionId
    epoch: Epoch
    tokens: int = Field(ge=0, le=PREFIX_BLOCK * MAX_PREFIX_KEYS)


class CacheUse(Message, tag="cache_use"):
    """To the head, once every stage has said what it found: the prompt's rows begin at ``tokens``
    (the least any stage found, and before the prompt's last position)."""

    session: SessionId
    epoch: Epoch
    tokens: int = Field(ge=0, le=PREFIX_BLOCK * MAX_PREFIX_KEYS)


def new_session_id() -> str:
    """A fresh session id: 96 random bits, hex, as ``SessionId`` accepts."""
    return secrets.token_hex(12)
