"""The daemon's credit: the ledger's peers and pages, and the election's votes weighed by it."""

from __future__ import annotations

import logging
import time

import trio

from meshd.client.served import Served
from meshd.daemon.state import DaemonState
from meshd.mesh.authority import placement_of
from meshd.mesh.credit import NEWCOMER_FLOOR, extra_votes
from wire.credit import CREDITS_PAGE, CreditsReply, PeerCredit, Voucher

# members named in the log line of a change of their extra votes
CHANGES_NAMED = 16

log = logging.getLogger(__name__)


class Credit(DaemonState):
    """The credit ledger's part in the daemon (meshd.mesh.credit): who pays, votes weighed by work served,
    vouchers for this member's own commands, countersigned work, and the ledger as ``meshd credits`` shows it."""

    def placed_members(self) -> set[str]:
        """The members whose placement by a tracker this node followed their records carry, and those
        trackers: whose asks pay credit whatever they hold (meshd.mesh.credit)."""
        followed = self.mesh.election.followed
        placed = {r.node_id for r in self.live_records() if placement_of(r, followed) is not None}
        return placed | {node_id for _, node_id in followed}

    async def _weigh_by_credit(self) -> None:
        """Every `NodeConfig.credit_votes_every`, gives each placed member the extra votes its served work earns it in
        the election (meshd.mesh.credit.extra_votes of what it earned: the work it served members who pay,
        not less what it asked, as authority goes by work served): rarely, as ledgers agree a round or two late."""
        weighed: dict[str, int] = {}
        while True:
            await trio.sleep(self.config.credit_votes_every)
            placed = self.placed_members()
            extra = {node_id: votes for node_id, standing in self.credit.standing().items()
                     if node_id in placed and (votes := extra_votes(standing.earned, self.credit.ledger.cap))}
            self.duty.credit_weights(trio.current_time(), extra)
            self._flush()
            # who outweighs a head count is worth a line when it changes (an operator's, and a test's sign that
            # the election weighs what the ledger holds now): the members whose extra votes changed, a few named
            changed = sorted((node_id, extra.get(node_id, 0)) for node_id in extra.keys() | weighed.keys()
                             if extra.get(node_id, 0) != weighed.get(node_id, 0))
            if changed:
                named = ", ".join(f"{node_id[:16]} +{votes}" for node_id, votes in changed[:CHANGES_NAMED])
                more = f" and {len(changed) - CHANGES_NAMED} more" if len(changed) > CHANGES_NAMED else ""
                log.info("the election weighs by credit: %s%s", named, more)
            weighed = extra

    def _ledger_peers(self) -> list[tuple[str, str | None]]:
        membership = self.mesh.membership
        return [(r.node_id, self.dial_address(r)) for r in self.live_records()
                if r.node_id != self.mesh.node_id and membership.rtt(r.node_id) is not None]

    def voucher(self, opener: str, key: str = "", keys: int = 0) -> Voucher:
        """Lets `opener` (an identity of this member's own commands) ask on this member's credit: for the
        front door's API key `key` (one of `keys`), on that key's share of it."""
        return self.credit.voucher(opener, key, keys)

    def countersign(self, served: list[Served], key: str = "") -> int:
        """Countersigns what each stage of an ask made for this member served (for API key `key`), and
        gives it to the stage."""
        return len(self.credit.countersign(self._nursery, served, self.address_of, key))

    def credits(self, offset: int = 0) -> CreditsReply:
        """This node's ledger: its own standing and every member's (a page from `offset`), for `meshd credits`."""
        me = self.mesh.node_id
        standing = self.credit.standing()
        between = self.credit.ledger.between(me, time.time())
        members = sorted(set(standing) | set(between) | {me})

        def line(node_id: str) -> PeerCredit:
            held = standing.get(node_id)
            served, asked = between.get(node_id, (0.0, 0.0))
            return PeerCredit(node_id=node_id, balance=held.balance if held else 0.0,
                              earned=held.earned if held else 0.0, spent=held.spent if held else 0.0,
                              served_us=served, asked_us=asked, placed=bool(held and held.placed))

        others = [m for m in members if m != me]
        return CreditsReply(node_id=me, own=line(me), members=[line(m) for m in others[offset:offset + CREDITS_PAGE]],
                            total_members=len(others), summaries=len(self.credit.ledger), root=self.credit.ledger.root,
                            floor=NEWCOMER_FLOOR)
