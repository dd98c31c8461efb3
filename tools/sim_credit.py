"""Simulates the credit ledger's economy (meshd.mesh.credit), sans-IO: who gets served under contention.

A mesh of members over simulated hours: honest volunteers (placed: they serve and ask), free-riders
(ask only, never placed) and Sybil rings (free identities, ten a ring, one source address a ring,
that ask honest stages and countersign each other's made-up work), and one greedy newcomer (one
identity asking as much as a whole ring: the yardstick a ring is measured by). Each hour every member asks at
its rate; the stages can serve only `capacity` of all that is asked (contention). Admission is the
stage books' rule (meshd.stage.books): askers by rank (meshd.mesh.credit.priority: balance, and placed
volunteers above those that serve nothing) first; newcomers (no rank)
keep `NEWCOMER_FLOOR` of the capacity between them, one share per source address (a ring's
identities share one). What is served becomes the asker's countersigned summaries, and the
credit (the one rule, ``credit_standing``) is worked out again from them each hour.

Ledger gossip bytes are counted from the real messages' encoded sizes (wire.credit): each member
pulls from one other every `pull_interval` seconds; a pull whose roots differ moves the bucket
digests, a page of ids per differing bucket, and the summaries it lacks; each ask gives one summary
to each stage. Reported per member and hour, both directions.

    python tools/sim_credit.py                 # 1,000 members, a week
    python tools/sim_credit.py --members 200 --hours 24
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshd.client.ledger import WALK_EVERY  # noqa: E402
from meshd.mesh.credit import NEWCOMER_FLOOR, WINDOW, Standing, Windows, credit_standing, priority  # noqa: E402
from wire.credit import (  # noqa: E402
    BUCKETS,
    RECENT,
    LedgerFetch,
    LedgerIds,
    LedgerIdsRequest,
    LedgerRoots,
    LedgerRootsRequest,
    WorkGive,
    WorkSummary,
    WorkTaken,
)
from wire.identity import NodeIdentity  # noqa: E402
from wire.message import encode  # noqa: E402
from wire.receipt import NO_PREV, Receipt  # noqa: E402

RING = 10


@dataclass
class Config:
    members: int = 1000
    hours: int = 168
    free_riders: float = 0.10
    sybils: float = 0.05
    # asks an hour: an honest member's, a free-rider's and a Sybil identity's (the greedy ask more)
    honest_rate: float = 0.2
    greedy_rate: float = 1.0
    # the share of all that is asked the stages can serve
    capacity: float = 0.6
    stages_per_ask: int = 2
    layers_per_stage: int = 15
    tokens_per_ask: int = 300
    pull_interval: float = 30.0
    seed: int = 1


@dataclass
class Member:
    node_id: str
    kind: str  # "honest", "free-rider", "sybil"
    source: str
    rate: float
    asked: int = 0
    served: int = 0


@dataclass
class Sim:
    config: Config
    members: list[Member] = field(default_factory=list)
    windows: Windows = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    summaries: int = 0

    def __post_init__(self) -> None:
        c = self.config
        n_free = round(c.members * c.free_riders)
        n_sybil = round(c.members * c.sybils) // RING * RING
        n_honest = c.members - n_free - n_sybil
        for k in range(n_honest):
            self.members.append(Member(f"h{k:05d}", "honest", f"h{k}", c.honest_rate))
        for k in range(n_free):
            self.members.append(Member(f"f{k:05d}", "free-rider", f"f{k}", c.greedy_rate))
        for k in range(n_sybil):
            self.members.append(Member(f"s{k:05d}", "sybil", f"ring{k // RING}", c.greedy_rate))
        # the yardstick for a ring: one newcomer (one identity, one address) that asks as much as a whole ring
        self.members.append(Member("g00000", "greedy newcomer", "g0", c.greedy_rate * RING))
        self.honest = [m for m in self.members if m.kind == "honest"]
        self.placed = frozenset(m.node_id for m in self.honest)

    def run(self, rng: random.Random) -> dict[str, object]:
        c = self.config
        work = float(c.layers_per_stage * c.tokens_per_ask)
        credit: dict[str, float] = {}
        standing: dict[str, Standing] = {}
        by_kind_asked: dict[str, int] = defaultdict(int)
        by_kind_served: dict[str, int] = defaultdict(int)
        for hour in range(c.hours):
            now = hour * WINDOW
            asks = [m for m in self.members for _ in range(_draws(rng, m.rate))]
            rng.shuffle(asks)
            for m in asks:
                by_kind_asked[m.kind] += 1
            served = self._admit(asks, credit, rng, max(1, round(len(asks) * c.capacity)))
            for m in served:
                m.served += 1
                by_kind_served[m.kind] += 1
                for stage in rng.sample(self.honest, c.stages_per_ask):
                    if stage.node_id != m.node_id:
                        self.windows[(stage.node_id, m.node_id)][int(now // WINDOW)] += work
                        self.summaries += 1
            # each ring countersigns made-up work among its identities: it earns only what a payer gave
            for ring in {m.source for m in self.members if m.kind == "sybil"}:
                ids = [m.node_id for m in self.members if m.source == ring]
                for asker in ids:
                    for stage in ids:
                        if stage != asker:
                            self.windows[(stage, asker)][int(now // WINDOW)] += work * 10
                            self.summaries += 1
            standing, _ = credit_standing(self.windows, now + WINDOW, self.placed)
            credit = {m.node_id: priority(standing[m.node_id].balance if m.node_id in standing else 0.0,
                                          m.node_id in self.placed) for m in self.members}
        total_served = sum(by_kind_served.values())
        sybil_credit = max((credit.get(m.node_id, 0.0) for m in self.members if m.kind == "sybil"), default=0.0)
        rings = len({m.source for m in self.members if m.kind == "sybil"})
        per_newcomer_source = self._newcomer_service()
        return {
            "members": len(self.members), "hours": c.hours,
            "asked": dict(by_kind_asked), "served": dict(by_kind_served),
            "share_of_service": {k: round(v / total_served, 4) for k, v in by_kind_served.items()},
            "newcomer_floor": NEWCOMER_FLOOR,
            "served_per_source": per_newcomer_source, "sybil_rings": rings,
            "largest_sybil_credit": sybil_credit,
            "honest_with_credit": sum(1 for m in self.honest if m.node_id in standing
                                      and standing[m.node_id].balance > 0),
            "summaries": self.summaries,
        }

    def _admit(self, asks: list[Member], credit: dict[str, float], rng: random.Random, capacity: int) -> list[Member]:
        """The books' rule over an hour: newcomers keep the floor (one share per source address, the
        shares round-robin), askers with credit take the rest by credit, and what either leaves goes
        to the other."""
        rich = sorted((m for m in asks if credit.get(m.node_id, 0.0) > 0), key=lambda m: -credit[m.node_id])
        poor = [m for m in asks if credit.get(m.node_id, 0.0) <= 0]
        floor = min(len(poor), math.floor(capacity * NEWCOMER_FLOOR))
        by_source: dict[str, list[Member]] = defaultdict(list)
        for m in poor:
            by_source[m.source].append(m)
        queues = list(by_source.values())
        rng.shuffle(queues)
        newcomers: list[Member] = []
        while len(newcomers) < len(poor):
            for q in queues:
                if q:
                    newcomers.append(q.pop())
            queues = [q for q in queues if q]
        taken = newcomers[:floor]
        rest = capacity - len(taken)
        taken += rich[:rest]
        rest = capacity - len(taken)
        taken += newcomers[floor:floor + max(0, rest)]
        return taken

    def _newcomer_service(self) -> dict[str, float]:
        """Asks served per hour: an honest member's, a free-rider's, and a whole Sybil ring's (all its identities)."""
        c = self.config
        out: dict[str, float] = {}
        for kind in ("honest", "free-rider", "greedy newcomer"):
            group = [m for m in self.members if m.kind == kind]
            if group:
                out[f"one {kind}"] = round(sum(m.served for m in group) / len(group) / c.hours, 4)
        rings = defaultdict(int)
        for m in self.members:
            if m.kind == "sybil":
                rings[m.source] += m.served
        if rings:
            out["one sybil ring"] = round(sum(rings.values()) / len(rings) / c.hours, 4)
        return out


