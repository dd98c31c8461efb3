"""The fast path's stage side: its door on a node, and the set-up of each fast session.

A fast session's rows go from this stage's engine worker straight to the next
one's (meshd.engine.fastpath). Here it is reserved whole in the books, its
connections set up (``Hop.fast``) and handed to the worker, the worker's events
(the tail's tokens, span hashes, failures) turned into messages for the asker,
and the worker told to stop it when the books end it first.

A stage that gets a ``Hop`` with a ``FastOffer`` expects one connection with
the offer's token; the node's listener hands every connection that starts
with a fast-link preamble to ``FastDoor.accept`` (``Peers.handle_fast``),
which gives it to the session that expects it, once, and answers ACCEPTED.
One door serves all of a node's stage services (a member may serve a range
while it retires another).
"""

from __future__ import annotations

import itertools
import math
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from meshd.engine import ops
from meshd.net.fastconn import accepted, detach
from meshd.net.fastpunch import connect_fast
from meshd.net.stream import Stream, StreamLink
from meshd.stage.ring import Ring
from meshd.stage.signing import Signing
from meshd.stage.state import HIDDEN, Session, StageState
from wire.errors import ErrorCode, ProtocolError
from wire.fastlink import ACCEPTED, KEY_BYTES, TOKEN_BYTES
from wire.receipt import SPAN
from wire.stage import FastOffer, Hop, InputsRequest, Seal, StepInput
from wire.tensors import TensorEntry, tensor_fields


def new_offer() -> FastOffer:
    return FastOffer(token=secrets.token_bytes(TOKEN_BYTES), key=secrets.token_bytes(KEY_BYTES))


@dataclass(eq=False)
class Expected:
    """A connection a session waits for, and (once it came) the socket for its worker."""

    arrived: trio.Event = field(default_factory=trio.Event)
    sock: socket.socket | None = None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class FastDoor:
    def __init__(self) -> None:
        self._waiting: dict[bytes, Expected] = {}
        self._changed = trio.Event()

    def expect(self, token: bytes) -> Expected:
        expected = Expected()
        self._waiting[token] = expected
        self._changed.set()
        self._changed = trio.Event()
        return expected

    def forget(self, token: bytes) -> None:
        expected = self._waiting.pop(token, None)
        if expected is not None:
            expected.close()

    async def accept(self, token: bytes, stream: trio.SocketStream) -> bool:
        """Gives the connection to the session expecting ``token`` (its Hop may still be on the
        way: the listener's pre-auth deadline bounds the wait); False if none does."""
        while (expected := self._waiting.get(token)) is None:
            await self._changed.wait()
        # single use: a second connection with the same token finds no one
        del self._waiting[token]
        await stream.send_all(ACCEPTED)
        expected.sock = detach(stream)
        expected.arrived.set()
        return True


