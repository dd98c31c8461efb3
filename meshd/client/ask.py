"""What an ask is: its request, its result as it fills, the tokens handed to its client, and the
errors that end it (a stage's, a route's).

The asker keeps every token id (the prompt's, as the head returned them, and each generated one), so
when a stage fails it can open the session again on a new route with a higher epoch and re-prefill
exactly where it stopped (meshd.client.failover).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import trio

from meshd.client.chat import ChatRequest, Rendered
from wire.credit import Voucher
from wire.errors import ErrorCode, ProtocolError
from wire.stage import Sampling, StageInfo

# Seconds a stage may stay silent before the asker gives up on it and fails over: `meshd ask --timeout`'s
# default, and the HTTP API's (join --api-stall-timeout)
STALL_TIMEOUT = 30.0


class RouteError(Exception):
    """The route cannot serve the model: a gap, an overlap, or stages of different models."""


class StageError(ProtocolError):
    """A typed error, and which stage of the route it came from.

    Where a check proved or a stage reported who is to blame, ``culprit`` is that node's id and
    failover excludes it without probing the route; ``untrusted_from`` is the first position whose
    output is not to be trusted."""

    culprit: str | None = None
    untrusted_from: int | None = None
    # a second node routed around with the culprit, where the asker cannot tell which of two lied (their
    # signed receipts disagree on the rows that went between them, and nobody else saw those)
    also: str | None = None

    def __init__(self, index: int, error: ProtocolError) -> None:
        super().__init__(error.code, error.message, error.retry_after_ms)
        self.index = index


class CacheDoubted(StageError):
    """A check found a stage's output other than a replica's on a session that began past a cached
    prefix: the prefix's KV, which no check of this session saw made, may be why (an earlier session's
    lie upstream left it so), as much as a lie of the stage. Nobody is blamed: the answer is generated
    again without the cache, and that session's checks say who lies."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(index, ProtocolError(ErrorCode.PAYLOAD_CORRUPT, reason))
        self.untrusted_from = 0

    @property
    def retryable(self) -> bool:
        return True


def over_budget(exc: ProtocolError) -> bool:
    """A stage refused work for a budget of its own (a session's tokens, a prompt's bytes), not for
    being busy: an OVERLOADED with no retry hint (``meshd.stage.books``)."""
    return exc.code is ErrorCode.OVERLOADED and exc.retry_after_ms is None


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The error that ended a session's tasks, rather than the others' cancellations."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for sub in e.exceptions:
                walk(sub)
        else:
            leaves.append(e)

    walk(group)
    for leaf in leaves:
        if not isinstance(leaf, (trio.Cancelled, trio.ClosedResourceError)):
            return leaf
    return leaves[0]


@dataclass
class AskRequest:
    messages: list[dict[str, str]] | None = None
    text: str | None = None
    # a chat the asker renders with the model's own template (tools, structured output: meshd.client.chat)
    chat: ChatRequest | None = None
    # each token's log-probability and this many of the likeliest tokens' (None: none)
    logprobs: int | None = None
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    wire_dtype: Literal["f32", "f16", "q8_0"] = "f32"
    wire_codec: Literal["raw", "zstd"] = "raw"
    # speculative decoding by the tail (exact, greedy or seeded sampling): prompt lookup, or the tail's
    # draft model (meshd serve --draft-model), up to max_draft a step
    speculate: Literal["off", "ngram", "model"] = "off"
    max_draft: int = 8
    # the stages' prefix caches (meshd.client.prefix): the prompt's rows begin past the longest prefix
    # every stage of the route keeps of this asker's earlier sessions (a verified ask runs them all)
    cache: bool = True
    # the fast path (wire.fastlink): rows go engine worker to engine worker, where the route allows
    # it (every hop direct or punched, f32, no draft model); off, every row goes through the daemons
    fast: bool = True
    # the member on whose credit the ask is made, when it dials from an identity of its own (wire.credit)
    payer: Voucher | None = None
    # only the prompt's tokens (an API's count_tokens): the head tokenizes the prompt as for the prefix
    # cache, hands the ids back and the session is released before any row runs (reason "counted")
    count_only: bool = False


