"""The credit simulation (tools/sim_credit.py) in a fast variant: 200 members over a day, with the
issue's mix (10% free-riders, 5% Sybils in rings of ten). Under contention free-riders get no more
than the newcomers' floor of the service, a Sybil ring earns no credit and gets no more than a
newcomer's turn, and the ledger's gossip stays bounded."""

from __future__ import annotations

import random

from sim_credit import Config, Sim, gossip_bytes

from meshd.mesh.credit import NEWCOMER_FLOOR


def test_free_riders_and_sybil_rings_get_no_more_than_the_newcomers_floor() -> None:
    config = Config(members=200, hours=24)
    sim = Sim(config)
    report = sim.run(random.Random(config.seed))
    share = report["share_of_service"]
    assert isinstance(share, dict)
    assert share["free-rider"] <= NEWCOMER_FLOOR + 0.01, report
    assert report["largest_sybil_credit"] == 0.0, report
    per_source = report["served_per_source"]
    assert isinstance(per_source, dict)
    # a ring (ten identities, one address) is served as one newcomer asking as much as the ten together
    assert per_source["one sybil ring"] <= 1.1 * per_source["one greedy newcomer"], report
    gossip = gossip_bytes(config, sim.summaries / config.hours, sim.summaries)
    assert gossip["bytes_per_member_hour"] < 1 << 20, gossip


def test_without_contention_everyone_is_served() -> None:
    config = Config(members=40, hours=6, capacity=1.0)
    report = Sim(config).run(random.Random(2))
    assert report["served"] == report["asked"], report
