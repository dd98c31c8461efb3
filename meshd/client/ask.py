"""The asker's side of a session: check a route, open it, prompt the head, stream the tail's tokens.

The asker keeps every token id (the prompt's, as the head returned them, and
each generated one), so when a stage fails it can open the session again on a
new route with a higher epoch and re-prefill exactly where it stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

import trio

from meshd.client.chat import ChatRequest, Rendered, render
from meshd.client.prefix import look_up
from meshd.net import rpc
from meshd.net.fastpunch import RELAYED_HOP
from meshd.net.peers import Peers
from meshd.net.stream import Stream
from relay.protocol import CIRCUIT_MARK
from wire.codec import ErrorMessage, Message, error_from_message
from wire.credit import Voucher
from wire.errors import ErrorCode, ProtocolError
from wire.meshrpc import RouteReply, RouteStage
from wire.receipt import Receipts
from wire.stage import (
    STAGE_PROTOCOL,
    Cancel,
    ChatMessage,
    ChatTemplate,
    Done,
    Grammar,
    Inputs,
    Metrics,
    MetricsRequest,
    Open,
    Opened,
    PeerRef,
    Prompt,
    PromptTokens,
    Released,
    Sampling,
    StageInfo,
    Token,
    new_session_id,
)

log = logging.getLogger(__name__)


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


async def _from_stage(index: int, work: Awaitable[None]) -> None:
    try:
        await work
    except StageError:
        raise
    except ProtocolError as exc:
        raise StageError(index, exc) from exc
    except trio.EndOfChannel as exc:
        raise StageError(index, ProtocolError(ErrorCode.UNREACHABLE, f"lost the stream: {exc!r}")) from exc
    except trio.TooSlowError as exc:
        raise StageError(index, ProtocolError(ErrorCode.DEADLINE_EXCEEDED, "the stage stalled")) from exc


@dataclass(frozen=True)
class Stage:
    """One stop of a route: where to dial, and what the asker expects there (None: whatever it serves).

    The stage's own account (``StageInfo``) comes back in its ``Opened``.
    """

    address: str
    node_id: str | None = None
    model_digest: str | None = None
    layers: tuple[int, int] | None = None
    # other members serving exactly these layers, as the route's planner named them for spot checks
    # (None: it did not say, and the verifier asks for routes around the stage to find some)
    replicas: tuple[Stage, ...] | None = None


def route_at(addresses: Sequence[str]) -> list[Stage]:
    """A route given by the user as addresses: each stage says what it serves when it opens."""
    return [Stage(address) for address in addresses]


def route_from_reply(reply: RouteReply) -> list[Stage]:
    """The route a member planned: it already says who serves which layers of which model, and
    (a planner of this release) which other members serve each stage's layers."""
    def replicas(s: RouteStage) -> tuple[Stage, ...] | None:
        if reply.replicas is None:
            return None
        return tuple(Stage(r.address, r.node_id, reply.model, (r.start, r.end)) for r in reply.replicas
                     if (r.start, r.end) == (s.start, s.end) and r.node_id != s.node_id)

    return [Stage(s.address, s.node_id, reply.model, (s.start, s.end), replicas(s)) for s in reply.stages]


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


@dataclass(frozen=True)
class Unchecked:
    """A range of a route whose steps no replica matched to the end of the answer: a lie there would
    go unseen. ``since`` is the first position left unchecked; ``why`` says why, in words."""

    layer_begin: int
    layer_end: int
    node_id: str
    since: int
    why: str

    @property
    def layers(self) -> str:
        return f"[{self.layer_begin}, {self.layer_end})"

    def __str__(self) -> str:
        return f"layers {self.layers} of node {self.node_id[:16]} unchecked from position {self.since} ({self.why})"

    def as_json(self) -> dict[str, object]:
        return {"layers": [self.layer_begin, self.layer_end], "node": self.node_id, "since": self.since,
                "why": self.why}


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
    # and when the first was; of them, those an asker's client took, and those it took that a caught lie
    # then threw away (the answer started again: the client must be told, as it cannot take them back)
    handed: int = 0
    first_shown_at: float | None = None
    shown: int = 0
    withdrawn: int = 0
    # a chat request as the asker rendered it (AskRequest.chat): rendered once, kept across failovers
    rendered: Rendered | None = None
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
        """The answer is generated again from the prompt: what was said of the old one goes with it."""
        self.withdrawn += self.shown
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
    """Hands a token to ``on_token``, awaiting it where it is a coroutine function."""
    if on_token is not None:
        maybe = on_token(token, piece)
        if maybe is not None:
            await maybe


