"""Routes by what real asks saw (meshd.mesh.traffic), against real `meshd join` daemons on loopback.

The attackers: a volunteer fast for the tracker's probes and slow for every user (its engine
worker's fast path sleeps before each batch: tools/slow_worker.py; the probes are check sessions on
the daemons' path, which it runs at full speed), the same volunteer signing its spans as taking no
time, and a placed member sending the tracker report after report that an honest stage is slow.
Real asks through the tracker's member take the first two off the routes (the first's honest
neighbour keeps its figure: each stage's receipts sign its own time); the third moves nothing.
"""

from __future__ import annotations

import re
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from attackers import attacker
from localmesh import Launched, Served, launch_meshd, mesh_status, run_meshd, start_join, stop_started
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
    placed_liar,
)

from meshd.mesh.routing import TRAFFIC_RATIO
from meshd.net.peers import Peers, PeersConfig, open_peers
from meshd.net.rpc import mesh_rpc
from meshd.stage.model_file import describe_model, model_manifest
from tests.conftest import greedy_reference
from wire.identity import NodeIdentity
from wire.meshrpc import StageSpeed, StatusReply, TimedStage, TrafficReport, TrafficTaken

pytestmark = pytest.mark.slow  # four volunteers and a seed, real engine workers

SLOW_WORKER = Path(__file__).resolve().parent.parent / "tools" / "slow_worker.py"
# what the slow stage sleeps before each of a user's steps: a token takes it 40 times an honest stage's
SLEEP = 0.2


async def speeds(peers: Peers, node: Served, model: str) -> dict[str, StageSpeed]:
    """The stage speeds the tracker counts, asked of `node`, by node id."""
    return {s.node_id: s for s in (await mesh_status(peers, node)).speeds if s.model == model}


async def route_nodes(peers: Peers, mesh: Mesh, via: Served | None = None) -> list[str]:
    return [s.node_id for s in (await honest_route(peers, mesh, via)).stages]


async def route_ranges(peers: Peers, mesh: Mesh, via: Served | None = None) -> list[tuple[str, int, int]]:
    return [(s.node_id, s.start, s.end) for s in (await honest_route(peers, mesh, via)).stages]


@dataclass
class SlowBeside:
    """A slow stage beside an honest one (each half the model), once real asks through the tracker's own
    member have timed it: its figures then, and the asker's seconds per token (its figures line's)."""

    peers: Peers
    mesh: Mesh
    honest: Served
    slow: Served
    probed: float
    figures: dict[str, StageSpeed]
    seconds_per_token: list[float]
    tracker_state: Path


@asynccontextmanager
async def slow_beside_honest(tmp_path: Path, path: Path, role: str) -> AsyncIterator[SlowBeside]:
    """`role`: tools/slow_worker.py's, "daemon" (its receipts sign the time it took) or "liar" (0 µs)."""
    nodes: list[Served] = []
    launched: list[Launched] = []
    try:
        # (the honest daemons' elections as test_attacks' mesh times them: a fresh mesh settles sooner)
        nodes.append(seed := start_join("--no-model", "--state-dir", str(tmp_path / "seed"), *SESSIONS, *ELECTION))
        volunteer = ["--seed", seed.address, "--model", str(path), "--memory", "1M", *SESSIONS, *ELECTION]
        # the two volunteers start side by side
        launched = [launch_meshd("join", *volunteer, "--state-dir", str(tmp_path / "honest")),
                    launch_meshd("join", *volunteer, "--state-dir", str(tmp_path / "slow"),
                                 program=[sys.executable, str(SLOW_WORKER), role, str(SLEEP)])]
        for one in launched:
            nodes.append(one.ready())
        honest, slow = nodes[1:]
        digest = model_manifest(path, tmp_path / "honest").model_id
        mesh = Mesh(seed, [honest, slow], describe_model(path, digest), greedy_reference(path, [PROMPT], TOKENS)[PROMPT])
        async with open_peers(NodeIdentity.generate(), PeersConfig()) as peers:
            view = await converged(peers, mesh)
            assert view.tracker != slow.node_id
            tracker_state = tmp_path / {seed.node_id: "seed", honest.node_id: "honest"}[view.tracker]
            # the two volunteers split the model, and the tracker times both (the slow one as fast: its probes are)
            assert slow.node_id in await route_nodes(peers, mesh)
            figures = await probed_all(peers, mesh, lambda status: True)
            probed = figures[slow.node_id].seconds_per_layer
            # real asks, through the tracker's own member: each reports what it saw of the route
            waited = []
            for _ in range(2):
                asked = await trio.to_thread.run_sync(lambda: run_meshd(
                    "ask", "--state-dir", str(tracker_state), "--max-tokens", str(TOKENS), PROMPT))
                assert asked.returncode == 0, asked.stderr
                rate = re.search(r"([0-9.]+) tokens/s", asked.stderr)
                assert rate is not None, asked.stderr
                waited.append(1.0 / float(rate.group(1)))
            # two honest replicas join, one a range, and the tracker times them
            launched = [launch_meshd("join", *volunteer, "--state-dir", str(tmp_path / name)) for name in ("r1", "r2")]
            for one in launched:
                nodes.append(replica := one.ready())
                mesh.volunteers.append(replica)
            await probed_all(peers, mesh, lambda status: any(c.replicas >= 2 for c in status.coverage))
            # no route goes through it, asked at any member, and the answer is the whole model's
            for via in mesh.nodes:
                assert slow.node_id not in await route_nodes(peers, mesh, via), via
            await honest_ask(peers, mesh)
            yield SlowBeside(peers, mesh, honest, slow, probed, await speeds(peers, seed, mesh.model.digest), waited,
                             tracker_state)
    finally:
        stop_started(nodes, launched)


