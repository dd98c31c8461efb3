"""Authority that costs something (meshd.mesh.authority), attacked with free identities against real daemons.

The honest mesh is tests/test_attacks.py's (a seed with no model, the tracker, and two volunteers
splitting the tiny model, all real `meshd join` processes on loopback), shared by the module: the
test that kills its tracker runs last. The attackers are meshd's own
daemon in-process (tests/attackers.py), each a real link with a real key, so every honest node
hears each of them first-hand. Identities are free, so however many of them there are they must
neither take the tracker nor get an honest stage excluded: before the rule, four identities took
this mesh's tracker (4 votes of 7 live members) and two framed its head stage at both
volunteers, the victim included.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from attackers import framing, genuine_receipt, sybils
from localmesh import Served, mesh_status, start_join, stop_all
from test_attacks import (
    ELECTION,
    PROMPT,
    SESSIONS,
    TOKENS,
    Mesh,
    converged,
    honest_ask,
    honest_mesh,
    honest_route,
    joined,
    proven_in_log,
)

from meshd.client.ask import AskRequest
from meshd.client.failover import ask_with_failover
from meshd.client.route import Stage as AskStage
from meshd.client.route import route_from_reply
from meshd.mesh.election import Tracker
from meshd.mesh.records import ServedRange
from meshd.mesh.swim_config import SwimConfig
from meshd.net.peers import Peers
from meshd.net.rpc import mesh_rpc
from wire.errors import ErrorCode, ProtocolError
from wire.meshrpc import RouteReply, RouteRequest
from wire.receipt import ProofGossip

pytestmark = pytest.mark.slow  # three daemons, two engine workers and in-process attackers

# The bidder and its backers: 6 of 9 live members, two thirds by head count, where the rule counts
# only the 3 the tracker placed or is (meshd.mesh.authority: free identities weigh nothing,
# however many; a placed attacker would need more placements than the honest mesh holds).
FREE_IDENTITIES = 6
# A member that becomes live in a node's view is pinged at that node's next probe tick (one a second;
# SwimConfig.confirmations of them a tick: the 6 sybils at once), and its ack is the node hearing it
# first-hand: three ticks after every honest node holds every sybil live, each has heard each of them.
CONFIRMED_S = 3 * SwimConfig().probe_interval
# Long enough for the bid to sit on every record for six or seven election timeouts of the honest
# daemons' (ELECTION: 1 s; as 20 s did at 3 s each).
BID_SECONDS = 7.0


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path]) -> Iterator[Mesh]:
    with honest_mesh(tmp_path_factory.mktemp("authority"), tiny_models["llama-gqa-untied"], flags=ELECTION) as shared:
        yield shared


async def ask_via(peers: Peers, mesh: Mesh, via: Served) -> None:
    """The honest ask, its routes asked of `via`: the whole model's answer."""
    async def find(excluded: list[str]) -> list[AskStage]:
        reply = await mesh_rpc(peers, via.address, RouteRequest(model=mesh.model.digest, exclude=excluded), timeout=20.0)
        assert isinstance(reply, RouteReply)
        return route_from_reply(reply)

    with trio.fail_after(60):
        result = await ask_with_failover(peers, find, AskRequest(messages=[{"role": "user", "content": PROMPT}],
                                                                 max_tokens=TOKENS))
    assert result.tokens == mesh.expected


async def test_a_tracker_bid_backed_by_free_identities_outnumbering_the_mesh_never_takes_the_tracker(
        mesh: Mesh, peers: Peers) -> None:
    before = await converged(peers, mesh)
    assert before.tracker is not None
    async with sybils(mesh.seed.address, FREE_IDENTITIES) as crowd:
        bidder, *backers = crowd
        claim = Tracker(before.term + 1, bidder.mesh.node_id)  # one above the term: a believable claim
        bidder.hijack_election(lambda node: claim.term)
        for backer in backers:
            backer.vote_for(lambda: claim)
        for bad in crowd:
            await joined(peers, mesh, bad)
        until = trio.current_time() + BID_SECONDS
        while trio.current_time() < until:
            for node in mesh.nodes:
                view = await mesh_status(peers, node)
                assert (view.tracker, view.term) == (before.tracker, before.term), node.address
            await trio.sleep(0.5)
        # the bid was on all along: a volunteer holds all six as members, each signing the claim's vote
        view = await mesh_status(peers, mesh.volunteers[0])
        assert sum(1 for m in view.members if m.node_id in {b.mesh.node_id for b in crowd}) == FREE_IDENTITIES
        assert all(b.mesh.record.vote_term == claim.term and b.mesh.record.vote_for == claim.node_id for b in crowd)
        await honest_ask(peers, mesh)
    view = await converged(peers, mesh)
    assert (view.tracker, view.term) == (before.tracker, before.term)
    await honest_ask(peers, mesh)