async def hand_over(result: AskResult, on_token: OnToken | None, until: int) -> None:
    """Hands the client the answer's tokens up to ``until`` that it does not have yet (counted once
    taken: a hand-over cancelled while the client takes one gives it again)."""
    while on_token is not None and (k := result.handed) < min(until, len(result.tokens)):
        await deliver(on_token, result.tokens[k], result.pieces[k])
        result.handed = k + 1
        if result.first_shown_at is None:
            result.first_shown_at = time.perf_counter()


class Verifier(Protocol):
    """What a session asks of output verification (``meshd.client.verify.Verifier``) at each point of an epoch."""

    async def prepare(self, route: Sequence[Stage], avoid: Collection[str]) -> None: ...

    def begin(self, session: str, epoch: int, route: Sequence[Stage], node_ids: Sequence[str | None], n_layer: int,
              result: AskResult, prompt_len: int | None, streams: Sequence[Stream | None],
              sampling: Sampling, fast: bool = False) -> None: ...

    def constrain(self, grammar: Grammar | None, generated: int) -> None: ...

    @property
    def caches(self) -> bool: ...

    def cached(self, start: int) -> None: ...

    def prompt_known(self, prompt_len: int) -> None: ...

    def inbox(self, index: int) -> trio.MemorySendChannel[Inputs] | None: ...

    async def run_checks(self) -> None: ...

    async def settle(self, timeout: float) -> None: ...

    def blame(self, error: StageError, node_ids: Sequence[str | None]) -> StageError: ...

    def on_chain(self, session: str, epoch: int, chain: bytes) -> None: ...

    def on_receipts(self, index: int, msg: Receipts) -> None: ...

    def stage_ended(self, index: int) -> None: ...

    def on_token(self, token: int) -> None: ...

    @property
    def holds(self) -> bool: ...

    async def hand_over_checked(self, on_token: OnToken | None) -> None: ...

    def finish(self, reason: str) -> None: ...


def check_opened(stage: Stage, info: StageInfo) -> None:
    """The stage serves what the route said it does."""
    if stage.node_id is not None and info.node_id != stage.node_id:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{stage.address} says it is node {info.node_id[:16]}, "
                                                   f"the route has {stage.node_id[:16]}")
    if stage.model_digest is not None and info.model_digest != stage.model_digest:
        raise ProtocolError(ErrorCode.MODEL_MISMATCH, f"{stage.address} serves model {info.model_digest[:12]}, "
                                                      f"the route has {stage.model_digest[:12]}")
    if stage.layers is not None and (info.layer_begin, info.layer_end) != stage.layers:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{stage.address} serves layers [{info.layer_begin}, "
                                                   f"{info.layer_end}), the route has [{stage.layers[0]}, "
                                                   f"{stage.layers[1]})")


def check_route(route: Sequence[Stage], infos: Sequence[StageInfo]) -> None:
    """Every layer covered exactly once, in order, by stages of one model."""
    if not infos:
        raise RouteError("the route is empty")
    digests = {info.model_digest for info in infos}
    if len(digests) > 1:
        names = ", ".join(f"{s.address} has {i.model_digest[:12]}" for s, i in zip(route, infos, strict=True))
        raise RouteError(f"stages serve different model files ({names})")
    n_layer = infos[0].n_layer
    expected = 0
    for s, info in zip(route, infos, strict=True):
        begin, end = info.layer_begin, info.layer_end
        if begin > expected:
            raise RouteError(f"the route leaves layers [{expected}, {begin}) uncovered (before {s.address})")
        if begin < expected:
            raise RouteError(f"layers [{begin}, {min(expected, end)}) are covered twice ({s.address} overlaps)")
        expected = end
    if expected != n_layer:
        raise RouteError(f"the route leaves layers [{expected}, {n_layer}) uncovered (after the last stage)")