async def probed_all(peers: Peers, mesh: Mesh, covered: Callable[[StatusReply], bool]) -> dict[str, StageSpeed]:
    """The tracker's figures once it has one of every volunteer (probed, or traffic where asks charged it)
    and the coverage is as `covered` wants it."""
    with trio.fail_after(90):
        while True:
            figures = await speeds(peers, mesh.seed, mesh.model.digest)
            if all(v.node_id in figures and figures[v.node_id].source in ("probe", "own", "traffic")
                   for v in mesh.volunteers) and covered(await mesh_status(peers, mesh.seed)):
                return figures
            await trio.sleep(0.5)


def charged(figure: StageSpeed) -> float:
    """A stage's figure as seconds per token of its range."""
    return figure.seconds_per_layer * (figure.end - figure.start)


async def test_a_stage_fast_for_probes_and_slow_for_users_loses_the_route_and_its_honest_neighbour_keeps_its_figure(
        tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    async with slow_beside_honest(tmp_path, tiny_models["llama-gqa-untied"], "daemon") as seen:
        figures, slow, honest = seen.figures, seen.slow.node_id, seen.honest.node_id
        # counted at about what users wait (its sleep a step, which its receipts sign; a step may sample more
        # than one token where prompt lookup's drafts hold), whatever its probes say
        assert figures[slow].source == "traffic", figures[slow]
        # (past what routes need of it, however loaded this box makes the probes)
        assert charged(figures[slow]) >= SLEEP / 2
        assert charged(figures[slow]) > TRAFFIC_RATIO * seen.probed * (figures[slow].end - figures[slow].start)
        # the honest stage on the same slow route is charged its own time alone, none of the slow one's wait (the
        # route's time alone, without the stages' signed times, charged it that wait: 155 ms a token here).
        # Its figure stays its probe's, or where it is the tracker (which counts itself at its own word, an
        # engine's time without a hop's) its time on real steps, a fraction of a millisecond a token on a quiet
        # box: bounded at a tenth of the slow stage's sleep (20 ms), which a loaded box's steps stay under and
        # the slow one's wait (155 ms) does not
        assert figures[honest].source in ("probe", "own") or charged(figures[honest]) < SLEEP / 10, figures[honest]
        # the stages the asks then took are charged their own time alone, nothing of the slow one's
        asked = await trio.to_thread.run_sync(lambda: run_meshd(
            "ask", "--state-dir", str(seen.tracker_state), "--max-tokens", str(TOKENS), PROMPT))
        assert asked.returncode == 0, asked.stderr
        figures = await speeds(seen.peers, seen.mesh.seed, seen.mesh.model.digest)
        for node_id in [*await route_nodes(seen.peers, seen.mesh), honest]:
            assert figures[node_id].source in ("probe", "own") or charged(figures[node_id]) < SLEEP / 10, \
                figures[node_id]
        # `meshd status` says where the figure came from
        shown = await trio.to_thread.run_sync(run_meshd, "status", "--seed", seen.mesh.seed.address)
        assert shown.returncode == 0, shown.stderr
        text = " ".join(shown.stdout.split())
        assert "traffic seen by askers, the tracker's own asks" in text, shown.stdout


async def test_a_slow_stage_that_signs_its_spans_as_taking_no_time_still_loses_the_route(
        tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    async with slow_beside_honest(tmp_path, tiny_models["llama-gqa-untied"], "liar") as seen:
        figures, slow, honest = seen.figures, seen.slow.node_id, seen.honest.node_id
        # what it hid is what the asker waited past every stage's word: charged to it all the same
        assert figures[slow].source == "traffic", figures[slow]
        assert charged(figures[slow]) >= SLEEP / 2
        # its honest neighbour may be charged that too (one ask cannot say which of the two hid it), but
        # never more than the asker waited for a token
        assert charged(figures[honest]) <= max(seen.seconds_per_token) * 1.05, (figures[honest], seen.seconds_per_token)


async def test_a_placed_member_reporting_an_honest_stage_slow_again_and_again_moves_no_route(
        tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    with honest_mesh(tmp_path, tiny_models["llama-gqa-untied"], flags=ELECTION) as mesh:
        async with open_peers(NodeIdentity.generate(), PeersConfig()) as peers:
            view = await converged(peers, mesh)
            tracker = next(n for n in mesh.nodes if n.node_id == view.tracker)
            async with attacker(mesh.seed.address) as bad:
                await placed_liar(peers, mesh, bad, tracker)  # placed: its word has weight
                with trio.fail_after(60):
                    while (before := await route_ranges(peers, mesh)) != await route_ranges(peers, mesh):
                        await trio.sleep(1.0)  # the placement that took it in has settled
                lie = TrafficReport(model=mesh.model.digest, tokens=TOKENS, seconds_per_token=100.0,
                                    stages=[TimedStage(node_id=n, start=a, end=b) for n, a, b in before])
                taken = []
                for _ in range(40):
                    reply = await mesh_rpc(bad.peers, tracker.address, lie, tracker.node_id, 20.0)
                    assert isinstance(reply, TrafficTaken)
                    taken.append(reply)
                # counted (it is placed) until its rate runs out, and then refused
                assert taken[0].taken and not taken[-1].taken and "rate" in taken[-1].reason
                figures = await speeds(peers, mesh.seed, mesh.model.digest)
                assert all(figures[n].source in ("probe", "own") for n, _, _ in before), figures
                for via in mesh.nodes:
                    assert await route_ranges(peers, mesh, via) == before
                await honest_ask(peers, mesh)
