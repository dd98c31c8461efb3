"""Spot checks of a fast session on a chain of replicas: only token ids and hashes cross the asker.

On the daemons' path a range's check (meshd.client.verify.RangeCheck) fetches
the range's inputs from the stage under check and feeds them to a replica: every
row of the range crosses the asker twice (7.3 kB a token on the default model's
3-stage route, tools/bench_verify.py). On the fast path the asker opens a check
session on a replica of every range instead, each the next one's upstream (its
rows go on to it, as on a route), and feeds the first the answer's token ids, a
span a step. Each link signs a receipt of each span, which the asker compares
with the route's receipt of the same range and span: the same history (so the
same inputs), then the same output, or one of the two lied.

A range with no replica is replayed on its own stage (a check session like any
other): that checks nothing of the range (a liar can lie the same way twice),
but the chain goes on to the next range's replica; and a stage that signs
another output for the same step has signed two answers to one question, an
equivocation anyone can check. A mismatch with a replica is settled as on the
daemons' path: the range's inputs up to there are fetched from its stage (its
own receipts fix their hashes) and replayed on a third node.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio

from meshd.client.ask import CacheDoubted
from meshd.client.audit import Audit
from meshd.client.check_session import CheckSession, open_check_session
from meshd.client.route import Stage
from meshd.client.verify import CheckPlan, Inbox, KeptInputs, RangeCheck, check_numerics, failure_of, run_drawn
from meshd.net.peers import Peers
from meshd.net.stream import Stream
from wire.errors import ErrorCode, ProtocolError
from wire.message import ErrorMessage, error_from_message
from wire.receipt import Proof, Receipt, Receipts, unpack_chain
from wire.sketch import PICK_K, Sketches, tokens_differ
from wire.stage import PeerRef, Sampling, StageInfo, new_session_id
from wire.tensors import encode_activation

log = logging.getLogger(__name__)

# How long the chain's receipts of the spans fed may take, all of them: a replay of a few spans on
# every range of a route, on volunteers that may be busy with their own sessions
RECEIPTS_SECONDS = 60.0


class ChainBroken(Exception):
    """A link of the chain failed or ran something else than it was fed: the checks end, nobody is blamed."""


@dataclass
class _Link:
    """One range's check session in the chain, and its receipts by position."""

    index: int
    stage: Stage
    # the route's own stage of the range (it has no replica): it checks nothing of its range
    own: bool
    session: CheckSession
    at: dict[int, Receipt] = field(default_factory=dict)
    # a replica of other numerics than the route's stage (the tail's alone): its picks' sketches by
    # position, which the route's tokens are compared with within a tolerance (wire.sketch)
    cross: bool = False
    sketches: dict[int, bytes] = field(default_factory=dict)
    arrived: trio.Event = field(default_factory=trio.Event)
    # why its stream ended ("": it has not)
    failure: str = ""


