"""The p26 tracker bid against members with credit, on real daemons (issue 33, Done-when).

The honest mesh is tests/test_attacks.py's (a seed with no model, the tracker, and two volunteers
splitting the tiny model, real `meshd join` processes). Its members first serve each other: each
asks through its own daemon, as `meshd ask` does (an identity of the command's own, the member's
voucher, the member countersigning what each stage served), until each volunteer has earned a
window cap's worth from the others, which gives each one extra vote (meshd.mesh.credit.extra_votes).
The model is the tiny llama made 24 layers deep: a volunteer's stage holds 12, so an ask earns it four
times the work (layers x tokens) of one on the 6-layer model; and the honest daemons' window cap is an
eighth of the product's (--asker-window-cap, the same on all of them): the rule, not its scale, is what
this shows, and four asks from each member earn each volunteer a cap's worth.
Then four attackers join as real volunteers of the same model, which the honest tracker places
(so they weigh: placed identities, not free ones), and bid for the tracker. By head count the bid
carries (4 placed attackers of 7 weighing members); by weight it is 4 against 1 + 2 + 2, and fails.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio
from attackers import attacker
from localmesh import Served, mesh_status
from test_attacks import ELECTION, SESSIONS, Mesh, converged, honest_mesh, joined
from test_attacks_authority import BID_SECONDS
from test_credit_mesh import ledger

from meshd.client.ask import AskRequest
from meshd.client.asker import Asker
from meshd.client.route import Stage, route_from_reply
from meshd.client.served import Served as Work
from meshd.daemon.config import NodeConfig
from meshd.mesh.credit import ASKER_WINDOW_CAP
from meshd.mesh.election import Tracker
from meshd.net.control import control_request
from meshd.net.peers import PeersConfig, open_peers
from meshd.net.rpc import mesh_rpc
from meshd.stage.books import StageLimits
from wire.credit import CountersignRequest, VoucherReply, VoucherRequest
from wire.identity import NodeIdentity
from wire.meshrpc import RouteReply, RouteRequest
from wire.receipt import Proof

# three daemons and four in-process volunteers, each with an engine worker; a dozen asks to earn credit
# and a few seconds for the daemons to weigh it
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PLACED_ATTACKERS = 4
# the honest daemons' window cap: an eighth of the product's, some 6 asks' work a stage (a user's mesh needs
# some 50 asks of 220 tokens of a volunteer's 12 layers for the cap a member's extra vote takes)
CAP = ASKER_WINDOW_CAP / 8
# what each volunteer must have earned in every honest ledger: a little over a cap, decay included
EARNED = 1.05 * CAP
# the honest daemons give their elections each member's extra votes every 2 s, not the product's 60 s (a
# test of what the weighing decides, not of how rarely it runs), and time their elections as
# test_attacks_authority's do (so its BID_SECONDS spans as many election rounds)
VOTES_EVERY = 2.0
# the honest daemons' ledgers pull what they lack every 2 s or so, not 30: the others' ledgers catch up
# with what a volunteer earned in seconds (the gossip, not its period, is what test_credit_gossip shows)
LEDGER_INTERVAL = 2.0
# and they work their ledgers' credit out every 2 s, not the product's 10 s (STANDING_EVERY), for the weighing to take
STANDING_S = 2.0
FLAGS = ("--asker-window-cap", f"{CAP:g}", "--credit-votes-every", f"{VOTES_EVERY:g}",
         "--standing-every", f"{STANDING_S:g}",
         "--ledger-interval", f"{LEDGER_INTERVAL:g}", *ELECTION)
# a bound on waiting for the weighing (every VOTES_EVERY, a few seconds on a quiet box), not a speed claim:
# what is checked is that every honest election weighs both volunteers, and a loaded box only makes it later
VOTES_SETTLE_S = 60.0
DEEP_LAYERS = 24
# 12 layers with the KV of 4 sessions of 256 tokens (SESSIONS), and the embedding or the LM head: half
# the deep model, and 13 layers do not fit (meshd.mesh.assignment)
HALF_DEEP = 3400 << 10
# each member's asks between two looks at the ledgers: from the seed and the other volunteer, one round
# earns each volunteer 2 x 4 asks x 12 layers x ~221 tokens x 0.5 (unchecked), some 10,600: over EARNED
ASKS_A_ROUND = 4


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gguf_factory import TINY_SPECS, write_tiny_gguf

    spec = replace(TINY_SPECS["llama-gqa-untied"], n_layer=DEEP_LAYERS)
    return write_tiny_gguf(tmp_path_factory.mktemp("deep") / "llama-deep.gguf", spec)


def earned_in(doc: dict[str, Any], node_id: str) -> float:
    if doc["node"] == node_id:
        return float(doc["own"]["earned"])
    return next((float(m["earned"]) for m in doc["members"] if m["node_id"] == node_id), 0.0)


async def placed_in(state: Path) -> set[str]:
    """The members the ledger of `state`'s member counts as placed (by a tracker it followed)."""
    doc = await ledger(state)
    return {m["node_id"] for m in doc["members"] if m["placed"]}


