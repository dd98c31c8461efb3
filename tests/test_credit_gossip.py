"""The credit ledger's gossip between daemons (issue 33, part 2): six members, each handed a share of
200 asks' summaries, end up holding the same ledger (equal roots) within a bounded time, with no
coordinator; a member that joins late catches up."""

from __future__ import annotations

import random
import time
from contextlib import AsyncExitStack

import pytest
import trio
from attackers import running

from meshd.daemon import MeshDaemon
from meshd.daemon.config import NodeConfig
from tests.credit_helpers import served
from wire.identity import NodeIdentity

pytestmark = pytest.mark.slow  # six daemons in this process, real sockets, some seconds of gossip

# a bound on waiting, not a speed claim: pulls four times a second or so (the rounds it takes to agree,
# not their period, are what this shows), a few rounds to agree
AGREE_WITHIN = 60.0
LEDGER_INTERVAL = 0.25


def _config(seeds: tuple[str, ...] = ()) -> NodeConfig:
    return NodeConfig(seeds=seeds, ledger_interval=LEDGER_INTERVAL, probes=None)


async def _agree(daemons: list[MeshDaemon]) -> float:
    start = trio.current_time()
    with trio.fail_after(AGREE_WITHIN):
        while len({d.credit.ledger.root for d in daemons}) > 1:
            await trio.sleep(0.2)
    return trio.current_time() - start


async def test_six_members_hold_the_same_ledger_after_200_asks() -> None:
    rng = random.Random(5)
    members = [NodeIdentity.generate() for _ in range(12)]
    now = time.time()
    summaries = [served(*rng.sample(members, 2), tokens=rng.randint(1, 400), session=f"ask{k}", at=now)
                 for k in range(200)]
    async with AsyncExitStack() as stack:
        seed = await stack.enter_async_context(running(MeshDaemon(NodeIdentity.generate(), _config())))
        daemons = [seed]
        for _ in range(4):
            daemons.append(await stack.enter_async_context(
                running(MeshDaemon(NodeIdentity.generate(), _config((seed.local_address,))))))
        # each summary reaches one member, as an asker's give reaches its stage
        for k, summary in enumerate(summaries):
            daemons[k % len(daemons)].credit.ledger.add(now, summary)
        await _agree(daemons)
        assert {len(d.credit.ledger) for d in daemons} == {200}
        # a sixth member joins late and catches up (it is plainly behind: it walks the buckets at once)
        late = await stack.enter_async_context(
            running(MeshDaemon(NodeIdentity.generate(), _config((seed.local_address,)))))
        daemons.append(late)
        await _agree(daemons)
        assert len(late.credit.ledger) == 200