async def run_session(peers: Peers, route: Sequence[Stage], request: AskRequest, result: AskResult,
                      on_token: OnToken | None = None, session_id: str | None = None, epoch: int = 0,
                      stall_timeout: float = 30.0, verifier: Verifier | None = None) -> AskResult:
    """Runs one epoch of a session; raises ProtocolError if any stage fails it.

    With tokens already in ``result`` (a retry), the head re-prefills prompt and
    generated tokens and generation continues where it stopped. With a ``verifier``
    (meshd.client.verify) every stage signs receipts the asker checks, and spot checks
    run on replicas; a lie fails the epoch with a StageError naming its culprit.
    """
    if verifier is not None:
        # a one-stage route is checked too: a node serving the whole range is its replica
        await verifier.prepare(route, result.excluded)
    repeated = next((s.address for i, s in enumerate(route) if s.address in [r.address for r in route[:i]]), None)
    if repeated is not None:
        # one stage cannot hold the same session twice
        raise RouteError(f"{repeated} is in the route twice, so its layers would be covered twice")
    session = session_id or new_session_id()
    # a grammar is applied where the tail samples on the daemons' path, one pick at a time
    constrained = request.chat is not None and request.chat.constrained
    # so are logprobs: the fast path's worker sends tokens alone
    fast = fast_path(route, request) and not constrained and request.logprobs is None and not request.count_only
    # receipts on the daemons' path sign one step at a time: there a verified ask does not speculate
    # (greedy or seeded, the answer is the same; only the fast path signs spans of whatever rows held)
    speculate = "off" if verifier is not None and not fast or constrained else request.speculate
    want_template = request.chat is not None and result.rendered is None
    head_template: list[ChatTemplate | None] = [None]
    result.epochs += 1
    remaining = request.max_tokens - len(result.tokens)
    opened: list[Stream | None] = [None] * len(route)
    infos: list[StageInfo | None] = [None] * len(route)
    # Each stage's node id as its handshake with us proved it: every Open names its
    # neighbours by id, so a stage reuses a link it already has to them (and a two-stage
    # route's ring does not race the head's hop with a duplicate link).
    node_ids: list[str | None] = [s.node_id for s in route]
    linked = [trio.Event() for _ in route]
    # the tail's Done came: the answer is in, and only its last spot checks still run
    answered = trio.Event()
    try:
        async with trio.open_nursery() as nursery:

            async def open_one(i: int) -> None:
                # One round trip: the stage answers with what it serves, and has
                # dialled its next hop before it answers.
                stage = route[i]
                nxt = route[i + 1] if i + 1 < len(route) else None
                try:
                    stream = await peers.open_stream(stage.address, STAGE_PROTOCOL, node_id=stage.node_id)
                except ProtocolError as exc:
                    raise ProtocolError(ErrorCode.UNREACHABLE, f"stage {stage.address} is unreachable: "
                                                               f"{getattr(exc, 'message', exc)}") from exc
                opened[i] = stream
                node_ids[i] = stream.remote_node_id
                linked[i].set()
                # the neighbour this stage dials: the next stage, or (the tail) the head
                other = i + 1 if nxt is not None else 0
                # the neighbour whose hop (at the head, the ring) feeds this stage: only it may
                prev = (i - 1) % len(route)
                await linked[other].wait()
                await linked[prev].wait()
                ref = PeerRef(address=route[other].address, node_id=node_ids[other])
                layers = stage.layers or (None, None)
                reply = await rpc.request(stream, Open(
                    session=session, epoch=epoch, model_digest=stage.model_digest,
                    layer_begin=layers[0], layer_end=layers[1],
                    next=ref if nxt is not None else None,
                    head=ref if nxt is None else None, upstream=node_ids[prev] if len(route) > 1 else None,
                    sampling=request.sampling,
                    max_tokens=max(1, remaining), stop=request.stop, wire_dtype=request.wire_dtype,
                    wire_codec=request.wire_codec, speculate=speculate,
                    max_draft=request.max_draft, receipts=verifier is not None, fast=fast,
                    payer=request.payer, chat_template=want_template and i == 0,
                    logprobs=request.logprobs if nxt is None else None), Opened,
                    f"stage {stage.address} opening the session")
                check_opened(stage, reply.info)
                if i == 0:
                    head_template[0] = reply.chat
                infos[i] = reply.info

            with trio.fail_after(stall_timeout):
                async with trio.open_nursery() as opening:
                    for i in range(len(route)):
                        opening.start_soon(_from_stage, i, open_one(i))
            result.route = [info for info in infos if info is not None]
            check_route(route, result.route)
            head_stream, tail_stream = opened[0], opened[-1]
            assert head_stream is not None and tail_stream is not None
            if verifier is not None:
                verifier.begin(session, epoch, route, node_ids, result.route[0].n_layer, result,
                               len(result.prompt_tokens) + len(result.tokens) if result.prompt_tokens else None,
                               opened, request.sampling, fast)
                nursery.start_soon(verifier.run_checks)
            # the client gets the tokens as their receipts are checked, not as they come
            hold = verifier is not None and verifier.holds
            if verifier is not None and hold:
                nursery.start_soon(verifier.hand_over_checked, on_token)
            # the token ids ride from the head only as far as the last stage whose layers route by them
            carry = max((i for i, info in enumerate(result.route) if i and info.needs_tokens), default=0)
            if request.chat is not None and result.rendered is None:
                result.rendered = await render(request.chat, head_template[0])
            grammar = result.rendered.grammar if result.rendered is not None else None
            generated = len(result.tokens) if result.prompt_tokens else 0
            if verifier is not None:
                verifier.constrain(grammar, generated)
            one_stage = len(route) == 1
            if result.prompt_tokens:
                prompt = Prompt(session=session, epoch=epoch, tokens=result.prompt_tokens + result.tokens,
                                generated=generated, carry_tokens=carry, grammar=grammar if one_stage else None)
            elif result.rendered is not None:
                prompt = Prompt(session=session, epoch=epoch, text=result.rendered.prompt, special=True,
                                carry_tokens=carry, grammar=grammar if one_stage else None)
            elif request.messages is not None:
                prompt = Prompt(session=session, epoch=epoch,
                                messages=[ChatMessage(**m) for m in request.messages], carry_tokens=carry)
            else:
                prompt = Prompt(session=session, epoch=epoch, text=request.text or "", carry_tokens=carry)
            if request.count_only:
                # nothing runs: the session is released (finally, below) with the prompt's ids in hand
                await _from_stage(0, _count_prompt(head_stream, prompt, result, stall_timeout))
                failed = False
                return result
            # the prefix cache, where every stage of the route keeps one
            caching = request.cache and (verifier is None or verifier.caches) and \
                all(info.cache_tokens for info in result.route)
            await _from_stage(0, head_stream.send_message(prompt.model_copy(update={"cache": caching})))
            result.cached_tokens = 0
            if caching:
                ids, result.cached_tokens = await look_up([s for s in opened if s is not None], session, epoch,
                                                          stall_timeout, _from_stage, grammar, generated)
                result.prompt_tokens = result.prompt_tokens or ids
                if verifier is not None:
                    verifier.cached(result.cached_tokens)
                    verifier.prompt_known(len(ids))
            last = len(opened) - 1
            for i, stream in enumerate(opened[1:-1], start=1):
                assert stream is not None
                nursery.start_soon(_from_stage, i, _watch_for_errors(stream, answered, verifier, i))
            if last > 0 and caching:
                nursery.start_soon(_from_stage, 0, _watch_for_errors(head_stream, answered, verifier, 0))
            elif last > 0:
                nursery.start_soon(_from_stage, 0, _receive_prompt_tokens(head_stream, result, stall_timeout,
                                                                          tail_stream, verifier, answered,
                                                                          grammar, generated))
            await _from_stage(last, _receive_tokens(tail_stream, result, None if hold else on_token, stall_timeout,
                                                    last == 0, verifier))
            answered.set()
            if verifier is not None:
                # the tail's stream still brings the inputs that the last spot checks ask it for
                nursery.start_soon(_from_stage, last, _watch_for_errors(tail_stream, answered, verifier, last))
                await verifier.settle(stall_timeout)
            nursery.cancel_scope.cancel()
        # the answer stands (what no receipt covered, a stage that ended the session left unchecked: said so)
        await hand_over(result, on_token, len(result.tokens))
    except BaseExceptionGroup as group:
        failed = True
        error = first_error(group)
        if verifier is not None and isinstance(error, StageError):
            error = verifier.blame(error, node_ids)
        raise error from None
    except BaseException:
        failed = True
        raise
    else:
        failed = False
    finally:
        # After a failure some stage may never answer: do not hold the caller's failover up for it.
        with trio.CancelScope(shield=True), trio.move_on_after(0.3 if failed else 2.0):
            await release_all([s for s in opened if s is not None], session, epoch)
    return result


