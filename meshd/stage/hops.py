"""A session's rows between stages: the hop (or ring) stream in, and the one out.

In: a hop stream names a session this stage holds; each activation on it is
checked against the session (its receipts first, then its place in the books,
its kind and shape) before a byte of it is decoded, then queued for the
scheduler. A decode step's rows are taken as they arrive when nothing needs a
wait. Out: the next stage (or, at the tail, the head for the ring) is dialled and
sent the session's ``Hop``; from then on the rows go onto that stream as the
scheduler hands them over, or on a fast connection (``meshd.stage.fast``).
"""

from __future__ import annotations

import functools

import numpy as np
import trio

from meshd import steps
from meshd.net.fastpunch import RELAYED_HOP
from meshd.net.stream import Stream
from meshd.stage.books import LIVE
from meshd.stage.cached_prefix import CachedPrefix
from meshd.stage.fast import FastPath, new_offer
from meshd.stage.outlet import Outlet
from meshd.stage.receipts import chain_of
from meshd.stage.signing import Signing
from meshd.stage.state import HIDDEN, Rows, Session, StageState
from wire.errors import ErrorCode, ProtocolError
from wire.message import Message
from wire.receipt import PackedChain
from wire.stage import STAGE_PROTOCOL, Hop, PeerRef
from wire.tensors import Activation, TensorEntry

# Hidden states up to this size (float32, decoded) are decoded on the event
# loop: a decode step's row costs less than the hop to a thread. Larger ones
# (prefill chunks) go to a thread.
INLINE_DECODE_BYTES = 256 << 10


def check_downstream(state: StageState, session: Session) -> None:
    """Work needs somewhere to go. An Open without it is still answered, with what this stage
    serves, so an asker given bare addresses can tell what its route leaves uncovered."""
    report = state.report
    if session.downstream is not None or session.open.check or report.has_input and report.has_output:
        return
    if not report.has_output:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a stage before the tail needs the next stage's address")
    raise ProtocolError(ErrorCode.BAD_REQUEST, "the tail needs the head's address for the token ring")


