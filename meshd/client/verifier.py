"""Output verification for an ask: what ``run_session`` calls at each point of an epoch.

It puts the parts together: the audit of the route's receipts (meshd.client.audit), and the spot
checks on replicas, per range on the daemons' path (meshd.client.verify.RangeCheck) or on one chain
of replicas on the fast path (meshd.client.chain_check); it says what stayed unchecked, and lays
each lie at its node.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Collection, Sequence

import trio

from meshd.client.ask import AskResult, CacheDoubted, Gap, OnToken, RouteError, StageError, Unchecked, hand_over
from meshd.client.audit import Audit, SpanAudit, StageLied, blamed
from meshd.client.chain_check import ChainCheck
from meshd.client.route import RouteFinder, Stage
from meshd.client.served import Served, served_work
from meshd.client.verify import (
    MAX_PROOFS,
    REPLICAS_WANTED,
    CheckPlan,
    Draws,
    Inbox,
    KeptInputs,
    RangeCheck,
    replicas_of,
)
from meshd.net.peers import Peers
from meshd.net.stream import Stream
from wire.errors import ProtocolError
from wire.receipt import Proof, Receipts
from wire.stage import Grammar, Inputs, Sampling, Seal

log = logging.getLogger(__name__)


class Verifier:
    """Output verification for an ask: what ``run_session`` calls at each point of an epoch."""

    def __init__(self, peers: Peers, plan: CheckPlan | None = None, find_route: RouteFinder | None = None) -> None:
        self.peers = peers
        self.plan = plan or CheckPlan()
        # where replicas come from when the plan names none: routes that avoid one stage of the route
        self.find_route = find_route
        self.audit: Audit | None = None
        # nodes this ask caught lying: never a replica again
        self.liars: set[str] = set()
        # the proofs those lies left, for the tracker (bounded: an ask fails over a few times at most)
        self.proofs: list[Proof] = []
        # how far (positions) its epoch's checked receipts had come when each lie was laid at a node (a figure)
        self.caught_at: list[int] = []
        self.replicas: dict[int, list[Stage]] = {}
        self.inboxes: dict[int, Inbox] = {}
        self._checks: list[tuple[RangeCheck | ChainCheck, trio.MemoryReceiveChannel[int]]] = []
        # the route's control streams (a seal goes on them), and the stages that ended the session after the answer
        self.streams: list[Stream | None] = []
        self.ended: set[int] = set()
        # what the stages of the epochs before this one served (the asker countersigns it: meshd.client.served)
        self.served: list[Served] = []
        # the epoch's checks run on one chain of replicas (``begin``)
        self.chained = False

    async def prepare(self, route: Sequence[Stage], avoid: Collection[str] = ()) -> None:
        """Finds replicas for the route's ranges (a second and a third node for each, where the mesh
        has them), never among ``avoid`` (the nodes this ask routed around) or the liars it caught."""
        if self.plan.every <= 0:
            return
        avoided = {*self.liars, *avoid}
        if all(stage.replicas is not None for stage in route):
            # the route's planner named them: no round trip before the first token
            self.plan.candidates = [r for stage in route for r in stage.replicas or () if r.node_id not in avoided]
            return
        if self.find_route is None:
            return
        found: list[Stage] = []
        for stage in route:
            excluded = [stage.node_id] if stage.node_id else []
            excluded += avoided
            for _ in range(REPLICAS_WANTED):
                try:
                    other = await self.find_route(excluded)
                except (ProtocolError, RouteError):
                    break
                match = next((s for s in other if s.layers == stage.layers and s.node_id), None)
                if match is None or match.node_id is None:
                    break
                found.append(match)
                excluded.append(match.node_id)
        self.plan.candidates = found

    def begin(self, session: str, epoch: int, route: Sequence[Stage], node_ids: Sequence[str | None], n_layer: int,
              result: AskResult, prompt_len: int | None, streams: Sequence[Stream | None], sampling: Sampling,
              fast: bool = False) -> None:
        """A new epoch on ``route``; on the fast path (``fast``) each stage signs spans of its own."""
        ids = [n for n in node_ids if n is not None]
        assert len(ids) == len(node_ids), "every stage's node id is known once the route is open"
        if self.audit is not None:
            self.served += served_work(self.audit, result, self.liars)
        self.audit = (SpanAudit if fast else Audit)(session, epoch, ids, n_layer, result,
                                                    model=result.route[-1].model_digest)
        self.streams = list(streams)
        self.ended = set()
        result.checked = self.plan.every > 0
        # a node this ask routed around (dead, stalled, lying) checks nothing: its range would go unchecked
        avoid = {*self.liars, *result.excluded}
        candidates = [c for c in self.plan.candidates if c.node_id not in avoid]
        self.replicas = replicas_of(route, candidates) if self.plan.every > 0 else {}
        # on the fast path one chain of replicas checks every range (meshd.client.chain_check), where no
        # range routes by token id (their ids would have to ride the chain too) and no range before the
        # tail is to be checked on a replica of other numerics (it replays the route's own inputs, and
        # its sketches are compared with the next stage's: wire.sketch)
        tail = len(route) - 1
        across = any(replicas[0].numerics for i, replicas in self.replicas.items() if i != tail)
        chained = fast and not across and not any(info.needs_tokens for info in result.route)
        self.chained = chained
        # (a range's inputs, and the next stage's, which are its outputs)
        kept = range(1, len(route)) if chained else {j for i in self.replicas for j in (i, i + 1) if 0 < j <= tail}
        self.inboxes = {i: Inbox() for i in kept}
        sources = {i: KeptInputs(self.audit, i, stream, self.inboxes[i], self.plan)
                   for i in self.inboxes if (stream := streams[i]) is not None}
        self._done = trio.Event()
        self._failed = False
        self._checks = []
        if self.replicas:
            checks: list[RangeCheck | ChainCheck] = [
                ChainCheck(self.peers, self.audit, route, self.replicas, streams, self.inboxes, sampling, self.plan)
            ] if chained else [RangeCheck(self.peers, self.audit, index, sources.get(index), replicas, sampling,
                                          self.plan, sources.get(index + 1)) for index, replicas in self.replicas.items()]
            for check in checks:
                send, receive = trio.open_memory_channel[int](math.inf)
                self.audit.on_step.append(Draws(send, self.plan))
                self._checks.append((check, receive))
        if prompt_len is not None:
            self.prompt_known(prompt_len)

    @property
    def caches(self) -> bool:
        """Whether this epoch's checks can begin past a cached prefix: a chain of replicas fed the token
        ids computes the prefix itself (a range checked alone is fed its stage's kept inputs, and a
        cached prefix's never came to the stage in this session)."""
        return self.chained

    def cached(self, start: int) -> None:
        """The route's rows begin at ``start``, past the prefix its stages took from their caches."""
        assert isinstance(self.audit, SpanAudit)
        self.audit.start_at(start)

    def constrain(self, grammar: Grammar | None, generated: int) -> None:
        """The epoch's tail samples under ``grammar``, which reads the last ``generated`` ids of the
        prompt first: so do the tail's replicas. Before the prompt goes, so before any check starts."""
        assert self.audit is not None
        self.audit.grammar, self.audit.generated = grammar, generated

    def prompt_known(self, prompt_len: int) -> None:
        assert self.audit is not None
        if self.audit.prompt_len is None:
            self.audit.prompt_known(prompt_len)

    @property
    def holds(self) -> bool:
        """Whether the client gets a token only once its span's receipts are checked (the fast path's:
        on the daemons' path each step's chain is checked before its token comes)."""
        return isinstance(self.audit, SpanAudit)

    async def hand_over_checked(self, on_token: OnToken | None) -> None:
        """Hands the client each token once every stage's receipt of the span that sampled it is in and
        agrees (``SpanAudit``): a token a hop or the tail forged never reaches it. Runs until cancelled."""
        audit = self.audit
        assert isinstance(audit, SpanAudit)
        result = audit.result
        while True:
            progress = audit.progress
            if audit.prompt_len is not None:
                # the token at ``k`` was sampled from the row at the prompt's length plus ``k - 1``
                await hand_over(result, on_token, audit.next_pos - len(result.prompt_tokens) + 1)
            await progress.wait()

    def inbox(self, index: int) -> trio.MemorySendChannel[Inputs] | None:
        box = self.inboxes.get(index)
        return None if box is None else box.send

    async def run_checks(self) -> None:
        """The spot checks of every range with a replica, each fed the position each step reaches."""
        try:
            async with trio.open_nursery() as nursery:
                for check, steps in self._checks:
                    nursery.start_soon(check.run, steps)
        except BaseException:
            # a lie found (the epoch fails with it): nothing of this epoch is left to call unchecked
            self._failed = True
            raise
        finally:
            self._done.set()

    async def settle(self, timeout: float) -> None:
        """The answer is in: the checks already asked for finish and each
        range's last steps are checked too (a lie they find still fails the epoch). What could not be
        checked is said in ``AskResult.unverified``."""
        audit = self.audit
        assert audit is not None
        if isinstance(audit, SpanAudit):
            await self._seal(audit)
        for channel in audit.on_step:
            channel.close()
        audit.on_step.clear()
        with trio.move_on_after(timeout):
            await self._done.wait()
        if not self._failed:
            self._unverified(f"its check did not end within {timeout:g} s")

    def stage_ended(self, index: int) -> None:
        """Stage ``index`` ended the session once the answer was in (it evicted it, say): what it did not
        sign or hand over by then is unchecked, not withheld."""
        self.ended.add(index)

    async def _seal(self, audit: SpanAudit) -> None:
        """The fast path's last spans: every stage is told where the rows end (the last sampled token's
        position: the eog's row, if one ended the answer, signs nothing the asker has) and signs up to
        there. A stage that does not (its stream, once the answer is in, just ends) leaves its range unchecked."""
        assert audit.prompt_len is not None
        # the positions run: the prompt's, and one per token sampled but the last
        until = audit.prompt_len + len(audit.result.tokens) - audit.tokens_before - 1
        audit.seal(until)
        msg = Seal(session=audit.session, epoch=audit.epoch, until=until)
        for stream in self.streams:
            if stream is not None:
                with contextlib.suppress(ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
                    await stream.send_message(msg)
        with trio.move_on_after(self.plan.inputs_seconds):
            while not audit.sealed:
                await audit.progress.wait()
        silent = [i for i, sent in enumerate(audit.sent_until) if sent < until and i not in self.ended]
        if silent:
            # withholding its last receipt keeps its last span from the checks: a failed check, as for inputs
            index = silent[0]
            raise StageLied(index, audit.node_ids[index], f"it did not sign its last span within "
                                                          f"{self.plan.inputs_seconds:g} s", pos=audit.next_pos)

    def _unverified(self, cut_short: str) -> None:
        """Notes each range of the epoch whose steps no replica matched up to the end of the answer,
        and why: it has no replica, its checks ended (``RangeCheck.stopped``), or ``cut_short`` (the
        epoch ended before its check did)."""
        audit = self.audit
        assert audit is not None
        checks = {index: check for check, _ in self._checks for index in check.ranges}
        # (on the fast path, the answer's rows end where the asker sealed them, signed or not)
        end = audit.sealed_at if isinstance(audit, SpanAudit) and audit.sealed_at is not None else audit.next_pos
        for index, info in enumerate(audit.result.route):
            check = checks.get(index)
            until = (0 if check is None else check.checked_until) if self.plan.every > 0 else audit.next_pos
            if until < end:
                if check is None:
                    kind, detail = Gap.NO_REPLICA, ""
                else:
                    kind, detail = (Gap.CHECKS_ENDED, check.stopped) if check.stopped else (Gap.CUT_SHORT, cut_short)
                note = Unchecked(info.layer_begin, info.layer_end, audit.node_ids[index], until, kind, detail)
                log.info("spot checks: %s", note)
                audit.result.note_unchecked(note)

    def work(self) -> list[Served]:
        """What every stage of the ask served, each epoch's (the last's too), but the liars' work."""
        done = self.served + ([] if self.audit is None else served_work(self.audit, self.audit.result, self.liars))
        return [w for w in done if w.stage not in self.liars]

    def blame(self, error: StageError, node_ids: Sequence[str | None]) -> StageError:
        if isinstance(error, CacheDoubted):
            # nobody is to blame yet: the answer starts again without the cache
            return error
        error = blamed(error, node_ids)
        if error.untrusted_from is None and self.audit is not None:
            # the answer keeps this epoch's tokens: the ranges' steps since their last check go unchecked
            self._unverified("the route failed before its next check")
        if error.culprit is not None:
            self.liars.update([error.culprit] if error.also is None else [error.culprit, error.also])
            if self.audit is not None:
                self.caught_at.append(self.audit.next_pos)
        if isinstance(error, StageLied) and error.proof is not None and len(self.proofs) < MAX_PROOFS:
            self.proofs.append(error.proof)
        return error

    def on_chain(self, session: str, epoch: int, chain: bytes) -> None:
        assert self.audit is not None
        self.audit.on_packed(session, epoch, chain)

    def on_receipts(self, index: int, msg: Receipts) -> None:
        """Receipts that came on stage ``index``'s own stream: its spans on the fast path, else the
        route's chain (the tail hands it over)."""
        if isinstance(self.audit, SpanAudit):
            self.audit.on_stage(index, msg.session, msg.epoch, msg.chain)
        else:
            self.on_chain(msg.session, msg.epoch, msg.chain)

    def on_token(self, token: int) -> None:
        assert self.audit is not None
        self.audit.on_token(token)

    def finish(self, reason: str) -> None:
        assert self.audit is not None
        self.audit.finish(reason)