async def _count_prompt(head: Stream, prompt: Prompt, result: AskResult, timeout: float) -> None:
    """The prompt's token ids from the head, which (asked as the prefix cache asks) runs nothing until
    told where to begin, and is never told: releasing the session ends it."""
    await head.send_message(prompt.model_copy(update={"cache": True, "grammar": None}))
    result.prompt_tokens = list((await rpc.receive(head, PromptTokens, "the head's tokens of the prompt",
                                                   timeout)).tokens)
    result.reason = "counted"


def fast_path(route: Sequence[Stage], request: AskRequest) -> bool:
    """Whether a session takes the fast path: asked for, a split route, f32 rows and no draft model.
    A stage behind a NAT takes it where the stage before it holds a direct or punched link to it;
    where only a relay's circuit does, it says so at once (RELAYED_HOP) and the ask goes on without."""
    return (request.fast and len(route) > 1 and request.speculate != "model"
            and (request.wire_dtype, request.wire_codec) == ("f32", "raw"))


async def _receive_prompt_tokens(stream: Stream, result: AskResult, timeout: float, tail: Stream,
                                 verifier: Verifier | None = None, answered: trio.Event | None = None,
                                 grammar: Grammar | None = None, generated: int = 0) -> None:
    """The head's ids of the prompt (re-prefilled tokens included), which the asker hands the tail
    itself: its sampler's penalty history and its drafter's text pass no stage between; with them the
    grammar its sampler obeys, and how many of the ids are an answer the grammar reads first."""
    with trio.fail_after(timeout):
        msg = await stream.receive_message()
    ids = _take_prompt_tokens(msg, result, verifier)
    if grammar is not None:
        ids = PromptTokens(session=ids.session, epoch=ids.epoch, tokens=ids.tokens, grammar=grammar,
                           generated=generated)
    await tail.send_message(ids)
    await _watch_for_errors(stream, answered, verifier, 0)


