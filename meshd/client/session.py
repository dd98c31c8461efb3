"""One epoch of an ask's session: open the route, prompt the head, stream the tail's tokens, and
feed output verification (a ``Verifier``) what each stage sends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Collection, Sequence
from typing import Protocol

import trio

from meshd.client.ask import (
    STALL_TIMEOUT,
    AskRequest,
    AskResult,
    OnToken,
    RouteError,
    StageError,
    first_error,
    hand_over,
)
from meshd.client.chat import render
from meshd.client.prefix import look_up
from meshd.client.route import Stage, check_opened, check_route
from meshd.net import rpc
from meshd.net.peers import Peers
from meshd.net.stream import Stream
from wire.errors import ErrorCode, ProtocolError
from wire.message import ErrorMessage, Message, error_from_message
from wire.receipt import Receipts
from wire.stage import (
    STAGE_PROTOCOL,
    Cancel,
    ChatMessage,
    ChatTemplate,
    Done,
    Grammar,
    Inputs,
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


async def run_session(peers: Peers, route: Sequence[Stage], request: AskRequest, result: AskResult,
                      on_token: OnToken | None = None, session_id: str | None = None, epoch: int = 0,
                      stall_timeout: float = STALL_TIMEOUT, verifier: Verifier | None = None) -> AskResult:
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