class Gap(enum.Enum):
    """Why a range of an answer went unchecked."""

    # no other member serves the range: nothing could check it
    NO_REPLICA = "no replica"
    # its checks ended before the answer did (every replica failed, one disagreed and was settled against)
    CHECKS_ENDED = "checks ended"
    # the epoch ended before its check did (the route failed, or the check did not end in time)
    CUT_SHORT = "cut short"


@dataclass(frozen=True)
class Unchecked:
    """A range of a route whose steps no replica matched to the end of the answer: a lie there would
    go unseen. ``since`` is the first position left unchecked; ``kind`` says why, ``detail`` in words."""

    layer_begin: int
    layer_end: int
    node_id: str
    since: int
    kind: Gap
    detail: str = ""

    @property
    def layers(self) -> str:
        return f"[{self.layer_begin}, {self.layer_end})"

    @property
    def alone(self) -> bool:
        """The range had no replica from the answer's start: a mesh of single servers has every range so."""
        return self.kind is Gap.NO_REPLICA and self.since == 0

    @property
    def why(self) -> str:
        return self.detail or self.kind.value

    def __str__(self) -> str:
        return f"layers {self.layers} of node {self.node_id[:16]} unchecked from position {self.since} ({self.why})"

    def as_json(self) -> dict[str, object]:
        return {"layers": [self.layer_begin, self.layer_end], "node": self.node_id, "since": self.since,
                "kind": self.kind.name.lower(), "why": self.why}


@dataclass
class AskResult:
    prompt_tokens: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    pieces: list[bytes] = field(default_factory=list)
    reason: str = ""
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    epochs: int = 0
    # what each stage of the last epoch's route said it serves
    route: list[StageInfo] = field(default_factory=list)
    # speculative decoding, over every epoch: tokens the tail drafted, and those its sampler accepted
    drafted: int = 0
    accepted: int = 0
    # failover: how many times the answer moved to a new route, the seconds that cost it (from the
    # last token before each failure to the first one after), and the nodes it routed around
    failovers: int = 0
    failover_seconds: float = 0.0
    # the prompt's positions the last epoch took from the stages' prefix caches instead of running them
    cached_tokens: int = 0
    excluded: list[str] = field(default_factory=list)
    # output verification: whether spot checks ran (None: not asked for), and the ranges whose steps
    # no replica checked to the end of the answer, one note a range and node
    checked: bool | None = None
    unverified: list[Unchecked] = field(default_factory=list)
    # where a failover carried the answer onto stages of other numerics (another engine build or
    # backend): the tokens from there on need not be the ones the first route's numerics give
    crossed_numerics_at: list[int] = field(default_factory=list)
    # the stage's word when the answer ended at a stage's session budget (reason "budget")
    budget: str = ""
    # tokens handed on past the checks (``hand_over``; a verified fast ask's wait on their span's receipts)
    # and when the first was; of them, those an asker's client took (``give``); the tokens its client
    # holds, from before the answer started again too; and those it took that the answer given again
    # did not (the client must be told, as it cannot take them back)
    handed: int = 0
    first_shown_at: float | None = None
    shown: int = 0
    held: list[int] = field(default_factory=list)
    withdrawn: int = 0
    # a chat request as the asker rendered it (AskRequest.chat): rendered once, kept across failovers
    rendered: Rendered | None = None
    # a fast verified ask's last epoch: each stage's own time (seconds, in route order) over the decode's
    # spans, as its signed receipts say, and how many positions those spans hold (meshd.client.traffic)
    own_seconds: list[float] = field(default_factory=list)
    own_rows: int = 0
    # with AskRequest.logprobs: each new token's piece and log-probability, and the likeliest tokens' (token,
    # logprob, piece), one entry a token of ``tokens``
    logprobs: list[tuple[bytes, float, list[tuple[int, float, bytes]]]] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        """Every range of the answer was checked on a replica to its end."""
        return bool(self.checked) and not self.unverified

    def note_unchecked(self, note: Unchecked) -> None:
        """Keeps one note a range and node (a failover re-reports the ranges its routes shared): the
        one that leaves the most unchecked."""
        for i, old in enumerate(self.unverified):
            if (old.layer_begin, old.layer_end, old.node_id) == (note.layer_begin, note.layer_end, note.node_id):
                if note.since < old.since:
                    self.unverified[i] = note
                return
        self.unverified.append(note)

    def restart(self) -> None:
        """The answer is generated again from the prompt: what was said of the old one goes with it. What
        the client holds of it stays held: withdrawn only where the answer given again differs (``give``)."""
        self.shown = self.handed = 0
        self.tokens.clear()
        self.pieces.clear()
        self.logprobs.clear()
        self.unverified.clear()
        self.crossed_numerics_at.clear()

    @property
    def numerics(self) -> frozenset[str]:
        """The numerics the route's stages computed with (those that said)."""
        return frozenset(info.numerics for info in self.route if info.numerics)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def text(self) -> str:
        return b"".join(self.pieces).decode(errors="replace")

    @property
    def ttft(self) -> float | None:
        """Time to the first token, as the client had it (else as it came)."""
        first = self.first_shown_at or self.first_token_at
        return None if first is None else first - self.started

    @property
    def decode_rate(self) -> float:
        if self.first_token_at is None or self.finished_at is None or len(self.tokens) < 2:
            return 0.0
        return (len(self.tokens) - 1) / max(self.finished_at - self.first_token_at, 1e-9)