def _take_prompt_tokens(msg: Message, result: AskResult, verifier: Verifier | None = None) -> PromptTokens:
    msg = rpc.expect(msg, PromptTokens, "the head's tokens of the prompt")
    if not result.prompt_tokens:
        result.prompt_tokens = list(msg.tokens)
    if verifier is not None:
        verifier.prompt_known(len(msg.tokens))
    return msg


async def _watch_for_errors(stream: Stream, answered: trio.Event | None = None, verifier: Verifier | None = None,
                            index: int = 0) -> None:
    """A stage that is not the tail says nothing more unless it fails the session, or (with a
    ``verifier``) hands over the inputs a spot check asked it for or, on the fast path, its receipts.

    Once the answer is in (``answered``), a stage that ends the session (it evicted the finished
    session, say, or died) no longer fails it: the answer stands, and the spot checks that wait
    on the stage's inputs learn that none come (its inbox closes)."""
    inbox = None if verifier is None else verifier.inbox(index)
    try:
        while True:
            msg = await stream.receive_message()
            if inbox is not None and isinstance(msg, Inputs):
                await inbox.send(msg)
            elif verifier is not None and isinstance(msg, Receipts):
                verifier.on_receipts(index, msg)
            else:
                rpc.expect(msg, Released, "a stage's word on the session")
                break
        raise ProtocolError(ErrorCode.INTERNAL, "a stage released the session before it finished")
    except StageError:
        # a lie its receipts show fails the epoch, answered or not
        raise
    except (ProtocolError, trio.EndOfChannel, trio.BrokenResourceError) as exc:
        if answered is None or not answered.is_set():
            raise
        log.info("a stage ended the session after the answer was in: %s", getattr(exc, "message", repr(exc)))
        if verifier is not None:
            verifier.stage_ended(index)
        if inbox is not None:
            inbox.close()


async def _receive_tokens(stream: Stream, result: AskResult, on_token: OnToken | None, timeout: float,
                          tail_is_head: bool, verifier: Verifier | None = None) -> None:
    inbox = None if verifier is None else verifier.inbox(-1 if tail_is_head else len(result.route) - 1)
    while True:
        with trio.fail_after(timeout):
            msg = await stream.receive_message()
        if tail_is_head and isinstance(msg, PromptTokens):
            _take_prompt_tokens(msg, result, verifier)
            continue
        if verifier is not None and isinstance(msg, Receipts):
            # a step that sampled no token (a prompt chunk before the last, the end of generation), or
            # on the fast path the tail's own spans
            verifier.on_receipts(len(result.route) - 1, msg)
            continue
        if inbox is not None and isinstance(msg, Inputs):
            await inbox.send(msg)
            continue
        if isinstance(msg, Token):
            if verifier is not None and msg.receipts is not None:
                # the receipts of the step that sampled the token ride inside it
                verifier.on_chain(msg.session, msg.epoch, msg.receipts)
            if result.first_token_at is None:
                result.first_token_at = time.perf_counter()
            result.tokens.append(msg.token)
            result.pieces.append(msg.piece)
            if msg.logprob is not None:
                result.logprobs.append((msg.piece, msg.logprob,
                                        [(t.token, t.logprob, t.piece) for t in msg.top_logprobs or []]))
            if verifier is not None:
                # (a lie it shows starts the answer again: the token goes with the rest)
                verifier.on_token(msg.token)
            if on_token is not None:
                await hand_over(result, on_token, len(result.tokens))
        elif isinstance(msg, Done):
            if verifier is not None:
                verifier.finish(msg.reason)
            result.reason = msg.reason
            result.drafted += msg.drafted
            result.accepted += msg.accepted
            result.finished_at = time.perf_counter()
            return
        elif isinstance(msg, ErrorMessage):
            raise error_from_message(msg)
        else:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected {msg.type!r} from the tail")


