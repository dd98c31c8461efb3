"""The trio shell of a member's credit ledger (meshd.mesh.credit): countersigning, giving, gossip.

A member countersigns what each stage of its asks served (``countersign``) and gives each summary to
its stage; it answers the ledger requests of others (``answer``) and, every ``interval``, pulls
what it lacks from one member it has heard from first-hand (``pull``): roots first (one small
message each way when the ledgers agree), then the ids of the buckets that differ, then the
summaries it lacks, bounded per round (``PULL_BUDGET``). Credit is worked out from the ledger at
most every ``STANDING_EVERY`` seconds (``standing``): a stage reads it at each session it opens.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field

import trio

from meshd.client.served import Served
from meshd.mesh.credit import InvalidSummary, KeyShares, Ledger, Standing, key_share, priority, standing_of, work_of
from meshd.net import rpc as net_rpc
from meshd.net.peers import Peers
from wire.credit import (
    MAX_SUMMARIES_PER_MESSAGE,
    RECENT,
    LedgerFetch,
    LedgerIds,
    LedgerIdsRequest,
    LedgerRoots,
    LedgerRootsRequest,
    Voucher,
    WorkGive,
    WorkSummary,
    WorkTaken,
)
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.message import Message, encode

log = logging.getLogger(__name__)

# summaries one pull fetches at most: a member far behind catches up over a few rounds, at a bounded cost each
PULL_BUDGET = 1024
# buckets one pull walks at most (the rest wait for the next round), and pages of ids it reads at most: a
# peer whose pages never end (or repeat what this member holds) costs one bounded pull
PULL_BUCKETS = 32
PULL_PAGES = 64
STANDING_EVERY = 10.0
# A member in step takes what is new from the ids sent with the roots; it walks the buckets (4.6 kB of
# digests, then a page of ids per bucket that differs: 10 kB each at 140,000 summaries) every this many
# pulls (half an hour), or at once when it is plainly behind. tools/sim_credit.py, 1,000 members, a week:
# 3.0 MB a member an hour walking every 10th pull, 1.6 MB every 60th (the summaries themselves: 1.2 MB)
WALK_EVERY = 60
# ...and after a pull whose roots differed but whose ids sent brought nothing new (what this member lacks
# is older than them, or the other lacks what this one has), at most every this many pulls
WALK_AFTER = 3
# how long a voucher for one of this member's own command identities lasts
VOUCHER_SECONDS = 24 * 3600


@dataclass
class LedgerKeeper:
    identity: NodeIdentity
    peers: Peers
    # the mesh protocol's one request and reply (the daemon's `rpc`)
    rpc: Callable[..., Awaitable[Message]]
    # the members this node's view says are placed (and the trackers it follows)
    placed: Callable[[], Collection[str]]
    ledger: Ledger = field(default_factory=Ledger)
    interval: float = 30.0
    timeout: float = 5.0
    # how often the credit is worked out again from the ledger (a test mesh's: seconds)
    standing_every: float = STANDING_EVERY
    # bytes this node's pulls moved (requests and answers, as encoded): a figure for /metrics and the sim
    pulled_bytes: int = 0
    # what each of the front door's API keys spent of this member's credit (meshd.mesh.credit.key_share)
    key_use: KeyShares = field(default_factory=KeyShares)
    _standing: dict[str, Standing] = field(default_factory=dict)
    _placed: frozenset[str] = frozenset()
    _pulls: int = 0
    _walked: int = 0

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    # ----- what this node asked

    def voucher(self, opener: str, key: str = "", keys: int = 0) -> Voucher:
        """Lets `opener` ask on this member's credit; for the front door's API key `key` (one of `keys`),
        with the share of this member's priority the key's own use leaves it."""
        share = 1.0
        if key and keys > 1:
            own = self.standing().get(self.node_id)
            share = key_share(own, self.node_id in self._placed, self.key_use.spent(key, time.time()), keys)
        return Voucher.create(self.identity, opener, int(time.time()) + VOUCHER_SECONDS, share)

    def countersign(self, nursery: trio.Nursery, served: Iterable[Served],
                    address_of: Callable[[str], str | None], key: str = "") -> list[WorkSummary]:
        """Signs a summary of each stage's work, keeps it and gives it to its stage (in the background);
        what it asked is spent by the front door's API key `key` too, where one asked."""
        at = int(time.time())
        signed = []
        for work in served:
            summary = work.signed(self.identity, at)
            try:
                self.ledger.add(time.time(), summary)
            except InvalidSummary as exc:
                log.info("no credit for the work of %s: %s", work.stage[:16], exc)
                continue
            signed.append(summary)
            nursery.start_soon(self._give, summary, address_of(summary.stage))
        if key:
            self.key_use.spend(key, sum(work_of(s) for s in signed), time.time())
        return signed

    async def _give(self, summary: WorkSummary, address: str | None) -> None:
        try:
            await self.rpc(self.peers, address, WorkGive(summaries=[summary]), node_id=summary.stage,
                           timeout=self.timeout)
        except ProtocolError as exc:
            log.info("giving node %s its summary: %s", summary.stage[:16], exc)

    # ----- what others ask of this node's ledger

    def answer(self, request: Message) -> Message | None:
        """The reply to a ledger request; None for a request of another kind."""
        ledger = self.ledger
        if isinstance(request, WorkGive):
            taken = refused = 0
            now = time.time()
            for summary in request.summaries:
                try:
                    taken += ledger.add(now, summary)
                except InvalidSummary as exc:
                    refused += 1
                    log.debug("a summary refused: %s", exc)
            return WorkTaken(taken=taken, refused=refused)
        if isinstance(request, LedgerRootsRequest):
            return ledger.roots(request.root, request.walk)
        if isinstance(request, LedgerIdsRequest):
            return ledger.ids(request.bucket, request.offset)
        if isinstance(request, LedgerFetch):
            return WorkGive(summaries=ledger.fetch(request.ids))
        return None

    # ----- gossip

    async def run(self, members: Callable[[], list[tuple[str, str | None]]]) -> None:
        """Every `interval`, pulls from one of `members` ((node id, address) it heard from first-hand);
        every `standing_every`, works the credit out again (off the event loop)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._reckon)
            await self._gossip(members)

    async def _reckon(self) -> None:
        while True:
            await self.reckon()
            await trio.sleep(self.standing_every)

    async def reckon(self) -> None:
        """Works every member's credit out again from the ledger as it is now, in a thread: 0.68 s at
        65,536 summaries, which would stall every session's tokens on the event loop."""
        facts, folded, placed = self.ledger.facts(), self.ledger.folded(), frozenset(self.placed())
        standing, payers = await trio.to_thread.run_sync(standing_of, facts, time.time(), placed, folded, self.ledger.cap)
        self._standing, self._placed = standing, placed
        self.ledger.paying(payers)

    async def _gossip(self, members: Callable[[], list[tuple[str, str | None]]]) -> None:
        while True:
            await trio.sleep(self.interval * random.uniform(0.5, 1.5))
            self.ledger.expire(time.time())
            others = members()
            if not others:
                continue
            node_id, address = random.choice(others)
            try:
                got = await self.pull(node_id, address)
            except ProtocolError as exc:
                log.info("ledger pull from %s: %s", node_id[:16], exc)
                continue
            if got:
                log.debug("ledger pull from %s: %d summaries", node_id[:16], got)

    async def _ask(self, node_id: str, address: str | None, request: Message, expected: type[net_rpc.R]) -> net_rpc.R:
        reply = await self.rpc(self.peers, address, request, node_id=node_id, timeout=self.timeout)
        self.pulled_bytes += _size(request) + _size(reply)
        return net_rpc.expect(reply, expected, f"the ledger of {node_id[:16]}")

    async def pull(self, node_id: str, address: str | None) -> int:
        """Takes what `node_id`'s ledger holds and this one lacks, up to `PULL_BUDGET`; returns how many."""
        ledger = self.ledger
        self._pulls += 1
        walk = self._pulls % WALK_EVERY == 0
        roots = await self._ask(node_id, address, LedgerRootsRequest(root=ledger.root, walk=walk), LedgerRoots)
        if roots.root == ledger.root:
            return 0
        held = len(ledger)
        got = await self._fetch(node_id, address, ledger.missing(roots.recent))
        if not walk and (roots.count > held + RECENT or not got and self._pulls - self._walked >= WALK_AFTER):
            # plainly behind (a newcomer, a partition healed), or the ids sent did not explain the difference:
            # walk now, not rounds from now
            walk = True
            roots = await self._ask(node_id, address, LedgerRootsRequest(root=ledger.root, walk=True), LedgerRoots)
        if not walk:
            return got
        self._walked = self._pulls
        differing = ledger.differing(roots)
        random.shuffle(differing)
        pages = 0
        for bucket in differing[:PULL_BUCKETS]:
            offset, total = 0, 1
            while offset < total and got < PULL_BUDGET and pages < PULL_PAGES:
                page = await self._ask(node_id, address, LedgerIdsRequest(bucket=bucket, offset=offset), LedgerIds)
                pages += 1
                if not page.ids or page.bucket != bucket:
                    break
                total, offset = page.total, offset + len(page.ids)
                got += await self._fetch(node_id, address, ledger.missing(page.ids)[:PULL_BUDGET - got])
        return got

    async def _fetch(self, node_id: str, address: str | None, wanted: list[bytes]) -> int:
        got = 0
        for k in range(0, len(wanted), MAX_SUMMARIES_PER_MESSAGE):
            batch = wanted[k:k + MAX_SUMMARIES_PER_MESSAGE]
            give = await self._ask(node_id, address, LedgerFetch(ids=batch), WorkGive)
            if len(give.summaries) > len(batch):
                raise ProtocolError(ErrorCode.BAD_REQUEST, "more summaries than asked for")
            now = time.time()
            for summary in give.summaries:
                try:
                    got += self.ledger.add(now, summary)
                except InvalidSummary as exc:
                    log.info("node %s gave a summary that does not hold: %s", node_id[:16], exc)
        return got

    # ----- credit

    def standing(self) -> dict[str, Standing]:
        """Every member's credit as last worked out (`reckon`, every `STANDING_EVERY` seconds)."""
        return self._standing

    def credit_of(self, node_id: str) -> float:
        """A session's rank at a stage: its payer's balance, and whether it is placed (meshd.mesh.credit.priority)."""
        held = self.standing().get(node_id)
        return priority(0.0 if held is None else held.balance, node_id in self._placed)


def _size(message: Message) -> int:
    return len(encode(message))
