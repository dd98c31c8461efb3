"""The prefix cache's moves on the engine (its books are ``meshd.stage.prefix``).

A session looks its prompt's keys up once, before its rows: the longest prefix
an entry of the same asker holds is copied into its sequence, and the asker
hears how many positions that is; the head then takes the asker's word on where
every stage's rows begin (the least any found). A session that ends cleanly
leaves its sequence's prompt prefix as an entry.
"""

from __future__ import annotations

import logging

import trio

from meshd.engine import ops
from meshd.stage.books import LIVE
from meshd.stage.state import Session, StageState, sampler_new
from wire.errors import ErrorCode, ProtocolError
from wire.stage import PREFIX_BLOCK, CacheFound, CacheLookup, CacheUse

log = logging.getLogger(__name__)


class CachedPrefix:
    def __init__(self, state: StageState) -> None:
        self.state = state

    async def lookup(self, session: Session, msg: CacheLookup) -> None:
        """Copies the longest prefix of the asker's keys that an entry of the same asker holds into the
        session's sequence, before any of its rows run, and says how many positions that is."""
        state, book = self.state, session.book
        books, limits = state.books, state.limits
        if (msg.session, msg.epoch) != (book.id, book.epoch):
            raise ProtocolError(ErrorCode.EPOCH_STALE, "a lookup for another session or epoch")
        if session.prefix_keys is not None or book.next_pos or book.in_flight or book.phase not in LIVE:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a session looks its prefix up once, before its rows")
        if session.receipts is not None and not session.open.fast or session.open.check:
            # a range's spot check replays the stage's kept inputs on a replica, and a cached prefix's were
            # never sent (the fast path's chain of replicas is fed the token ids: it computes the prefix)
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a session with receipts on the daemons' path takes no "
                                                       "cached prefix")
        if len(msg.keys) * PREFIX_BLOCK > limits.max_session_tokens:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{len(msg.keys)} prefix keys exceed this stage's session "
                                                       f"budget of {limits.max_session_tokens} tokens")
        session.prefix_keys = list(msg.keys)
        found = 0
        entry, shared = books.cache.find(book.owner, msg.keys, trio.current_time()) if state.caching \
            else (None, 0)
        if entry is not None:
            # the entry's sequence is not given to a new session while its cells are copied
            books.cache.pin(entry)
            try:
                await state.engine_call(ops.PrefixCopy(src=entry.slot, dst=book.slot, n=shared * PREFIX_BLOCK))
                found = shared * PREFIX_BLOCK
            except ProtocolError as exc:
                if exc.code is not ErrorCode.BAD_REQUEST:
                    raise
                # this model's memory is more than its cells (a sliding window, a recurrent state)
                log.info("the prefix cache is off: %s", exc.message)
                state.caching = False
                books.drop_cache(state.engine.generation)
            finally:
                books.cache.unpin(entry)
        book.found = found
        session.to_asker.send_nowait(CacheFound(session=book.id, epoch=book.epoch, tokens=found))

    async def use(self, session: Session, msg: CacheUse) -> list[int]:
        """The head: the asker's word on where the prompt's rows begin (the least every stage found);
        returns the prompt it held, to be run from there."""
        book = session.book
        tokens = session.held_prompt
        if (msg.session, msg.epoch) != (book.id, book.epoch):
            raise ProtocolError(ErrorCode.EPOCH_STALE, "a cache word for another session or epoch")
        if tokens is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "only a head holding a prompt for the cache takes CacheUse")
        session.held_prompt = None
        await self.start(session, msg.tokens, tokens[:msg.tokens])
        return tokens

    async def start(self, session: Session, pos: int, history: list[int] | None = None) -> None:
        """The session's rows begin at ``pos``, past the cached prefix its sequence holds: the KV past it
        goes, and the daemons' tail samples with the prefix's ids in its penalty history."""
        state, book = self.state, session.book
        if not pos and not book.found:
            return
        for other in state.books.start_at(book, pos, trio.current_time()):
            state.ended(other)
        if book.found > pos:
            await state.engine_call(ops.Remove(seq=book.slot, p0=pos))
        if pos and state.report.has_output and not session.open.fast:
            if history is None:
                history = await state.history(session, 0, pos)
            await state.engine_call(sampler_new(session, history or []))
            if session.grammar is not None:
                # the new sampler obeys the session's grammar as the one it replaces did
                await state.engine_call(ops.SamplerGrammar(sid=book.slot, spec=session.grammar[0].model_dump(),
                                                           generated=session.grammar[1]))

    async def keep(self, session: Session) -> None:
        """A session that ended cleanly leaves its sequence's prompt prefix as a cache entry."""
        state, book, keys = self.state, session.book, session.prefix_keys
        if not state.caching or not keys or not state.books.holds(book) or book.generation != state.engine.generation:
            return
        try:
            reply, _ = await state.engine_call(ops.PrefixKeep(seq=book.slot, upto=len(keys) * PREFIX_BLOCK))
        except ProtocolError:
            return
        state.books.keep(book, keys[:int(reply["tokens"]) // PREFIX_BLOCK], trio.current_time())