OnToken = Callable[[int, bytes], Awaitable[None] | None]


async def deliver(on_token: OnToken | None, token: int, piece: bytes) -> None:
    """Hands a token to ``on_token``, awaiting it where it is a coroutine function. What the client raises
    that reads as a stage's failure (a protocol error, a channel's end, a timeout of its own) comes out as
    ``ClientStopped``: the session tells those as the stage's it was reading (``session._from_stage``),
    which would blame an honest tail and route around it for the client's fault."""
    if on_token is None:
        return
    try:
        maybe = on_token(token, piece)
        if maybe is not None:
            await maybe
    except (ProtocolError, trio.EndOfChannel, trio.TooSlowError) as exc:
        raise ClientStopped(f"the client stopped taking the answer: {exc}") from exc


class ClientStopped(Exception):
    """The client's ``on_token`` failed: the ask ends with it. Not a ``ProtocolError``, so no stage is
    blamed for it and no failover tries again."""


class AnswerWithdrawn(ClientStopped):
    """Raised by a client's ``on_token`` that cannot take back text it holds and the answer given again
    differs from (a stream)."""


async def give(result: AskResult, on_token: OnToken, token: int, piece: bytes) -> None:
    """Gives the client the answer's next token (the ``result.shown``-th). After the answer started again
    (a stage stalled on its receipts, a check caught a lie), a token the client already holds at that place
    is not given twice: an honest stage's stall changes no token. Where the answer given again differs, the
    text the client holds is withdrawn and the new answer given whole."""
    k = result.shown
    if k < len(result.held):
        if result.held[k] == token:
            result.shown += 1
            return
        result.withdrawn += len(result.held)
        result.held.clear()
        for earlier, earlier_piece in zip(result.tokens[:k], result.pieces[:k], strict=True):
            await deliver(on_token, earlier, earlier_piece)
            result.held.append(earlier)
    await deliver(on_token, token, piece)
    result.held.append(token)
    result.shown += 1


async def withdraw_past_end(result: AskResult, on_token: OnToken | None) -> None:
    """At the answer's end: text the client holds from before it started again, past where the answer
    given again ended, is withdrawn, and the answer given whole."""
    if on_token is None or result.shown >= len(result.held):
        return
    result.withdrawn += len(result.held)
    result.held.clear()
    for token, piece in zip(result.tokens[:result.shown], result.pieces[:result.shown], strict=True):
        await deliver(on_token, token, piece)
        result.held.append(token)


async def hand_over(result: AskResult, on_token: OnToken | None, until: int) -> None:
    """Hands the client the answer's tokens up to ``until`` that it does not have yet (counted once
    taken: a hand-over cancelled while the client takes one gives it again)."""
    while on_token is not None and (k := result.handed) < min(until, len(result.tokens)):
        await deliver(on_token, result.tokens[k], result.pieces[k])
        result.handed = k + 1
        if result.first_shown_at is None:
            result.first_shown_at = time.perf_counter()


def stop_trim(text: str, stops: Sequence[str]) -> str:
    """The answer up to the first stop string."""
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text if cut < 0 else text[:cut]