class FastPath:
    def __init__(self, state: StageState, signing: Signing, ring: Ring, door: FastDoor) -> None:
        self.state = state
        self.signing = signing
        self.ring = ring
        # fast-path connections meet their sessions here (one door per node, shared by its services)
        self.door = door
        self._tags = itertools.count(1)
        # fast sessions the books ended before their worker did (a stop string): it is told to stop
        self._end_send, self._end_recv = trio.open_memory_channel[Session](math.inf)

    def admit(self, session: Session) -> None:
        """Names the session by a tag of its own in the engine worker's events."""
        session.fast_tag = next(self._tags)
        self.state.fast[session.fast_tag] = session

    async def open(self, session: Session, prompt: list[int] | None = None) -> None:
        """Reserves the session's KV in the books and hands the session to the engine worker."""
        state, book = self.state, session.book
        prompt_len = book.prompt_len or 0
        history = None
        if state.report.has_output:
            history = await state.history(session, 0, prompt_len)
        for other in state.books.reserve(book, prompt_len + book.max_tokens, trio.current_time()):
            state.ended(other)
        await state.engine_call(ops.FastOpen(
            seq=book.slot, tag=session.fast_tag, max_pos=book.next_pos, prompt_len=prompt_len,
            max_tokens=book.max_tokens, start=book.start, carry=session.carry, gets_ids=session.gets_ids,
            prompt=prompt, history=history, chunk=state.limits.prefill_chunk,
            span=SPAN if session.receipts is not None else 0,
            max_draft=session.open.max_draft if session.open.speculate == "ngram" else 0))
        session.fast_opened.set()

    async def link_out(self, session: Session, address: str, link: StreamLink, offer: FastOffer) -> None:
        """Opens the fast connection to the next stage (dialled, or punched beside the hop's ``link``)
        and hands it to the worker, once it has the session."""
        timeout = self.state.limits.hop_timeout
        conn = await connect_fast(address, link, offer.token, timeout)
        async with conn:
            with trio.fail_after(timeout):
                await session.fast_opened.wait()
            # the worker writes at once: the far daemon hands on what came after the preamble
            # with the connection, so its answer costs the session no round trip
            sock = detach(conn)
            try:
                await self.state.engine_call(ops.FastLink(seq=session.book.slot, tag=session.fast_tag, out=True,
                                                          key=offer.key), fds=(sock.fileno(),))
            finally:
                sock.close()
            await accepted(conn, address, timeout)

    async def serve_hop(self, stream: Stream, session: Session, hop: Hop) -> None:
        """A fast session's rows (at the head, the ring's tokens) come on the connection the Hop
        offers: the worker takes it once it has the session; the stream only ends."""
        offer = hop.fast
        if offer is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the session takes the fast path: its hop must offer "
                                                       "the connection")
        expected = self.door.expect(offer.token)
        try:
            if not hop.ring:
                await self.open(session)
            with trio.move_on_after(self.state.limits.hop_timeout):
                await expected.arrived.wait()
                await session.fast_opened.wait()
            if expected.sock is None or not session.fast_opened.is_set():
                raise ProtocolError(ErrorCode.UNREACHABLE, "the fast-path connection from the previous stage "
                                                           "never came")
            await self.state.engine_call(ops.FastLink(seq=session.book.slot, tag=session.fast_tag, out=False,
                                                      key=offer.key), fds=(expected.sock.fileno(),))
        finally:
            self.door.forget(offer.token)
            expected.close()
        try:
            msg = await stream.receive_message()
        except trio.EndOfChannel:
            return
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected {msg.type!r} on a fast hop stream")

    def on_engine_event(self, event: dict[str, Any]) -> None:
        """What the engine worker says of a fast session unasked: a sampled token (the tail), a failure."""
        state = self.state
        if event.get("ev") == "stats":
            state.metrics.fast = dict(event["stats"])
            return
        session = state.fast.get(int(event.get("tag", 0)))  # tags count from 1
        if session is None or not state.books.holds(session.book):
            return
        if event.get("ev") == "error":
            code = ErrorCode(event["code"]) if event.get("code") in ErrorCode.__members__ else ErrorCode.INTERNAL
            state.fail(session, ProtocolError(code, str(event.get("message"))))
        elif event.get("ev") == "span":
            self.signing.sign_span(session, int(event["pos"]), int(event["n"]), bytes(event["h_in"]),
                                   bytes(event["h_out"]), min(max(int(event["us"]), 0), (1 << 32) - 1))
        elif event.get("ev") == "token":
            if session.draft_length is not None and "drafted" in event:
                # the worker drafts and verifies; Done reports its counts
                session.draft_length.drafted, session.draft_length.accepted = event["drafted"], event["accepted"]
            if not self.ring.emit(session, int(event["token"]), bool(event["eog"]), bytes(event["piece"]),
                                  trio.current_time()) and not session.fast_ended:
                # the books ended it (a stop string): the worker stops too
                session.fast_ended = True
                self._end_send.send_nowait(session)

    async def seal(self, session: Session, msg: Seal) -> None:
        """The answer is in: this stage's last span, up to where the asker says the rows end."""
        book = session.book
        if (msg.session, msg.epoch) != (book.id, book.epoch):
            raise ProtocolError(ErrorCode.EPOCH_STALE, "a seal of another session or epoch")
        if session.receipts is None or not session.open.fast:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "only a fast session with receipts is sealed")
        await session.fast_opened.wait()
        # the worker tells the last spans as events, after the ones it told before (``on_engine_event``)
        await self.state.engine_call(ops.FastSeal(seq=book.slot, tag=session.fast_tag, until=msg.until))

    async def inputs(self, session: Session, msg: InputsRequest) -> None:
        """A fast session's kept inputs, span by span, from its engine worker (``Signing.send_inputs``)."""
        book = session.book
        reply, body = await self.state.engine_call(ops.FastInputs(seq=book.slot, tag=session.fast_tag,
                                                                  until=msg.until))
        offset = 0
        for pos, n, size, ids in reply["spans"]:
            rows = np.frombuffer(body, dtype=np.float32, count=size // 4, offset=offset).reshape(n, -1)
            offset += size
            entry = tensor_fields(HIDDEN, rows, "f32", "raw")
            session.kept.append(StepInput.unvalidated({
                "pos": pos, "n_tokens": n, "tensor": TensorEntry.unvalidated(entry),
                "tokens": np.frombuffer(ids, dtype=np.int32).tolist() if ids else None}))
        self.signing.send_inputs(session, msg)

    async def end_stopped(self) -> None:
        """Tells the worker to stop each fast session the books ended first."""
        async for session in self._end_recv:
            if self.state.books.holds(session.book):
                try:
                    await self.state.engine_call(ops.FastEnd(seq=session.book.slot, tag=session.fast_tag))
                except ProtocolError:
                    pass
