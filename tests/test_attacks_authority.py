"""Authority that costs something (meshd.mesh.authority), attacked with free identities against real daemons.

The honest mesh is tests/test_attacks.py's (a seed with no model, the tracker, and two volunteers
splitting the tiny model, all real `meshd join` processes on loopback), started afresh for this
module; the attackers are meshd's own daemon in-process (tests/attackers.py), each a real link
with a real key, so every honest node hears each of them first-hand. Identities are free, so
however many of them there are they must neither take the tracker nor get an honest stage
excluded: before the rule, four identities took this mesh's tracker (4 votes of 7 live members)
and two framed its head stage at both volunteers, the victim included.
"""

from __future__ import annotations

import pytest
import trio
from attackers import framing, genuine_receipt, sybils
from localmesh import mesh_status
from test_attacks import Mesh, converged, honest_ask, honest_route, joined, proven_in_log
from test_attacks import mesh as mesh  # noqa: PLC0414 (the module's fixture: a mesh of its own here)

from meshd.daemon import rpc
from meshd.mesh.election import Tracker
from meshd.mesh.records import ServedRange
from meshd.net.peers import Peers
from wire.errors import ErrorCode, ProtocolError
from wire.receipt import ProofGossip

pytestmark = pytest.mark.slow  # three daemons, two engine workers and in-process attackers

# The bidder and its backers: 6 of 9 live members, two thirds by head count, where the rule counts
# only the 3 the tracker placed or is (meshd.mesh.authority: free identities weigh nothing,
# however many; a placed attacker would need more placements than the honest mesh holds).
FREE_IDENTITIES = 6
# Long enough for every honest node to probe (and so hear first-hand) each attacker, and for the bid
# to sit on every record for several election timeouts (3 s each).
BID_SECONDS = 20.0


async def test_a_tracker_bid_backed_by_free_identities_outnumbering_the_mesh_never_takes_the_tracker(
        mesh: Mesh, peers: Peers) -> None:
    before = await converged(peers, mesh)
    assert before.tracker is not None
    async with sybils(mesh.seed.address, FREE_IDENTITIES) as crowd:
        bidder, *backers = crowd
        claim = Tracker(before.term + 1, bidder.mesh.node_id)  # one above the term: a believable claim
        bidder.hijack_election(lambda node: claim.term)
        for backer in backers:
            backer.vote_for(claim)
        for bad in crowd:
            await joined(peers, mesh, bad)
        until = trio.current_time() + BID_SECONDS
        while trio.current_time() < until:
            for node in mesh.nodes:
                view = await mesh_status(peers, node)
                assert (view.tracker, view.term) == (before.tracker, before.term), node.address
            await trio.sleep(0.5)
        # the bid was heard: every honest node holds the claim and its votes
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
        # their own signed records say they serve the victim's range (nobody placed them there)
        for bad in witnesses:
            bad.forge(models=[mesh.model], served=[ServedRange(model=mesh.model.digest, start=head.start,
                                                               end=head.end)])
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
            await rpc(peers, victim.address, ProofGossip(proof=proof), timeout=20.0)
        assert refused.value.code is ErrorCode.BAD_REQUEST and "against itself" in refused.value.message
        # every other node checks the witnesses against the tracker's placements, not their records
        for node in others:
            with pytest.raises(ProtocolError) as refused:
                await rpc(peers, node.address, ProofGossip(proof=proof), timeout=20.0)
            assert refused.value.code is ErrorCode.BAD_REQUEST and "does not serve" in refused.value.message, node
        await trio.sleep(2.0)  # a proof passed on would have gone round by now
        assert not any(proven_in_log(n, victim.node_id) for n in mesh.nodes)
        for via in mesh.nodes:
            route = await honest_route(peers, mesh, via)
            assert victim.node_id in [s.node_id for s in route.stages], via.address
        await honest_ask(peers, mesh)