async def release_all(streams: Sequence[Stream], session: str, epoch: int) -> None:
    """Ends the session on each stage's control stream: Cancel, then the stage's Released, then the
    stream closed (closed before that word, a stage still writing to it would find it reset)."""

    async def one(stream: Stream) -> None:
        # waits for the stage's word that the KV is freed, so a caller that returns knows it is
        try:
            await stream.send_message(Cancel(session=session, epoch=epoch))
            await stream.send_eof()
            while not isinstance(await stream.receive_message(), Released):
                pass
        except (ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel,
                trio.BusyResourceError):
            pass
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        for stream in streams:
            nursery.start_soon(one, stream)


RouteFinder = Callable[[list[str]], Awaitable[list[Stage]]]

# The failover budget of one answer: at most this many epochs (routes tried), and no new one begun
# later than this many seconds past the stall timeout after the answer last made progress (a stall
# itself costs the stall timeout before it is noticed). Several stages dying at once cost one epoch
# when the probes find them all; each later failure found costs one more.
FAILOVER_ATTEMPTS = 8
FAILOVER_SECONDS = 60.0
# How long a probe of one stage may take: a partitioned stage costs this once (all are probed at once).
PROBE_TIMEOUT = 1.5


async def ask_with_failover(peers: Peers, find_route: RouteFinder, request: AskRequest,
                            on_token: OnToken | None = None, attempts: int = FAILOVER_ATTEMPTS,
                            stall_timeout: float = 30.0, result: AskResult | None = None,
                            budget_seconds: float = FAILOVER_SECONDS,
                            verifier: Verifier | None = None) -> AskResult:
    """Runs a session; when stages fail it, routes around every one found dead or lying and
    re-prefills at a new epoch, within the failover budget.

    Greedy answers come out as if nothing had failed: the new route gets the
    prompt and every token generated so far, and continues from there. A caller
    that passes `result` sees it fill as the session runs (the prompt's tokens, each new one).
    """
    result = AskResult() if result is None else result
    session = new_session_id()
    # when the answer last made progress, and (while recovering from a failure) since when it stalls
    last_progress = trio.current_time()
    stalled_since: float | None = None
    deadline: float | None = None
    # the live stages of the last route that stalled: a stage that stalls but answers probes is among them
    suspects: set[str] = set()
    # stages that said they were busy for a moment, and were waited for once before being routed around
    waited: set[str] = set()

    def progressed() -> None:
        nonlocal last_progress, stalled_since
        last_progress = trio.current_time()
        if stalled_since is not None:
            result.failover_seconds += last_progress - stalled_since
            stalled_since = None

    async def on_progress(token: int, piece: bytes) -> None:
        progressed()
        if on_token is not None:
            await deliver(on_token, token, piece)
            result.shown += 1

    for epoch in range(attempts):
        if result.tokens and len(result.tokens) >= request.max_tokens:
            # every token asked for came before the route failed, only the tail's Done did not: a new
            # route would generate one more (a session asks at least one)
            result.reason, result.finished_at = "max_tokens", time.perf_counter()
            progressed()
            await hand_over(result, on_progress, len(result.tokens))
            return result
        route = await find_route(list(result.excluded))
        log.debug("epoch %d of session %s: route %s", epoch, session[:12],
                  " ".join(f"{s.node_id or s.address}{list(s.layers or ())}" for s in route))
        carried, before = len(result.tokens), result.numerics
        try:
            await run_session(peers, route, request, result, on_progress, session, epoch, stall_timeout,
                              verifier)
        except CacheDoubted as exc:
            if not request.cache:
                raise
            log.info("epoch %d: %s; the answer starts again without the prefix cache", epoch, exc.message)
            request = replace(request, cache=False)
            result.failovers += 1
            result.restart()
        except (StageError, trio.TooSlowError) as exc:
            _crossed(result, before, carried)
            if isinstance(exc, StageError) and exc.code is ErrorCode.BAD_REQUEST and exc.message.startswith(RELAYED_HOP):
                # a hop of this route goes through a relay's circuit (no punched link, or no connection
                # punched over it): the daemons' path carries its rows, and nobody failed
                log.info("epoch %d: %s; asking on the daemons' path", epoch, exc.message)
                request = replace(request, fast=False)
                continue
            if isinstance(exc, StageError) and exc.culprit is None and over_budget(exc):
                # A stage's session budget is its own (--session-tokens): no route is roomier for being
                # another, and failing over found "no route" half a minute later. An answer that reached
                # it ends there, saying so; a prompt over it is refused at once.
                if not result.tokens:
                    raise
                result.reason, result.finished_at = "budget", time.perf_counter()
                result.budget = exc.message
                progressed()
                await hand_over(result, on_progress, len(result.tokens))
                return result
            if stalled_since is None:
                stalled_since = last_progress
            if deadline is None:
                deadline = last_progress + stall_timeout + budget_seconds
            busy = busy_for(exc, route)
            if busy is not None and busy[0] not in waited and epoch < attempts - 1:
                # All its slots were taken for a moment (another asker's session, the tracker's probe of a
                # stage it just placed): wait as it says, once, rather than route around it for good (with
                # one slot a stage, that left "no route" where the stage was free a second later).
                waited.add(busy[0])
                log.info("epoch %d: stage %s is busy (%s); asking again in %.1f s", epoch, busy[0][:12],
                         exc, busy[1])
                await trio.sleep(busy[1])
                continue
            # a proven liar is routed around whatever its error says; any other error, if it may pass
            if isinstance(exc, StageError) and exc.culprit is None and not exc.retryable:
                raise
            if epoch == attempts - 1 or trio.current_time() > deadline:
                log.warning("giving up after %d failover(s) in %.1f s: %s", result.failovers,
                            trio.current_time() - stalled_since, exc)
                raise
            culprits = [c for c in await _culprits(peers, route, exc, suspects) if c not in result.excluded]
            retry = False
            if isinstance(exc, trio.TooSlowError) or exc.code is ErrorCode.DEADLINE_EXCEEDED:
                # Nobody is dead, so who stalled is unknown: the reporter is blamed first, and the
                # stages this route shares with the next one that stalls are blamed then.
                retry = not suspects
                suspects = {s.node_id for s in route if s.node_id is not None} - set(culprits) - set(result.excluded)
            if not culprits and not (retry and suspects):
                if request.fast and any(CIRCUIT_MARK in s.address for s in route):
                    # nobody failed, but a hop to a stage behind a NAT did not open on the fast path (its
                    # punched connection did not): the daemons' path carries the rows over the links that did
                    log.info("epoch %d failed (%s); asking on the daemons' path", epoch, exc)
                    request = replace(request, fast=False)
                    continue
                raise
            log.info("epoch %d failed (%s); routing around %s", epoch, exc, ", ".join(c[:12] for c in culprits))
            result.excluded.extend(culprits)
            result.failovers += 1
            if isinstance(exc, StageError) and exc.untrusted_from is not None:
                # A check proved a lie: generate the answer again from the prompt, not from the lie (a
                # prompt re-prefilled with tokens is not bit for bit the rows their decode steps made,
                # and a near tie can then pick another token).
                result.restart()
        else:
            _crossed(result, before, carried)
            progressed()
            if result.failovers:
                # the front door's log says what `meshd ask`'s figures line does
                log.info("answered after %d failover(s) around %d stage(s), %.1f s lost", result.failovers,
                         len(result.excluded), result.failover_seconds)
            return result
    raise AssertionError("unreachable")