class Hops:
    def __init__(self, state: StageState, signing: Signing, fast: FastPath, cached: CachedPrefix) -> None:
        self.state = state
        self.signing = signing
        self.fast = fast
        self.cached = cached
        # one decode thread: zstd's module-level decompressor is not for concurrent use
        self._decoder = trio.CapacityLimiter(1)

    # ----- in

    async def serve(self, stream: Stream, hop: Hop) -> None:
        state, report = self.state, self.state.report
        book = state.books.sessions.get(hop.session)
        session = None if book is None else state.sessions.get(book)
        if book is None or session is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no session {hop.session} on this stage")
        # refused without failing the session: a stranger's hop must not end someone else's work
        state.books.check_upstream(book, stream.remote_node_id)
        if hop.epoch != book.epoch:
            raise ProtocolError(ErrorCode.EPOCH_STALE, f"session {hop.session} is at epoch {book.epoch}")
        if hop.ring != report.has_input:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "ring streams go to the head, hop streams elsewhere")
        try:
            check_downstream(state, session)
            if not hop.ring or session.open.check:
                state.books.set_prompt(book, hop.prompt_tokens)
            if not hop.ring:
                await self.cached.start(session, hop.start)
            if not hop.ring:
                session.gets_ids = hop.carry_tokens > 0
                if report.needs_tokens and not session.gets_ids:
                    raise ProtocolError(ErrorCode.BAD_REQUEST, "this stage routes experts by token id: "
                                                               "the session must send it the token ids")
                session.carry = max(0, hop.carry_tokens - 1)
            if not hop.ring or session.open.check:
                session.hop_info.set()
            if session.open.fast:
                await self.fast.serve_hop(stream, session, hop)
                return
            # a check session's rows come from its opener, who has no receipt to give for them
            wanted = session.receipts is not None and not session.open.check
            # a decode step's rows are queued as they arrive, without waking this task
            stream.set_message_hook(functools.partial(self.activation_nowait, session, wanted,
                                                      stream.remote_node_id))
            while True:
                try:
                    msg = await stream.receive_message()
                except trio.EndOfChannel:
                    return
                if not state.books.holds(book) or book.phase not in LIVE:
                    return
                if not isinstance(msg, Activation):
                    raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected {msg.type!r} on a hop stream")
                await self.accept_activation(session, msg, chain_of(msg, wanted, stream.remote_node_id))
        except ProtocolError as exc:
            state.fail(session, exc)
            raise

    def activation_nowait(self, session: Session, wanted: bool, sender: str, msg: Message) -> bool:
        """An activation checked, decoded and queued as it arrives (``Stream.set_message_hook``), if
        that needs no wait; False leaves the message to the hop stream's task."""
        state, book = self.state, session.book
        if not isinstance(msg, Activation) or not state.books.holds(book) or book.phase not in LIVE:
            return False
        if not state.report.has_input:
            # what ``accept_activation`` would await: a thread to decode in, the prompt's ids
            entry = msg.tensors[0] if len(msg.tensors) == 1 else None
            if entry is None or not self.inline(entry, msg.n_tokens) or \
                    state.report.has_output and msg.pos < (book.prompt_len or 0):
                return False
        checked = self.checked_activation(session, msg, chain_of(msg, wanted, sender))
        if checked is not None:
            entry, h_in, chain = checked
            state.enqueue(session, msg.pos, msg.n_tokens, Rows(session, None, decoded(entry), msg.tokens, h_in,
                                                               chain), msg.drafts)
        return True

    async def accept_activation(self, session: Session, msg: Activation,
                                chain: tuple[str, bytes] | None = None) -> None:
        """Checks an activation against the session before decoding a byte of it, then queues it."""
        state = self.state
        checked = self.checked_activation(session, msg, chain)
        if checked is None:
            return
        entry, h_in, rows_chain = checked
        book = session.book
        if self.inline(entry, msg.n_tokens):
            hidden = decoded(entry)
        else:
            hidden = await trio.to_thread.run_sync(decoded, entry, limiter=self._decoder)
        history = await state.history(session, msg.pos, msg.n_tokens) if state.report.has_output else None
        if state.books.holds(book) and book.phase in LIVE:
            state.enqueue(session, msg.pos, msg.n_tokens, Rows(session, None, hidden, msg.tokens, h_in, rows_chain,
                                                               history), msg.drafts)

    def inline(self, entry: TensorEntry, n_tokens: int) -> bool:
        """Whether these hidden states are decoded on the event loop (INLINE_DECODE_BYTES), not a thread."""
        return entry.codec == "raw" and 4 * n_tokens * self.state.report.stage_width <= INLINE_DECODE_BYTES

    def checked_activation(self, session: Session, msg: Activation, chain: tuple[str, bytes] | None,
                           ) -> tuple[TensorEntry, bytes, PackedChain | None] | None:
        """Every check of an activation against the session, before a byte of it is decoded: the
        head's token ids are queued here (None); hidden states come back with their hash and chain."""
        state, report, book = self.state, self.state.report, session.book
        if msg.session != book.id:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "activation for another session")
        if msg.epoch != book.epoch:
            raise ProtocolError(ErrorCode.EPOCH_STALE, f"activation of epoch {msg.epoch}, session is at {book.epoch}")
        if msg.tokens is not None and len(msg.tokens) != msg.n_tokens:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{len(msg.tokens)} token ids for {msg.n_tokens} rows")
        h_in, checked = self.signing.checked_chain(session, msg, chain)
        state.books.check_rows(book, msg.pos, msg.n_tokens, msg.drafts)
        steps.check_kind(report.has_input, msg.tokens is not None, bool(msg.tensors), msg.n_tokens, msg.drafts,
                         session.gets_ids, ring=not session.open.check)
        if msg.tokens is not None:
            # carried ids reach the engine in the same call as everyone's rows
            steps.check_ids(msg.tokens, report.n_vocab)
        if report.has_input:
            assert msg.tokens is not None
            tokens = np.asarray(msg.tokens, dtype=np.int32)
            # a whole-model stage's sampler reads the prompt's ids as its penalty history: in a check
            # session they come as rows do, so they are these (as its own prompt's are, ``SessionProtocol.prompt``)
            prompt_ids = max(0, (book.prompt_len or 0) - msg.pos) if report.has_output else 0
            history = list(msg.tokens[:prompt_ids]) if prompt_ids else None
            # the ids ride on downstream only to a stage with hash-routed layers (deepseek4), or before one
            state.enqueue(session, msg.pos, msg.n_tokens,
                          Rows(session, tokens, None, list(msg.tokens) if session.carry else None, h_in, checked,
                               history),
                          msg.drafts)
            return None
        entry = msg.tensor(HIDDEN)
        o = session.open
        if (entry.dtype, entry.codec) != (o.wire_dtype, o.wire_codec):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"hidden states as {entry.dtype}/{entry.codec}, this "
                                                       f"session travels as {o.wire_dtype}/{o.wire_codec}")
        want = (msg.n_tokens, report.stage_width)
        if tuple(entry.shape) != want:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"hidden states of shape {tuple(entry.shape)}, "
                                                       f"this stage needs {want}")
        return entry, h_in, checked

    # ----- out

    async def open_hop(self, target: PeerRef, ring: bool) -> Stream:
        what = "the head" if ring else "the next stage"
        try:
            with trio.fail_after(self.state.limits.hop_timeout):
                return await self.state.peers.open_stream(target.address, STAGE_PROTOCOL, node_id=target.node_id)
        except (trio.TooSlowError, ProtocolError):
            # what the far side said (a status, a reason) stays here: an Open must not make this
            # stage a probe of other services
            raise ProtocolError(ErrorCode.UNREACHABLE, f"{what} {target.address} is unreachable") from None

    async def downstream(self, session: Session, target: PeerRef, ring: bool, hop_stream: Stream | None,
                         outlet: Outlet[bytes]) -> None:
        """Sends this session's output to the next stage (or, at the tail, the ring to the head)."""
        await session.hop_info.wait()
        if hop_stream is None:
            try:
                hop_stream = await self.open_hop(target, ring)
            except ProtocolError as exc:
                self.state.fail(session, exc)
                return
            # this task dialled it, so it closes it
            async with hop_stream:
                await self._downstream_to(session, target, ring, hop_stream, outlet)
        else:
            await self._downstream_to(session, target, ring, hop_stream, outlet)

    async def _downstream_to(self, session: Session, target: PeerRef, ring: bool, hop_stream: Stream,
                             outlet: Outlet[bytes]) -> None:
        book = session.book
        offer = new_offer() if session.open.fast else None
        try:
            await hop_stream.send_message(Hop(session=book.id, epoch=book.epoch, ring=ring,
                                              prompt_tokens=book.prompt_len or 0,
                                              carry_tokens=0 if ring else session.carry, fast=offer,
                                              start=0 if ring else book.start))
            if offer is None:
                # from now on a step's rows go straight onto the stream when they can (Outlet)
                await outlet.run(hop_stream)
                return
            await self.fast.link_out(session, target.address, hop_stream.link, offer)
            # the rows go on the fast connection; the stream ends when the next stage lets the session go
            msg = await hop_stream.receive_message()
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected {msg.type!r} on a fast hop stream")
        except trio.EndOfChannel:
            return
        except trio.TooSlowError:
            self.state.fail(session, ProtocolError(ErrorCode.INTERNAL, "the session's engine worker never took it"))
        except ProtocolError as exc:
            if exc.message.startswith(RELAYED_HOP):
                # no fast-path connection opened to a stage behind a NAT: nobody is lost, and the asker
                # goes on on the daemons' path
                self.state.fail(session, exc)
                return
            what = "the head" if ring else "the next stage"
            self.state.fail(session, ProtocolError(ErrorCode.UNREACHABLE, f"lost {what} {target.address}: {exc}"))


def decoded(entry: TensorEntry) -> np.ndarray:
    """An activation's hidden states as float32 rows; its shape, dtype and codec were checked."""
    hidden = np.ascontiguousarray(entry.to_array(), dtype=np.float32)
    steps.check_finite(hidden)
    return hidden
