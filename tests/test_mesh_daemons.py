"""Real `meshd join` daemons on loopback: one seed, five volunteers, one tracker, failover."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio
from localmesh import Served, run_meshd, start_join

from meshd.client.ask import AskRequest, Stage, ask_with_failover, route_from_reply
from meshd.daemon import rpc
from meshd.net.peers import Peers, open_peers
from tests.conftest import greedy_reference
from wire.identity import NodeIdentity
from wire.meshrpc import RouteReply, RouteRequest, StatusReply, StatusRequest

PROMPT = "Write a short story about a lighthouse keeper."
# Small KV budgets and memory, so the default model needs three stages and spare nodes become replicas.
VOLUNTEER = ["--memory", "62M", "--threads", "1", "--max-sessions", "2", "--session-tokens", "512"]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Served]]:
    base = tmp_path_factory.mktemp("mesh")
    nodes: list[Served] = []
    try:
        # the seed keeps its default session budget: placement must use the volunteers'
        nodes.append(start_join("--no-model", "--state-dir", str(base / "seed")))
        for i in range(5):
            nodes.append(start_join("--seed", nodes[0].address, "--state-dir", str(base / f"v{i}"), *VOLUNTEER))
        yield nodes
    finally:
        for n in nodes:
            n.stop()


@pytest.fixture(scope="module")
def expected(default_model: Path) -> list[int]:
    return greedy_reference(default_model, [PROMPT], 128)[PROMPT]


@pytest.fixture
async def peers() -> AsyncIterator[Peers]:
    async with open_peers(NodeIdentity.generate()) as p:
        yield p


async def status(peers: Peers, node: Served) -> StatusReply:
    reply = await rpc(peers, node.address, StatusRequest(), timeout=20.0)
    assert isinstance(reply, StatusReply)
    return reply


async def wait_converged(peers: Peers, nodes: list[Served], timeout: float = 60.0) -> list[StatusReply]:
    """Every node sees every other alive, the same tracker, and the model covered."""
    deadline = trio.current_time() + timeout
    while True:
        views = [await status(peers, n) for n in nodes]
        ids = {n.node_id for n in nodes}
        done = all({m.node_id for m in v.members if m.state == "alive"} >= ids for v in views) and \
            len({v.tracker for v in views}) == 1 and views[0].tracker is not None and \
            all(c.covered_layers == c.n_layers for v in views for c in v.coverage) and views[0].coverage
        if done:
            return views
        if trio.current_time() > deadline:
            raise AssertionError(f"no convergence: {views}")
        await trio.sleep(0.5)


def finder(peers: Peers, via: Served):
    async def find(excluded: list[str]) -> list[Stage]:
        reply = await rpc(peers, via.address, RouteRequest(exclude=excluded), timeout=20.0)
        assert isinstance(reply, RouteReply)
        return route_from_reply(reply)
    return find


async def test_five_volunteers_converge_on_one_tracker_and_answer_like_the_whole_model(
        mesh: list[Served], peers: Peers, expected: list[int]) -> None:
    t0 = time.perf_counter()
    views = await wait_converged(peers, mesh)
    print(f"converged in {time.perf_counter() - t0:.1f} s; tracker {views[0].tracker[:12]}; "
          f"stages {views[0].coverage[0].assigned}")
    result = await ask_with_failover(peers, finder(peers, mesh[0]), AskRequest(
        messages=[{"role": "user", "content": PROMPT}], max_tokens=128))
    assert result.tokens == expected
    shown = run_meshd("status", "--seed", mesh[2].address)
    assert shown.returncode == 0, shown.stderr
    assert "30/30 layers covered" in shown.stdout and "tracker" in shown.stdout
    assert sum(1 for n in mesh if n.node_id[:16] in shown.stdout) == len(mesh)
    asked = run_meshd("ask", "--seed", mesh[0].address, "--max-tokens", "128", PROMPT)
    assert asked.returncode == 0, asked.stderr


async def test_killing_a_middle_stage_mid_answer_gives_the_same_answer(
        mesh: list[Served], peers: Peers, expected: list[int]) -> None:
    find = finder(peers, mesh[0])
    # spare nodes load their replicas after the first cover is up
    with trio.fail_after(60):
        while True:
            views = await wait_converged(peers, mesh)
            route = await find([])
            assigned = [a.split(" ", 1)[1] for a in views[0].coverage[0].assigned]
            replicated = [s for s in route[1:-1] if assigned.count(f"[{s.layers[0]}, {s.layers[1]})") > 1]
            if replicated:
                break
            await trio.sleep(0.5)
    assert len(route) >= 3, f"expected a route of three or more stages, got {[s.layers for s in route]}"
    victim_stage = replicated[0]
    victim = next(n for n in mesh if n.node_id == victim_stage.node_id)
    t0 = time.perf_counter()
    undisturbed = await ask_with_failover(peers, find, AskRequest(messages=[{"role": "user", "content": PROMPT}],
                                                                   max_tokens=128))
    base = time.perf_counter() - t0

    result_tokens: list[int] = []
    killed_box: list[float] = []

    def on_token(token: int, piece: bytes) -> None:
        result_tokens.append(token)
        if not killed_box and len(result_tokens) == 20:
            os.kill(victim.proc.pid, signal.SIGKILL)
            killed_box.append(time.perf_counter())

    t0 = time.perf_counter()
    result = await ask_with_failover(peers, find, AskRequest(messages=[{"role": "user", "content": PROMPT}],
                                                             max_tokens=128), on_token)
    disturbed = time.perf_counter() - t0
    assert killed_box, "the stage was never killed"
    assert result.epochs >= 2
    assert result.tokens == undisturbed.tokens == expected
    print(f"answer of {len(result.tokens)} tokens: {base:.2f} s undisturbed, {disturbed:.2f} s with the middle "
          f"stage killed after 20 tokens: {disturbed - base:.2f} s extra over {result.epochs} epochs")


async def test_killing_the_tracker_elects_a_new_one_and_asks_keep_working(
        mesh: list[Served], peers: Peers, expected: list[int]) -> None:
    alive = [n for n in mesh if n.proc.poll() is None]
    views = await wait_converged(peers, alive)
    tracker = next(n for n in alive if n.node_id == views[0].tracker)
    os.kill(tracker.proc.pid, signal.SIGKILL)
    killed_at = time.perf_counter()
    rest = [n for n in alive if n is not tracker]
    with trio.fail_after(60):
        while True:
            views = [await status(peers, n) for n in rest]
            trackers = {v.tracker for v in views}
            if len(trackers) == 1 and None not in trackers and tracker.node_id not in trackers:
                break
            await trio.sleep(0.2)
    print(f"new tracker {views[0].tracker[:12]} (term {views[0].term}) agreed "
          f"{time.perf_counter() - killed_at:.2f} s after SIGKILL of the old one")
    result = await ask_with_failover(peers, finder(peers, rest[0]), AskRequest(
        messages=[{"role": "user", "content": PROMPT}], max_tokens=128))
    assert result.tokens == expected
