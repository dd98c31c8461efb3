"""The stage protocol's sessions: the asker's control stream owns each session's lifetime.

An ``Open`` is checked against what this stage serves and admitted to the books;
the stage dials its next stage at once (the ring waits for the prompt), answers
``Opened``, and then serves the control stream: the prompt (at the head), the
prompt's ids (at the tail), the prefix cache's lookup and word, requests for kept
inputs and the seal, until the asker cancels or the session ends. Off the books
before the asker hears why it failed; ``Released`` last.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import numpy as np
import trio
from pydantic import ValidationError

from meshd import steps
from meshd.engine import ops
from meshd.engine.draft import DraftLength, DraftModelKV, NgramDrafter
from meshd.mesh.records import host_of
from meshd.net.fastpunch import RELAYED_HOP, fast_reaches
from meshd.net.stream import Stream
from meshd.stage.cached_prefix import CachedPrefix
from meshd.stage.fast import FastPath
from meshd.stage.hops import Hops, check_downstream
from meshd.stage.outlet import Outlet
from meshd.stage.receipts import SessionReceipts
from meshd.stage.ring import Ring
from meshd.stage.signing import Signing
from meshd.stage.state import Rows, Session, StageState, sampler_new
from relay.protocol import CIRCUIT_MARK
from wire.errors import ErrorCode, ProtocolError
from wire.message import encode, error_message
from wire.receipt import row_hash
from wire.stage import (
    CacheLookup,
    CacheUse,
    Cancel,
    ChatTemplate,
    Grammar,
    InputsRequest,
    Open,
    Opened,
    PeerRef,
    Prompt,
    PromptTokens,
    Released,
    Seal,
    StageInfo,
)

# Whether a stage may dial a peer an Open names (its next stage, or the head for the
# ring): returns quietly, or raises a ProtocolError saying why not.
DialCheck = Callable[[PeerRef], None]


def plain_address(ref: PeerRef) -> None:
    """Without a member table (a bare stage): ``host:port`` or a relay circuit, never a URL with a
    path, a query or another scheme, so an Open cannot aim the stage at some other service."""
    relay, mark, _ = ref.address.partition(CIRCUIT_MARK)
    address = relay if mark else ref.address
    try:
        parts = urlsplit(address if address.startswith("ws://") else f"ws://{address}")
        port = parts.port
    except ValueError:
        port = None
    if port is None or not parts.hostname or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a stage dials only host:port addresses")


class SessionProtocol:
    def __init__(self, state: StageState, signing: Signing, ring: Ring, fast: FastPath, cached: CachedPrefix,
                 hops: Hops, info: Callable[[], StageInfo], may_dial: DialCheck,
                 credit_of: Callable[[str], float] | None) -> None:
        self.state = state
        self.signing = signing
        self.ring = ring
        self.fast = fast
        self.cached = cached
        self.hops = hops
        self.info = info
        self.may_dial = may_dial
        # a member's credit (meshd.mesh.credit.priority), which ranks its sessions under contention
        self.credit_of = credit_of
        # the model's chat template, once an asker asked for it (Open.chat_template)
        self._chat: ChatTemplate | None = None

    def check_open(self, msg: Open) -> None:
        state, r = self.state, self.state.report
        engine = state.engine
        if msg.receipts and msg.speculate != "off" and not msg.fast:
            # (the fast path signs spans of final rows: meshd.engine.spans)
            raise ProtocolError(ErrorCode.BAD_REQUEST, "receipts on the daemons' path sign one step at a time: "
                                                       "not with speculation")
        if msg.check and not msg.receipts:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a check session is there for its receipts")
        if msg.fast and (msg.check or msg.speculate == "model" or (msg.wire_dtype, msg.wire_codec) != ("f32", "raw")
                         or r.has_input and r.has_output):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the fast path carries f32 rows of a split route, without "
                                                       "a draft model")
        if msg.model_digest is not None and msg.model_digest != state.digest:
            raise ProtocolError(ErrorCode.MODEL_MISMATCH, f"this stage serves model {state.digest[:16]}, "
                                                          f"not {msg.model_digest[:16]}")
        wanted = (msg.layer_begin, msg.layer_end)
        if wanted != (None, None) and wanted != (r.layer_begin, r.layer_end):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"this stage serves layers [{r.layer_begin}, {r.layer_end}), "
                                                       f"not [{msg.layer_begin}, {msg.layer_end})")
        if engine.gone is not None:
            # Not OVERLOADED: asked again, this stage never serves it (the node withdrew the range).
            # Why in full (a local path) is for the log; the asker learns that it will not come back.
            raise ProtocolError(ErrorCode.NOT_FOUND, f"layers [{r.layer_begin}, {r.layer_end}) of {state.model_name} "
                                                     f"are withdrawn here: the engine worker failed to start "
                                                     f"{engine.give_up_after} times in a row")
        if not engine.is_up:
            raise ProtocolError(ErrorCode.OVERLOADED, "the engine worker is restarting",
                                retry_after_ms=state.limits.retry_after_ms)

    def _credit(self, stream: Stream, msg: Open) -> float:
        """The credit of the member the session asks for: the opener's own, or the member whose voucher
        for the opener it carries (an identity of `meshd ask`'s or a front door's own)."""
        if self.credit_of is None:
            return 0.0
        opener = stream.remote_node_id
        if msg.payer is not None and msg.payer.valid_for(opener, time.time()):
            return msg.payer.ranked(self.credit_of(msg.payer.payer))  # a front door's key: its share
        return self.credit_of(opener)

    def _downstream_target(self, msg: Open) -> tuple[PeerRef, bool] | None:
        """Where this stage's output goes: the next stage, or (the tail) the ring to the head."""
        report = self.state.report
        if not report.has_output:
            return None if msg.next is None else (msg.next, False)
        if not report.has_input:
            return None if msg.head is None else (msg.head, True)
        return None

    async def serve(self, stream: Stream, msg: Open) -> None:
        state, report = self.state, self.state.report
        self.check_open(msg)
        target = self._downstream_target(msg)
        if target is not None:
            self.may_dial(target[0])
            if msg.fast and not fast_reaches(target[0].address, state.peers.link_to(target[0].node_id or "")):
                raise ProtocolError(ErrorCode.BAD_REQUEST, RELAYED_HOP)
        book, gone = state.books.open(msg.session, msg.epoch, state.engine.generation, msg.max_tokens, msg.stop,
                                      trio.current_time(), owner=stream.remote_node_id, upstream=msg.upstream,
                                      source=host_of(stream.link.address), credit=self._credit(stream, msg))
        for other in gone:
            state.ended(other)
        # a check session's replay runs the steps fed together in one engine call (``SessionBook.joins``)
        book.joins = msg.check
        session = Session(book=book, open=msg, to_asker=Outlet(encode))
        if msg.fast:
            self.fast.admit(session)
        if msg.receipts:
            session.receipts = SessionReceipts(state.signer, book.id, book.epoch, state.digest,
                                               report.layer_begin, report.layer_end)
        draft_recv: trio.MemoryReceiveChannel[tuple[int, int, int]] | None = None
        if report.has_output and msg.speculate != "off":
            # exact for seeded sampling too: the worker samples a step's rows in order and stops
            # at the first pick that is not the draft, so the sampler draws what it would without drafts
            if msg.speculate == "model":
                if self.ring.draft_engine is None:
                    raise ProtocolError(ErrorCode.BAD_REQUEST, "this tail has no draft model (meshd serve "
                                                               "--draft-model); speculate with ngram")
                session.draft_kv = DraftModelKV()
                session.to_draft, draft_recv = trio.open_memory_channel[tuple[int, int, int]](math.inf)
            # the model drafter keeps the session's tokens in it too
            session.drafter = NgramDrafter()
            session.draft_length = DraftLength(msg.max_draft)
        state.sessions[book] = session
        state.changed()
        hop_stream: Stream | None = None
        try:
            with session.scope:
                await state.engine_call(ops.Remove(seq=book.slot))
                if report.has_output:
                    await state.engine_call(sampler_new(session))
                if target is not None:
                    # The next stage is dialled now, not once the prompt's length is
                    # known: every stage of a cold route pays its handshake while the
                    # others pay theirs. The ring waits for the prompt: in a two-stage
                    # route the head is dialling this stage right now, and the ring then
                    # reuses that link instead of racing it with a duplicate.
                    if not target[1]:
                        hop_stream = await self.hops.open_hop(target[0], False)
                    session.downstream = Outlet(bytes)
                state.books.opened(book)
                chat = await self._chat_template() if msg.chat_template and report.has_input else None
                await stream.send_message(Opened(session=book.id, epoch=book.epoch, info=self.info(), chat=chat))
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(session.to_asker.run, stream)
                    if draft_recv is not None:
                        nursery.start_soon(self.ring.model_drafts, session, draft_recv)
                    if target is not None and session.downstream is not None:
                        nursery.start_soon(self.hops.downstream, session, target[0], target[1], hop_stream,
                                           session.downstream)
                    await self._control_loop(stream, session)
                    nursery.cancel_scope.cancel()
                if book.failure is None:
                    await self.cached.keep(session)
            # off the books before the asker hears of the failure
            state.detach(session)
            if book.failure is not None:
                await stream.send_message(error_message(book.failure))
        finally:
            with trio.CancelScope(shield=True):
                if hop_stream is not None:
                    await hop_stream.aclose()
            state.detach(session)
        try:
            await stream.send_message(Released(session=book.id))
        except ProtocolError:
            pass

    async def _control_loop(self, stream: Stream, session: Session) -> None:
        try:
            await self._control_messages(stream, session)
        except ProtocolError as exc:
            self.state.fail(session, exc)

    async def _control_messages(self, stream: Stream, session: Session) -> None:
        state, book = self.state, session.book
        while True:
            try:
                msg = await stream.receive_message()
            except trio.EndOfChannel:
                return
            state.books.touch(book, trio.current_time())
            if isinstance(msg, Cancel):
                return
            if isinstance(msg, Prompt):
                if msg.session != book.id or msg.epoch != book.epoch:
                    raise ProtocolError(ErrorCode.EPOCH_STALE, "prompt for another session or epoch")
                await self.prompt(session, msg)
            elif isinstance(msg, PromptTokens):
                await self._take_prompt_ids(session, msg)
            elif isinstance(msg, CacheLookup):
                await self.cached.lookup(session, msg)
            elif isinstance(msg, CacheUse):
                await self.run_prompt(session, await self.cached.use(session, msg), tell=False)
            elif isinstance(msg, InputsRequest):
                if session.open.fast and session.receipts is not None and not state.report.has_input:
                    await self.fast.inputs(session, msg)
                else:
                    self.signing.send_inputs(session, msg)
            elif isinstance(msg, Seal):
                await self.fast.seal(session, msg)
            else:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected {msg.type!r} on a session stream")

    async def prompt(self, session: Session, msg: Prompt) -> None:
        state, report, book = self.state, self.state.report, session.book
        if not report.has_input:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "only the head stage takes the prompt")
        if book.prompt_len is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the session already has its prompt")
        check_downstream(state, session)
        given = [msg.messages is not None, msg.text is not None, msg.tokens is not None]
        if sum(given) != 1:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a prompt has exactly one of messages, text or tokens")
        if msg.tokens is not None:
            tokens = list(msg.tokens)
            state.books.set_prompt(book, len(tokens))
            steps.check_ids(tokens, report.n_vocab)
        else:
            # Bounded before the engine worker sees it: the text must fit the session budget.
            if msg.messages is not None:
                state.books.check_prompt_bytes(sum(len(m.role.encode()) + len(m.content.encode())
                                                   for m in msg.messages))
                request = ops.Tokenize(messages=[{"role": m.role, "content": m.content} for m in msg.messages],
                                       special=msg.special)
            else:
                assert msg.text is not None
                state.books.check_prompt_bytes(len(msg.text.encode()))
                request = ops.Tokenize(text=msg.text, special=msg.special)
            reply, _ = await state.engine_call(request)
            tokens = reply["tokens"]
            state.books.set_prompt(book, len(tokens))
        if msg.grammar is not None:
            if not report.has_output:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "a grammar goes to the tail, with the prompt's token ids")
            await self._set_grammar(session, msg.grammar, tokens[len(tokens) - min(msg.generated, len(tokens)):])
        session.carry = msg.carry_tokens
        if msg.cache:
            # the asker looks the prompt's prefix up on every stage first, and then says where it begins
            session.held_prompt = tokens
            session.to_asker.send_nowait(PromptTokens(session=book.id, epoch=book.epoch, tokens=tokens))
            return
        await self.run_prompt(session, tokens, tell=True)

    async def run_prompt(self, session: Session, tokens: list[int], tell: bool) -> None:
        """Runs the prompt's rows from where the session starts (past a cached prefix, if it has one)."""
        state, book = self.state, session.book
        if session.open.fast:
            # the worker runs the prompt and the ring's tokens itself, once its connections come
            await self.fast.open(session, prompt=tokens)
        session.hop_info.set()
        if tell:
            session.to_asker.send_nowait(PromptTokens(session=book.id, epoch=book.epoch, tokens=tokens))
        if session.open.fast:
            return
        arr = np.asarray(tokens, dtype=np.int32)
        chunk = state.limits.prefill_chunk
        whole = state.report.has_output
        for start in range(book.start, len(arr), chunk):
            part = arr[start:start + chunk]
            h_in = row_hash(part.tobytes()) if session.receipts is not None else b""
            ids = part.tolist()
            state.enqueue(session, start, len(part), Rows(session, part, None, ids if session.carry else None, h_in,
                                                          history=ids if whole else None))

    async def _chat_template(self) -> ChatTemplate:
        """The model's chat template, read once from the engine (it is the file's)."""
        if self._chat is None:
            reply, _ = await self.state.engine_call(ops.ChatInfo())
            try:
                self._chat = ChatTemplate(**reply["chat"])
            except ValidationError:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "the model's chat template is larger than the stage "
                                                           "protocol carries") from None
        return self._chat

    async def _set_grammar(self, session: Session, grammar: Grammar, generated: list[int]) -> None:
        """The tail's sampler obeys ``grammar`` from its next pick; ``generated`` (a re-prefill's answer so
        far) is read by the grammar first. Neither a fast session nor speculation samples here."""
        if session.open.fast or session.open.speculate != "off":
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a grammar-constrained session takes neither the fast "
                                                       "path nor speculation")
        if session.grammar is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the session already has its grammar")
        await self.state.engine_call(ops.SamplerGrammar(sid=session.book.slot, spec=grammar.model_dump(),
                                                        generated=generated))
        session.grammar = (grammar, generated)

    async def _take_prompt_ids(self, session: Session, msg: PromptTokens) -> None:
        """The tail's penalty history and drafter text, from the asker: the head sends the ids on
        only as far as a stage needs them."""
        report, limits, book = self.state.report, self.state.limits, session.book
        if (msg.session, msg.epoch) != (book.id, book.epoch):
            raise ProtocolError(ErrorCode.EPOCH_STALE, "prompt tokens of another session or epoch")
        # a check session of the whole model, which its opener feeds rows and ids, takes them for its grammar
        whole_check = report.has_input and session.open.check and msg.grammar is not None
        if not report.has_output or report.has_input and not whole_check:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "only a tail after the head takes the prompt's token ids")
        if session.prompt_ids is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the session already has the prompt's token ids")
        if len(msg.tokens) > limits.max_session_tokens:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{len(msg.tokens)} token ids exceed this stage's session "
                                                       f"budget of {limits.max_session_tokens} tokens")
        if book.prompt_len is not None and len(msg.tokens) != book.prompt_len:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{len(msg.tokens)} token ids for a prompt of "
                                                       f"{book.prompt_len}")
        steps.check_ids(msg.tokens, report.n_vocab)
        if msg.grammar is not None:
            # before the rows' history is known, so before the first pick
            await self._set_grammar(session, msg.grammar, list(msg.tokens[len(msg.tokens) - min(msg.generated,
                                                                                                len(msg.tokens)):]))
        session.prompt_ids = list(msg.tokens)
        session.prompt_ids_known.set()