class ChainCheck:
    """The spot checks of every range up to the last one with a replica, on one chain of check sessions."""

    def __init__(self, peers: Peers, audit: Audit, route: Sequence[Stage], replicas: dict[int, list[Stage]],
                 streams: Sequence[Stream | None], inboxes: dict[int, Inbox], sampling: Sampling,
                 plan: CheckPlan) -> None:
        self.peers = peers
        self.audit = audit
        self.route = list(route)
        self.replicas = replicas
        self.streams = streams
        self.inboxes = inboxes
        self.sampling = sampling
        self.plan = plan
        # the ranges it checks: those with a replica (the chain runs up to the last of them)
        self.checked = set(replicas)
        self.links: list[_Link] = []
        # where the links' receipts are read (``run``'s)
        self._nursery: trio.Nursery | None = None
        # how many spans were fed to the chain so far (its steps), and up to where
        self._fed = 0
        self.fed_until = 0
        self.checked_until = 0
        self.stopped: str | None = None

    @property
    def ranges(self) -> set[int]:
        """The ranges it checks: those whose link is a replica."""
        return self.checked

    async def run(self, steps: trio.MemoryReceiveChannel[int]) -> None:
        """Checks up to each position drawn (one check at a time, later draws joining the next), and once
        the answer is in (the draws end), up to its end."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await run_drawn(steps, self.check, lambda: self.checked_until, lambda: self.audit.next_pos)
                nursery.cancel_scope.cancel()
        finally:
            await _close(self.links)

    async def _open(self) -> None:
        """Opens the chain: for each range up to the last with a replica, its first replica that answers,
        else its own stage; from the last link back, so each link's next one is open when the rows come
        (each names the one before it as its upstream, so a link that fails is replaced and the chain
        opened again, a few times at most)."""
        audit = self.audit
        assert audit.prompt_len is not None
        prompt = (audit.result.prompt_tokens + audit.result.tokens)[:audit.prompt_len]
        for _ in range(CHAIN_OPENS):
            plan = [(replicas[0], False) if (replicas := self.replicas.get(index)) else (self.route[index], True)
                    for index in range(max(self.checked) + 1)]
            links: list[_Link] = []
            # one session on every link, as on a route: the rows a link forwards name it
            session = new_session_id()
            try:
                for index in range(len(plan) - 1, -1, -1):
                    stage, own = plan[index]
                    upstream = None if index == 0 else plan[index - 1][0].node_id or audit.node_ids[index - 1]
                    links.insert(0, await self._open_link(index, session, stage, own, prompt, upstream,
                                                          links[0] if links else None))
            except _LinkFailed as failed:
                await _close(links)
                if failed.own or failed.index not in self.replicas:
                    raise ChainBroken(f"range {failed.index}'s own stage took no check session: {failed}") from None
                self.replicas[failed.index].remove(failed.stage)
                if not self.replicas[failed.index]:
                    del self.replicas[failed.index]
                    self.checked.discard(failed.index)
                    if not self.checked:
                        raise ChainBroken(f"every replica failed, the last at {failed}") from None
                continue
            self.links = links
            self.checked = {link.index for link in links if not link.own}
            assert self._nursery is not None
            for link in links:
                self._nursery.start_soon(self._receive, link)
            return
        raise ChainBroken(f"no chain of replicas opened in {CHAIN_OPENS} tries")

    async def _open_link(self, index: int, session: str, stage: Stage, own: bool, prompt: list[int],
                         upstream: str | None, after: _Link | None) -> _Link:
        mine = self.audit.result.route[index].numerics
        # the planner names a replica's numerics where they are not the stage's: at the tail (whose picks
        # the asker compares within a tolerance) it asks for sketches, only there and only then
        cross = not own and index == self.audit.tail and bool(mine) and stage.numerics not in ("", mine)

        def comparable(info: StageInfo) -> None:
            if not own and not cross:
                check_numerics(mine, info)

        try:
            opened = await open_check_session(
                self.peers, stage.address, stage.node_id, stage.model_digest, stage.layers, self.sampling, 1 << 20,
                prompt, f"a chained check of range {index} on {stage.address}", comparable, session=session,
                upstream=upstream,
                next_stage=None if after is None else PeerRef(address=after.stage.address,
                                                              node_id=after.session.info.node_id),
                sketch=PICK_K if cross else 0)
        except (ProtocolError, trio.BrokenResourceError, trio.EndOfChannel) as exc:
            log.info("a chained check of range %d on %s: %s", index, stage.address, exc)
            raise _LinkFailed(index, stage, own, f"{stage.address}: {failure_of(exc)}") from None
        return _Link(index, stage, own, opened, cross=cross and opened.info.numerics != mine)

    async def _receive(self, link: _Link) -> None:
        """A link's receipts as they come (a message for the spans fed together), by position."""
        control = link.session.control
        # across numerics, the sketches of the receipts that come next
        sketches: list[bytes] = []
        try:
            while True:
                msg = await control.receive_message()
                if isinstance(msg, ErrorMessage):
                    raise error_from_message(msg)
                if isinstance(msg, Sketches) and link.cross and msg.session == link.session.session:
                    sketches = msg.sketches
                    continue
                if not isinstance(msg, Receipts) or msg.session != link.session.session:
                    continue
                receipts = unpack_chain(msg.chain, link.session.session, 0, link.session.info.model_digest)
                if link.cross and len(sketches) != len(receipts):
                    raise ProtocolError(ErrorCode.BAD_REQUEST, "receipts without their sketches")
                for k, r in enumerate(receipts):
                    if r.node_id != link.session.info.node_id or len(link.at) >= MAX_HELD:
                        raise ProtocolError(ErrorCode.BAD_REQUEST, "a receipt not its own, or too many")
                    link.at[r.pos] = r
                    if link.cross:
                        link.sketches[r.pos] = sketches[k]
                sketches = []
                link.arrived.set()
                link.arrived = trio.Event()
        except (ProtocolError, trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            link.failure = f"{link.stage.address}: {failure_of(exc)}"
            link.arrived.set()

    async def check(self, until: int) -> bool:
        """Feeds the chain the spans up to ``until`` and compares what each link signed with the route's
        receipts, span by span, range by range; False once the checks end (the reason in ``stopped``)."""
        audit = self.audit
        self.plan.checks += 1
        if not self.links:
            # opened at the first check, once the prompt is known (its ids are the chain's first input)
            try:
                await self._open()
            except ChainBroken as exc:
                self.stopped = str(exc)
                return False
        spans = sorted(p for p in audit.by_stage[0] if self.fed_until <= p < until)
        if spans:
            known = audit.result.prompt_tokens + audit.result.tokens
            head = self.links[0].session.hop
            assert head is not None
            # a prefix the route's stages took from their caches: the chain computes it, and nothing of it
            # is compared (the route signed nothing of it in this session)
            steps = [(0, audit.cached)] if audit.cached and not self.fed_until else []
            steps += [(pos, audit.by_stage[0][pos].n_tokens) for pos in spans]
            batch = [encode_activation(session=self.links[0].session.session, epoch=0, step=k, pos=pos,
                                       n_tokens=n, tensors=[], tokens=known[pos:pos + n])
                     for k, (pos, n) in enumerate(steps, start=self._fed)]
            self._fed += len(steps)
            try:
                await head.send_all(b"".join(batch))
            except (ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self.stopped = f"the chain's first link {self.links[0].stage.address}: {failure_of(exc)}"
                return False
            self.fed_until = spans[-1] + audit.by_stage[0][spans[-1]].n_tokens
        with trio.move_on_after(RECEIPTS_SECONDS):
            for link in self.links:
                while any(p not in link.at for p in spans) and not link.failure:
                    await link.arrived.wait()
        for pos in spans:
            for link in self.links:
                verdict = await self._compare(link, pos)
                if verdict is not None:
                    self.stopped = verdict
                    return False
            self.plan.compared += 1
            self.plan.across += any(link.cross for link in self.links)
            self.checked_until = pos + audit.by_stage[0][pos].n_tokens
        return True

    async def _compare(self, link: _Link, pos: int) -> str | None:
        """The link's receipt of the span at ``pos`` against the route's; why the checks end, or None."""
        audit = self.audit
        theirs = link.at.get(pos)
        if theirs is None:
            return link.failure or f"the chain's link {link.stage.address} sent no receipt in {RECEIPTS_SECONDS:g} s"
        mine = audit.by_stage[link.index][pos]
        if audit.cached:
            # the route's history begins at the cached prefix, the chain's at 0: the same inputs, then
            if (theirs.pos, theirs.n_tokens, theirs.h_in) != (mine.pos, mine.n_tokens, mine.h_in):
                return f"the chain's link {link.stage.address} was fed other rows than the route's stage"
            if theirs.h_out != mine.h_out:
                raise CacheDoubted(link.index, f"range {link.index}'s output at {pos} differs from "
                                               f"{link.stage.address}'s on a session begun past a cached prefix")
            return None
        if not theirs.same_step(mine):
            # the route's receipt carries the history of its inputs, checked against the link before: this
            # link ran something else (the link before forwarded other rows than it signed)
            return f"the chain's link {link.stage.address} ran another history than the route"
        if theirs.h_out == mine.h_out:
            return None
        if not theirs.verify():
            return f"the chain's link {link.stage.address} sent a receipt with a bad signature"
        # across numerics, other bits are no lie: only a token beyond the tolerance is
        why = self._picks_differ(link, pos) if link.cross else None
        if link.cross and why is None:
            return None
        if link.own:
            # one node, two outputs signed for one step: anyone can check that
            raise audit.lie_about(link.index, pos, f"it signed two outputs of the step at {pos}",
                                  Proof(kind="equivocation", culprit=mine, witnesses=[theirs]))
        # a replica against the route's stage: its inputs fetched from it, a third node decides
        index = link.index
        stream, inbox = self.streams[index], self.inboxes.get(index)
        source = KeptInputs(audit, index, stream, inbox, self.plan) if stream is not None and inbox is not None else None
        settle = RangeCheck(self.peers, audit, index, source,
                            [link.stage, *[r for r in self.replicas.get(index, []) if r is not link.stage]],
                            self.sampling, self.plan)
        if not await settle.fetch(pos + mine.n_tokens):
            return "its stage ended the session before it handed over the inputs to settle a mismatch"
        if why is not None:
            await settle.settle_across(link.stage, why, theirs)
        else:
            await settle.settle(link.stage, theirs)
        return settle.stopped or "a mismatch was settled against the replica"

    def _picks_differ(self, link: _Link, pos: int) -> str | None:
        """A tail replica of other numerics picked other tokens than the route's in the span at ``pos``: each
        of the route's must be near enough to the replica's likeliest (wire.sketch); how one is not, or None."""
        audit = self.audit
        assert audit.prompt_len is not None
        mine = audit.by_stage[link.index][pos]
        known = audit.result.prompt_tokens + audit.result.tokens
        tokens = known[max(pos, audit.prompt_len - 1) + 1:pos + mine.n_tokens + 1]
        verdict = tokens_differ(tokens, link.sketches.get(pos, b""))
        if verdict is None:
            return None
        row, why = verdict
        at = max(pos, audit.prompt_len - 1) + row
        return f"its token after position {at} is not what a replica of other numerics " \
               f"({link.session.info.numerics}) allows: {why}"


# a chain whose link fails is opened again around it at most this many times
CHAIN_OPENS = 3
# receipts one link may have sent that no check compared yet: a whole context's worth at a span each
MAX_HELD = 1 << 12


class _LinkFailed(Exception):
    def __init__(self, index: int, stage: Stage, own: bool, why: str) -> None:
        super().__init__(why)
        self.index, self.stage, self.own = index, stage, own


async def _close(links: Sequence[_Link]) -> None:
    """Ends the chain's sessions, all at once."""
    with trio.CancelScope(shield=True):
        async with trio.open_nursery() as nursery:
            for link in links:
                nursery.start_soon(link.session.aclose)