def _crossed(result: AskResult, before: frozenset[str], carried: int) -> None:
    """Notes where an epoch that took over ``carried`` tokens ran on other numerics than the one before."""
    if carried and before and result.numerics and result.numerics != before and \
            carried not in result.crossed_numerics_at:
        result.crossed_numerics_at.append(carried)


def busy_for(exc: BaseException, route: Sequence[Stage]) -> tuple[str, float] | None:
    """The node and how long (s, at most BUSY_WAIT) it asked to be left alone, where a stage of ``route``
    refused the session as busy for a moment (OVERLOADED with a retry hint); else None."""
    if not isinstance(exc, StageError) or exc.code is not ErrorCode.OVERLOADED or exc.retry_after_ms is None:
        return None
    if not 0 <= exc.index < len(route) or route[exc.index].node_id is None:
        return None
    node = route[exc.index].node_id
    assert node is not None
    return node, min(BUSY_WAIT, exc.retry_after_ms / 1000)


# The longest an asker waits on a busy stage's word before it asks again (a peer's number, bounded here).
BUSY_WAIT = 2.0


def over_budget(exc: ProtocolError) -> bool:
    """A stage refused work for a budget of its own (a session's tokens, a prompt's bytes), not for
    being busy: an OVERLOADED with no retry hint (``meshd.stage.books``)."""
    return exc.code is ErrorCode.OVERLOADED and exc.retry_after_ms is None


