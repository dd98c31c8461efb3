"""Messages of the stage protocol: how an asker drives a session along a route.

One control stream per (asker, stage) carries open / prompt / cancel and the
replies; the tail streams tokens on its control stream. Between stages, one
hop stream per session carries ``Activation`` messages downstream, and a ring
stream carries each sampled token from the tail back to the head.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Literal

from pydantic import Field

from wire.codec import Message, WireModel, register
from wire.tensors import TensorCodec, TokenId

SessionId = Annotated[str, Field(min_length=1, max_length=128)]
Epoch = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]
Address = Annotated[str, Field(min_length=1, max_length=256)]
NodeId = Annotated[str, Field(max_length=128)]
Digest = Annotated[str, Field(min_length=1, max_length=128)]
Layer = Annotated[int, Field(ge=0, le=1 << 20)]

STAGE_PROTOCOL = "meshd/stage/1"


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
    n_embd: int = Field(ge=1, le=1 << 20)
    ready: bool


@register
class Open(Message):
    """Opens (or, with a higher epoch, re-opens) a session on one stage of a route."""

    type: Literal["open"] = "open"
    v: Literal[1] = 1
    session: SessionId
    epoch: Epoch
    # what the asker expects the stage to serve (from the route); None: whatever it serves,
    # and the asker checks the ``StageInfo`` in ``Opened``
    model_digest: Digest | None = None
    layer_begin: Layer | None = None
    layer_end: Layer | None = None
    next: PeerRef | None = None
    head: PeerRef | None = None
    sampling: Sampling = Sampling()
    max_tokens: int = Field(default=256, ge=1, le=1 << 20)
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list, max_length=16)
    # how this session's hidden states travel on every hop: a stage sends them so and refuses
    # anything else before it decompresses or dequantises a byte
    wire_dtype: Literal["f32", "f16", "q8_0"] = "f32"
    wire_codec: TensorCodec = "raw"


@register
class Opened(Message):
    type: Literal["opened"] = "opened"
    v: Literal[1] = 1
    session: SessionId
    epoch: Epoch
    info: StageInfo


@register
class Prompt(Message):
    """To the head: chat messages, raw text or token ids (a re-prefill after a failover)."""

    type: Literal["prompt"] = "prompt"
    v: Literal[1] = 1
    session: SessionId
    epoch: Epoch
    messages: list[ChatMessage] | None = Field(default=None, max_length=256)
    text: str | None = Field(default=None, max_length=1 << 22)
    tokens: list[TokenId] | None = Field(default=None, max_length=1 << 20)
    generated: int = Field(default=0, ge=0, le=1 << 20)


@register
class PromptTokens(Message):
    type: Literal["prompt_tokens"] = "prompt_tokens"
    v: Literal[1] = 1
    session: SessionId
    epoch: Epoch
    tokens: list[TokenId] = Field(max_length=1 << 20)


@register
class Hop(Message):
    """First message on a stage-to-stage stream: which session it carries."""

    type: Literal["hop"] = "hop"
    v: Literal[1] = 1
    session: SessionId
    epoch: Epoch
    ring: bool = False
    # the tail samples once it has seen this many positions
    prompt_tokens: int = Field(default=0, ge=0, le=1 << 20)


@register
class Token(Message):
    type: Literal["token"] = "token"
    v: Literal[1] = 1
    session: SessionId
    epoch: Epoch
    index: int = Field(ge=0, le=1 << 20)
    token: TokenId
    piece: bytes = Field(max_length=1 << 10)


@register
class Done(Message):
    type: Literal["done"] = "done"
    v: Literal[1] = 1
    session: SessionId
    epoch: Epoch
    reason: Literal["eog", "max_tokens", "stop"]
    generated: int = Field(ge=0, le=1 << 20)


@register
class Cancel(Message):
    type: Literal["cancel"] = "cancel"
    v: Literal[1] = 1
    session: SessionId
    epoch: Epoch


@register
class Released(Message):
    type: Literal["released"] = "released"
    v: Literal[1] = 1
    session: SessionId


@register
class MetricsRequest(Message):
    type: Literal["metrics_request"] = "metrics_request"
    v: Literal[1] = 1


@register
class Metrics(Message):
    type: Literal["metrics"] = "metrics"
    v: Literal[1] = 1
    values: dict[Annotated[str, Field(max_length=64)], float] = Field(max_length=64)


def new_session_id() -> str:
    """A fresh session id: 96 random bits, hex, as ``SessionId`` accepts."""
    return secrets.token_hex(12)
