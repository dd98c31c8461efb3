"""Every attack of issue 14, by attacking members (tests/attackers.py) against one real mesh.

The mesh is real `meshd join` processes on loopback, shared by the whole module: a seed with no
model and two volunteers splitting the tiny random model between them, `--max-sessions 4` each.
The attackers are meshd's own daemon in-process, joined through the seed, each lying in its own
way. Each attack is refused, contained or caught: the tracker stays the honest one and elections
finish, routes stay honest, `status` keeps working, a bystander's session is never failed by
another's input, and the honest ask gives the whole model's answer before and after.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from attackers import LAST_TERM, AttackerDaemon, attacker, every_layer, fake_model, planted_sync
from localmesh import Served, run_meshd, start_join, stop_all

from meshd.client.ask import AskRequest, AskResult, Stage, ask_with_failover, route_from_reply
from meshd.daemon import describe_model, rpc
from meshd.mesh.records import ModelInfo, ServedRange
from meshd.net.peers import Peers, open_peers
from tests.conftest import greedy_reference
from wire.errors import ProtocolError
from wire.identity import NodeIdentity
from wire.meshrpc import RouteReply, RouteRequest, StatusReply, StatusRequest

pytestmark = pytest.mark.slow  # three daemons and two engine workers, shared by the module

PROMPT = "Name three colours."
TOKENS = 12
SESSIONS = ["--threads", "1", "--max-sessions", "4", "--session-tokens", "256"]


@dataclass
class Mesh:
    seed: Served
    volunteers: list[Served]
    model: ModelInfo
    expected: list[int]

    @property
    def nodes(self) -> list[Served]:
        return [self.seed, *self.volunteers]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path]) -> Iterator[Mesh]:
    path = tiny_models["llama-gqa-untied"]
    base = tmp_path_factory.mktemp("attacks")
    nodes: list[Served] = []
    try:
        nodes.append(start_join("--no-model", "--state-dir", str(base / "seed"), *SESSIONS))
        for i in range(2):
            # each offers about half the model: the honest route has two stages
            nodes.append(start_join("--seed", nodes[0].address, "--model", str(path), "--memory", "1M",
                                    "--state-dir", str(base / f"v{i}"), *SESSIONS))
        from meshd.stage.service import model_manifest
        digest = model_manifest(path, base / "v0").model_id
        yield Mesh(nodes[0], nodes[1:], describe_model(path, digest), greedy_reference(path, [PROMPT], TOKENS)[PROMPT])
    finally:
        stop_all(nodes)


@pytest.fixture
async def peers() -> AsyncIterator[Peers]:
    async with open_peers(NodeIdentity.generate()) as p:
        yield p


async def status(peers: Peers, node: Served) -> StatusReply:
    reply = await rpc(peers, node.address, StatusRequest(), timeout=20.0)
    assert isinstance(reply, StatusReply)
    return reply


async def honest_route(peers: Peers, mesh: Mesh, via: Served | None = None) -> RouteReply:
    reply = await rpc(peers, (via or mesh.seed).address, RouteRequest(model=mesh.model.digest), timeout=20.0)
    assert isinstance(reply, RouteReply)
    return reply


async def converged(peers: Peers, mesh: Mesh, timeout: float = 60.0) -> StatusReply:
    """Every honest node sees the others alive, follows one honest tracker, and the model is covered."""
    honest = {n.node_id for n in mesh.nodes}
    with trio.fail_after(timeout):
        while True:
            views = [await status(peers, n) for n in mesh.nodes]
            if all({m.node_id for m in v.members if m.state == "alive"} >= honest for v in views) and \
                    len({v.tracker for v in views}) == 1 and views[0].tracker in honest and \
                    all(c.covered_layers == c.n_layers for v in views for c in v.coverage
                        if c.model == mesh.model.digest) and views[0].coverage:
                return views[0]
            await trio.sleep(0.25)


async def honest_ask(peers: Peers, mesh: Mesh) -> list[int]:
    """The honest user's ask, by the model's digest through the seed: the whole model's answer."""
    async def find(excluded: list[str]) -> list[Stage]:
        reply = await rpc(peers, mesh.seed.address, RouteRequest(model=mesh.model.digest, exclude=excluded),
                          timeout=20.0)
        assert isinstance(reply, RouteReply)
        return route_from_reply(reply)

    with trio.fail_after(60):
        result: AskResult = await ask_with_failover(peers, find, AskRequest(
            messages=[{"role": "user", "content": PROMPT}], max_tokens=TOKENS))
    assert result.tokens == mesh.expected
    return result.tokens


async def joined(peers: Peers, mesh: Mesh, bad: AttackerDaemon, timeout: float = 30.0) -> None:
    """Until every honest node holds the attacker as a live member."""
    with trio.fail_after(timeout):
        while True:
            views = [await status(peers, n) for n in mesh.nodes]
            if all(any(m.node_id == bad.mesh.node_id and m.state == "alive" for m in v.members) for v in views):
                return
            await trio.sleep(0.25)


# ----- elections