async def _culprits(peers: Peers, route: Sequence[Stage], exc: BaseException,
                    suspects: Collection[str] = ()) -> list[str]:
    """The node ids to route around after `exc` failed `route`: the proven culprit if the error names
    one; else as `blamed` says, from a probe of every stage."""
    if isinstance(exc, StageError) and exc.culprit is not None:
        return [exc.culprit] + ([exc.also] if exc.also is not None else [])
    alive = await _probe(peers, route)
    return blamed(route, alive, exc.index if isinstance(exc, StageError) else None, suspects)


def blamed(route: Sequence[Stage], alive: Sequence[bool], reporter: int | None,
           suspects: Collection[str] = ()) -> list[str]:
    """Every stage found dead. None dead: the stages the route shares with the last one that stalled
    (`suspects`), else the reporter (None where no stage reported: a stall at opening). Stages the
    route names without a node id cannot be excluded (a route given by addresses)."""
    dead = [s.node_id for s, up in zip(route, alive, strict=True) if not up and s.node_id is not None]
    if dead:
        return dead
    shared = [s.node_id for s in route if s.node_id is not None and s.node_id in suspects]
    if shared:
        return shared
    reported = None if reporter is None else route[reporter].node_id
    return [] if reported is None else [reported]


async def _probe(peers: Peers, route: Sequence[Stage]) -> list[bool]:
    """Which stages of `route` are up: the handshake proves the node, its metrics that its engine is."""
    alive = [False] * len(route)

    async def probe(i: int) -> None:
        try:
            reply = await rpc.call(peers, route[i].address, STAGE_PROTOCOL, MetricsRequest(), Metrics,
                                   node_id=route[i].node_id, timeout=PROBE_TIMEOUT)
        except ProtocolError:
            return
        alive[i] = reply.values.get("worker_up") == 1.0

    async with trio.open_nursery() as nursery:
        for i in range(len(route)):
            nursery.start_soon(probe, i)
    return alive


# Members the asker keeps as other places to ask for a route, learned from the routes it was given.
MAX_ROUTE_SOURCES = 32
# A route source that cannot be reached (the others are asked in turn); any other error is its answer.
_SOURCE_DOWN = (ErrorCode.UNREACHABLE, ErrorCode.DEADLINE_EXCEEDED)

AskMember = Callable[[Stage, list[str]], Awaitable[list[Stage]]]


class RouteSources:
    """A route finder that survives its source: it asks `first` (the seed or the local daemon, say
    the tracker) and, once that cannot be reached, the members it learned of from the routes it was
    given (the stages), in turn, through `ask_member`. Any member plans a route from its own view,
    and the tracker's successor is among them once it is elected."""

    def __init__(self, first: RouteFinder, ask_member: AskMember) -> None:
        self.first = first
        self.ask_member = ask_member
        self.first_down = False
        self.members: dict[str, Stage] = {}

    async def __call__(self, excluded: list[str]) -> list[Stage]:
        failure: ProtocolError | None = None
        if not self.first_down:
            try:
                return self._learn(await self.first(excluded))
            except ProtocolError as exc:
                if exc.code not in _SOURCE_DOWN or not self.members:
                    raise
                log.info("the route source is down (%s); asking the members", exc)
                self.first_down = True
                failure = exc
        for node_id, member in list(self.members.items()):
            if node_id in excluded:
                continue
            try:
                return self._learn(await self.ask_member(member, excluded))
            except ProtocolError as exc:
                if exc.code not in _SOURCE_DOWN:
                    raise
                failure = exc
                del self.members[node_id]
        raise failure or ProtocolError(ErrorCode.UNREACHABLE, "no member is left to ask for a route")

    def _learn(self, route: list[Stage]) -> list[Stage]:
        for stage in route:
            if stage.node_id is not None and len(self.members) < MAX_ROUTE_SOURCES:
                self.members.setdefault(stage.node_id, stage)
        return route


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


def stop_trim(text: str, stops: Sequence[str]) -> str:
    """The answer up to the first stop string."""
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text if cut < 0 else text[:cut]