async def test_two_free_identities_claiming_a_stages_range_frame_it_at_no_node_the_victim_included(
        mesh: Mesh, peers: Peers) -> None:
    await converged(peers, mesh)
    head = (await honest_route(peers, mesh)).stages[0]
    victim = next(n for n in mesh.nodes if n.node_id == head.node_id)
    others = [n for n in mesh.nodes if n is not victim]
    async with sybils(mesh.seed.address, 2) as witnesses:
        # their own signed records say they serve the victim's range (nobody placed them there); they
        # offer no memory, so the tracker does not place them (a new placement could move the victim's range)
        for bad in witnesses:
            bad.forge(models=[mesh.model], memory_bytes=0, served=[ServedRange(model=mesh.model.digest,
                                                                               start=head.start, end=head.end)])
            await joined(peers, mesh, bad)
        claimed = f"[{head.start}, {head.end})"
        with trio.fail_after(30):
            while not all(all(any(m.node_id == bad.mesh.node_id and claimed in " ".join(m.served) for m in view.members)
                              for bad in witnesses)
                          for view in [await mesh_status(peers, n) for n in mesh.nodes]):
                await trio.sleep(0.25)
        # a receipt the victim really signed, and the two identities' "witness" receipts against it
        proof = framing(await genuine_receipt(witnesses[0].peers, head, mesh.model.digest), witnesses)
        # the victim first: it never takes (nor passes on) a proof against itself
        with pytest.raises(ProtocolError) as refused:
            await mesh_rpc(peers, victim.address, ProofGossip(proof=proof), timeout=20.0)
        assert refused.value.code is ErrorCode.BAD_REQUEST and "against itself" in refused.value.message
        # every other node checks the witnesses against the tracker's placements, not their records
        for node in others:
            with pytest.raises(ProtocolError) as refused:
                await mesh_rpc(peers, node.address, ProofGossip(proof=proof), timeout=20.0)
            assert refused.value.code is ErrorCode.BAD_REQUEST and "does not serve" in refused.value.message, node
        await trio.sleep(2.0)  # a proof passed on would have gone round by now
        assert not any(proven_in_log(n, victim.node_id) for n in mesh.nodes)
        for via in mesh.nodes:
            route = await honest_route(peers, mesh, via)
            assert victim.node_id in [s.node_id for s in route.stages], via.address
        await honest_ask(peers, mesh)


async def test_a_volunteer_joining_while_free_identities_bid_follows_the_tracker_its_seed_backs(
        mesh: Mesh, peers: Peers, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    # the module's mesh: the member it adds (and stops) leaves it as it was, the model covered by the two
    before = await converged(peers, mesh)
    async with sybils(mesh.seed.address, FREE_IDENTITIES) as crowd:
        bidder, *backers = crowd
        claim = Tracker(before.term + 1, bidder.mesh.node_id)
        bidder.hijack_election(lambda node: claim.term)
        for backer in backers:
            backer.vote_for(lambda: claim)
        for bad in crowd:
            await joined(peers, mesh, bad)
        # a newcomer has no placement to weigh members by until it follows a tracker: it follows the
        # claim its seed backs (counting heads, it could follow the bid, as test_authority shows)
        late = await trio.to_thread.run_sync(lambda: start_join(
            "--seed", mesh.seed.address, "--model", str(tiny_models["llama-gqa-untied"]), "--memory", "1M",
            "--state-dir", str(tmp_path / "late"), *SESSIONS, *ELECTION))
        try:
            with trio.fail_after(30):
                while (view := await mesh_status(peers, late)).tracker is None:
                    await trio.sleep(0.25)
            until = trio.current_time() + BID_SECONDS / 2  # three election timeouts and more
            while trio.current_time() < until:
                assert (view.tracker, view.term) == (before.tracker, before.term)
                await trio.sleep(0.5)
                view = await mesh_status(peers, late)
            # the tracker it follows placed it: its record carries that placement, so it weighs too
            with trio.fail_after(30):
                while not any(m.node_id == late.node_id and m.served for m in (await mesh_status(peers, late)).members):
                    await trio.sleep(0.25)
        finally:
            await trio.to_thread.run_sync(stop_all, [late])


async def test_with_the_tracker_killed_free_identities_bidding_at_every_term_never_win_the_vacancy(
        mesh: Mesh, peers: Peers) -> None:
    # the module's mesh: the last test on it, as it kills the tracker
    before = await converged(peers, mesh)
    assert before.tracker == mesh.seed.node_id  # the founder, which serves nothing: its death loses no layer
    async with sybils(mesh.seed.address, FREE_IDENTITIES) as crowd:
        bidder, *backers = crowd
        # always one above the highest term it has seen (believable), backed by every other sybil
        bidder.hijack_election(lambda node: node.election.highest_term + 1)
        for backer in backers:
            backer.vote_for(lambda: Tracker(bidder.mesh.record.tracker_term, bidder.mesh.node_id))
        for bad in crowd:
            await joined(peers, mesh, bad)
        await trio.sleep(CONFIRMED_S)  # every volunteer has pinged (heard first-hand) each sybil
        os.kill(mesh.seed.proc.pid, signal.SIGKILL)
        honest = {v.node_id for v in mesh.volunteers}
        with trio.fail_after(60):
            while len(trackers := {(await mesh_status(peers, v)).tracker for v in mesh.volunteers}) != 1 \
                    or trackers & {None, mesh.seed.node_id}:
                await trio.sleep(0.25)
        (successor,) = trackers
        assert successor in honest, "a sybil took the vacancy"
        for _ in range(2 * int(BID_SECONDS / 2)):  # and it holds while the bids go on: three election timeouts and more
            for v in mesh.volunteers:
                assert (await mesh_status(peers, v)).tracker == successor
            await trio.sleep(0.5)
        assert bidder.mesh.record.tracker_term > before.term
        await ask_via(peers, mesh, mesh.volunteers[0])