async def member_asks(state: Path, member: Served, digest: str, prompts: int) -> None:
    """`prompts` asks of a long prompt as the member of `state` makes them (meshd ask): its voucher,
    its routes, and its countersignature of what each stage served."""
    async with open_peers(NodeIdentity.generate(), PeersConfig()) as peers:
        reply = await control_request(state, VoucherRequest(opener=peers.node_id), timeout=20.0)
        assert isinstance(reply, VoucherReply)

        async def find(excluded: list[str]) -> list[Stage]:
            routed = await mesh_rpc(peers, member.address, RouteRequest(model=digest, exclude=excluded), timeout=20.0)
            assert isinstance(routed, RouteReply)
            return route_from_reply(routed)

        async def no_proofs(proof: Proof) -> None:
            raise AssertionError("an honest stage was caught lying")

        async def countersign(served: list[Work]) -> None:
            summaries = [w.signed(peers.identity, int(time.time())) for w in served]
            await control_request(state, CountersignRequest(summaries=summaries), timeout=20.0)

        asker = Asker(peers, find, find, no_proofs, report_work=countersign)
        for k in range(prompts):
            # 220 bytes of prompt (the tiny model's vocabulary is bytes; a session holds 256 positions),
            # each ask its own (no stage's prefix cache shortens it)
            text = (f"{k} {state.name}: " + "the quick brown fox jumps over the lazy dog " * 5)[:220]
            result = await asker.ask(AskRequest(text=text, max_tokens=1, cache=False, payer=reply.voucher))
            assert result.tokens


async def earn(mesh: Mesh, base: Path) -> None:
    """The honest members ask through each other until both volunteers have earned `EARNED` in every
    honest ledger (the seed's asks and the other volunteer's each pay a volunteer up to a cap an hour).
    A volunteer's own ledger holds what it served as each ask ends (the asker gives it the summary);
    once both hold enough, more asks add nothing, and the others' ledgers catch up by gossip."""
    digest = mesh.model.digest
    askers = [(base / "seed", mesh.seed), (base / "v0", mesh.volunteers[0]), (base / "v1", mesh.volunteers[1])]
    volunteers = [v.node_id for v in mesh.volunteers]
    deadline = time.monotonic() + 600.0
    for _ in itertools.count():
        docs = [await ledger(state) for state, _ in askers]
        if all(earned_in(doc, v) >= EARNED for doc in docs for v in volunteers):
            return
        assert time.monotonic() < deadline, [[earned_in(doc, v) for v in volunteers] for doc in docs]
        if all(earned_in(doc, doc["node"]) >= EARNED for doc in docs[1:]):
            await trio.sleep(1.0)
            continue
        async with trio.open_nursery() as nursery:
            for state, member in askers:
                nursery.start_soon(member_asks, state, member, digest, ASKS_A_ROUND)