async def test_a_claim_of_the_last_term_never_takes_the_tracker_and_a_bombed_volunteer_refuses(
        mesh: Mesh, peers: Peers) -> None:
    before = await converged(peers, mesh)
    await honest_ask(peers, mesh)
    async with attacker(mesh.seed.address) as bad:
        # the last term, an uptime since the epoch, and (asked for an assignment) the whole model
        bad.assignment_bomb = (mesh.model.digest, 0, mesh.model.n_layers)
        bad.hijack_election(lambda node: LAST_TERM, started_at=0.0)
        await joined(peers, mesh, bad)
        for _ in range(8):  # a few election timeouts with the claim on every record it gossips
            view = await converged(peers, mesh)
            assert view.tracker == before.tracker and view.term == before.term
            await trio.sleep(0.5)
        assert bad.mesh.record.tracker_term == LAST_TERM
        # nobody asked the hijacker for a range: the volunteers still serve their halves
        view = await status(peers, mesh.seed)
        served = {m.node_id: m.served for m in view.members if m.node_id in {v.node_id for v in mesh.volunteers}}
        assert all(s and f"[0, {mesh.model.n_layers})" not in " ".join(s) for s in served.values()), served
        await honest_ask(peers, mesh)
    # The attacker is gone (no goodbye): the honest tracker stays, and asks keep working.
    view = await converged(peers, mesh)
    assert view.tracker == before.tracker
    await honest_ask(peers, mesh)


# ----- routes

async def test_a_member_declaring_every_layer_at_a_made_up_speed_gets_no_route_from_any_node(
        mesh: Mesh, peers: Peers) -> None:
    await converged(peers, mesh)
    async with attacker(mesh.seed.address) as bad:
        bad.forge(models=[mesh.model], served=every_layer(mesh.model), seconds_per_layer=1e-9)
        await joined(peers, mesh, bad)
        # asked at the tracker or at any other member: only the ranges the tracker placed
        for via in mesh.nodes:
            route = await honest_route(peers, mesh, via)
            assert bad.mesh.node_id not in [s.node_id for s in route.stages], via
            assert {s.node_id for s in route.stages} == {v.node_id for v in mesh.volunteers}
        await honest_ask(peers, mesh)


async def test_a_made_up_digest_named_like_the_real_model_never_takes_an_ask(mesh: Mesh, peers: Peers) -> None:
    await converged(peers, mesh)
    fake = fake_model(mesh.model)
    async with attacker(mesh.seed.address) as bad:
        bad.forge(models=[fake], served=every_layer(fake), seconds_per_layer=1e-9)
        await joined(peers, mesh, bad)
        for request in (RouteRequest(), RouteRequest(model=mesh.model.name)):
            with pytest.raises(ProtocolError) as refused:
                await rpc(peers, mesh.seed.address, request, timeout=20.0)
            assert mesh.model.digest[:16] in str(refused.value) and fake.digest[:16] in str(refused.value)
        asked = await trio.to_thread.run_sync(run_meshd, "ask", "--seed", mesh.volunteers[0].address, "--max-tokens",
                                              "4", PROMPT)
        assert asked.returncode != 0 and len(asked.stderr.strip().splitlines()) == 1, asked.stderr
        assert "--model" in asked.stderr and fake.digest[:12] in asked.stderr
        await honest_ask(peers, mesh)


# ----- gossip

async def test_a_member_spamming_dead_tracker_every_50_ms_never_kills_it_and_the_term_holds(
        mesh: Mesh, peers: Peers) -> None:
    before = await converged(peers, mesh)
    assert before.tracker is not None
    async with attacker(mesh.seed.address) as bad:
        await joined(peers, mesh, bad)
        others = [n for n in mesh.nodes if n.node_id != before.tracker]
        samples: list[str] = []
        async with trio.open_nursery() as nursery:
            until = trio.current_time() + 4.0
            nursery.start_soon(bad.spam_dead, before.tracker, [n.node_id for n in mesh.nodes], 0.05, until)
            while trio.current_time() < until:
                for node in others:
                    view = await status(peers, node)
                    samples += [m.state for m in view.members if m.node_id == before.tracker]
                    assert view.tracker == before.tracker and view.term == before.term
                await trio.sleep(0.05)
        assert len(samples) >= 20 and "dead" not in samples, samples
        await honest_ask(peers, mesh)
    await converged(peers, mesh)


async def test_ten_thousand_planted_members_and_a_record_of_17_ranges_leave_status_working(
        mesh: Mesh, peers: Peers) -> None:
    await converged(peers, mesh)
    fake = fake_model(mesh.model)
    async with attacker(mesh.seed.address) as bad:
        await joined(peers, mesh, bad)
        # more ranges than a status line held before (16; records allow 32), of a model no one else has
        bad.forge(models=[fake], served=[ServedRange(model=fake.digest, start=i, end=i + 1) for i in range(17)])
        # ten thousand, in Syncs of a size the decoder takes whole
        started = trio.current_time()
        for _ in range(5):
            await bad.send_swim_whole(mesh.seed.node_id, await trio.to_thread.run_sync(planted_sync, 2000))
        with trio.fail_after(30):
            while (await status(peers, mesh.seed)).total_members < 100:
                await trio.sleep(0.25)
        for node in mesh.nodes:
            view = await status(peers, node)
            # one sender introduces a burst (1024) and 32 a second after it, not ten thousand
            assert view.total_members <= 4 + 1024 + 32 * (trio.current_time() - started + 1), view.total_members
            shown = await trio.to_thread.run_sync(run_meshd, "status", "--seed", node.address)
            assert shown.returncode == 0, shown.stderr
            assert f"{mesh.model.n_layers}/{mesh.model.n_layers} layers covered" in shown.stdout
        await honest_ask(peers, mesh)