def _draws(rng: random.Random, rate: float) -> int:
    """A Poisson draw of asks in an hour at `rate`."""
    k, p, limit = 0, 1.0, math.exp(-rate)
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def gossip_bytes(config: Config, summaries_per_hour: float, held: float) -> dict[str, float]:
    """Bytes a member sends and receives per hour for the ledger, from the real messages' sizes."""
    asker, stage = NodeIdentity.generate(), NodeIdentity.generate()
    head = Receipt.build("s" * 32, 0, config.tokens_per_ask - 1, 1, "ab" * 32, 0, config.layers_per_stage,
                         b"i" * 16, b"o" * 16, b"h" * 16, NO_PREV, stage.public_key, stage)
    summary = WorkSummary.create(asker, "ab" * 32, 0, config.layers_per_stage, config.tokens_per_ask - 20, 20, True,
                                 1_800_000_000, head)
    one_summary = len(encode(WorkGive(summaries=[summary]))) - len(encode(WorkGive(summaries=[])))
    give = len(encode(WorkGive(summaries=[summary]))) + len(encode(WorkTaken(taken=1)))
    roots_same = len(encode(LedgerRootsRequest(root=bytes(16)))) + len(encode(LedgerRoots(root=bytes(16), count=1)))
    pulls = 3600.0 / config.pull_interval
    new_per_pull = summaries_per_hour / pulls
    recent = min(RECENT, math.ceil(new_per_pull * 2))
    roots_recent = len(encode(LedgerRootsRequest(root=bytes(16)))) + len(
        encode(LedgerRoots(root=bytes(16), count=1, recent=[bytes(16)] * recent)))
    roots_walk = len(encode(LedgerRootsRequest(root=bytes(16), walk=True))) + len(
        encode(LedgerRoots(root=bytes(16), count=1, recent=[bytes(16)] * recent, buckets=[bytes(16)] * BUCKETS)))
    per_bucket = int(held / BUCKETS)
    ids_page = len(encode(LedgerIdsRequest(bucket=1, offset=0))) + len(
        encode(LedgerIds(bucket=1, ids=[bytes(16)] * min(per_bucket, 1024), total=per_bucket)))
    fetch_per_id = len(encode(LedgerFetch(ids=[bytes(16)] * 64))) / 64 + one_summary
    differing = BUCKETS * (1 - (1 - 1 / BUCKETS) ** new_per_pull)
    differ_chance = 1 - math.exp(-new_per_pull)
    # one pull in WALK_EVERY walks the buckets (counted as if each differed as much as a pull's news)
    walk = (roots_walk - roots_recent + differing * ids_page) / WALK_EVERY
    per_pull = roots_same * (1 - differ_chance) + differ_chance * roots_recent + walk + new_per_pull * fetch_per_id
    # a member's own pulls, the pulls others make of it (as many, on average), and its asks' gives
    per_member = 2 * pulls * per_pull + summaries_per_hour / config.members * give * 2
    return {"bytes_per_member_hour": round(per_member), "pull_bytes_when_equal": roots_same,
            "summaries_per_hour_mesh": round(summaries_per_hour),
            "summary_bytes": one_summary, "ids_page_bytes": ids_page, "differing_buckets_per_pull": round(differing, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=Config.members)
    parser.add_argument("--hours", type=int, default=Config.hours)
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--capacity", type=float, default=Config.capacity)
    args = parser.parse_args(argv)
    if args.members < 2 * RING or args.hours < 1 or not 0 < args.capacity <= 1:
        parser.error("--members at least 20, --hours at least 1, --capacity in (0, 1]")
    config = Config(members=args.members, hours=args.hours, seed=args.seed, capacity=args.capacity)
    sim = Sim(config)
    report = sim.run(random.Random(config.seed))
    honest_summaries = sim.summaries / config.hours
    # the ledger a member holds: a week of summaries at most (older ones weigh under half)
    report["gossip"] = gossip_bytes(config, honest_summaries, min(sim.summaries, honest_summaries * 168))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