def weighs_by_credit(daemon: Served, volunteers: list[str]) -> bool:
    """Whether `daemon`'s election weighs each of `volunteers` with extra votes, as its log's lines of
    changes say (meshd.daemon.credit)."""
    assert daemon.log is not None
    votes: dict[str, int] = {}
    for line in daemon.log.read_text().splitlines():
        if "the election weighs by credit: " in line:
            votes.update((short, int(n)) for short, n in re.findall(r"([0-9a-f]{16}) \+(\d+)", line))
    return all(votes.get(node_id[:16], 0) >= 1 for node_id in volunteers)


async def weighed(mesh: Mesh) -> None:
    """Until every honest daemon's election weighs both volunteers by their credit."""
    volunteers = [v.node_id for v in mesh.volunteers]
    with trio.fail_after(VOTES_SETTLE_S):
        while not all(weighs_by_credit(node, volunteers) for node in mesh.nodes):
            await trio.sleep(0.5)


async def placed_attackers(mesh: Mesh, path: Path, base: Path, n: int,
                           body: Callable[[list[Any]], Awaitable[None]]) -> None:
    """`n` attackers joined as real volunteers of `path` (the honest tracker places them), for `body`."""
    config = NodeConfig(model=path, memory_bytes=HALF_DEEP, threads=1, probes=None,
                        limits=StageLimits(max_sessions=4, max_session_tokens=256), peers=PeersConfig())
    async with attacker(mesh.seed.address, replace(config, state_dir=base / "a0")) as a0, \
            attacker(mesh.seed.address, replace(config, state_dir=base / "a1")) as a1, \
            attacker(mesh.seed.address, replace(config, state_dir=base / "a2")) as a2, \
            attacker(mesh.seed.address, replace(config, state_dir=base / "a3")) as a3:
        crowd = [a0, a1, a2, a3][:n]
        await body(crowd)


async def test_placed_identities_outnumbering_members_with_credit_never_take_the_tracker(
        deep_model: Path, tmp_path: Path) -> None:
    path = deep_model
    assert SESSIONS[-1] == "256"
    with honest_mesh(tmp_path, path, memory=f"{HALF_DEEP >> 10}K", flags=FLAGS) as mesh:
        async with open_peers(NodeIdentity.generate(), PeersConfig()) as peers:
            before = await converged(peers, mesh)
            await earn(mesh, tmp_path)
            await weighed(mesh)

            async def bid(crowd: list[Any]) -> None:
                ids = {a.mesh.node_id for a in crowd}
                for bad in crowd:
                    await joined(peers, mesh, bad)
                # the honest tracker placed every attacker: each weighs, in every honest view
                deadline = trio.current_time() + 90.0
                while True:
                    views = [await placed_in(tmp_path / name) for name in ("seed", "v0", "v1")]
                    if all(ids <= view for view in views):
                        break
                    assert trio.current_time() < deadline, (ids, views)
                    await trio.sleep(1.0)
                bidder, *backers = crowd
                claim = Tracker(before.term + 1, bidder.mesh.node_id)
                bidder.hijack_election(lambda node: claim.term)
                for backer in backers:
                    backer.vote_for(lambda: claim)
                until = trio.current_time() + BID_SECONDS
                while trio.current_time() < until:
                    for node in mesh.nodes:
                        view = await mesh_status(peers, node)
                        assert (view.tracker, view.term) == (before.tracker, before.term), node.address
                    await trio.sleep(0.5)
                assert all(b.mesh.record.vote_term == claim.term and b.mesh.record.vote_for == claim.node_id
                           for b in crowd)

            await placed_attackers(mesh, path, tmp_path, PLACED_ATTACKERS, bid)
            view = await converged(peers, mesh)
            assert (view.tracker, view.term) == (before.tracker, before.term)
