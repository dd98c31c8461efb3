"""Real `meshd join` daemons on loopback: one seed, five volunteers, one tracker, its death, a rebalance.

A stage killed mid-answer is test_failover_mesh's (every stage of a route at once, real daemons) and
test_spec_ring's (a middle stage of the default model, mid speculative answer)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from localmesh import Served, mesh_status, run_meshd, start_join, stop_all

from meshd.client.ask import AskRequest
from meshd.client.chat import ChatRequest
from meshd.client.failover import ask_with_failover
from meshd.client.route import Stage, route_from_reply
from meshd.net.peers import Peers
from meshd.net.rpc import mesh_rpc
from tests.conftest import greedy_chat_reference, greedy_reference
from wire.meshrpc import RouteReply, RouteRequest, StatusReply

pytestmark = pytest.mark.slow  # six daemons and their workers

PROMPT = "Write a short story about a lighthouse keeper."
# an answer's length is not what these tests show: enough tokens to cross every stage many times
TOKENS = 32
# Small KV budgets and memory, so the default model needs three stages and spare nodes become replicas.
SESSIONS = ["--threads", "1", "--max-sessions", "2", "--session-tokens", "512"]
VOLUNTEER = ["--memory", "62M", *SESSIONS]


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
        stop_all(nodes)


@pytest.fixture(scope="module")
def expected(default_model: Path) -> list[int]:
    return greedy_reference(default_model, [PROMPT], TOKENS)[PROMPT]


async def wait_converged(peers: Peers, nodes: list[Served], timeout: float = 60.0) -> list[StatusReply]:
    """Every node sees every other alive, the same tracker, and the model covered."""
    deadline = trio.current_time() + timeout
    while True:
        views = [await mesh_status(peers, n) for n in nodes]
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
        reply = await mesh_rpc(peers, via.address, RouteRequest(exclude=excluded), timeout=20.0)
        assert isinstance(reply, RouteReply)
        return route_from_reply(reply)
    return find


async def test_five_volunteers_converge_on_one_tracker_and_answer_like_the_whole_model(
        mesh: list[Served], peers: Peers, default_model: Path) -> None:
    t0 = time.perf_counter()
    views = await wait_converged(peers, mesh)
    print(f"converged in {time.perf_counter() - t0:.1f} s; tracker {views[0].tracker[:12]}; "
          f"stages {views[0].coverage[0].assigned}")
    # a chat rendered on the model's own template, as `meshd ask` and the HTTP API render it
    result = await ask_with_failover(peers, finder(peers, mesh[0]), AskRequest(
        chat=ChatRequest(messages=[{"role": "user", "content": PROMPT}]), max_tokens=TOKENS))
    assert result.tokens == greedy_chat_reference(default_model, [PROMPT], TOKENS)[PROMPT]
    shown = run_meshd("status", "--seed", mesh[2].address)
    assert shown.returncode == 0, shown.stderr
    assert "30/30 layers covered" in shown.stdout and "tracker" in shown.stdout
    assert sum(1 for n in mesh if n.node_id[:16] in shown.stdout) == len(mesh)
    asked = run_meshd("ask", "--seed", mesh[0].address, "--max-tokens", str(TOKENS), PROMPT)
    assert asked.returncode == 0, asked.stderr
    # the CLI prints the whole model's answer (the same tokens as the asker's above), then one line of figures
    assert asked.stdout == result.text + "\n"
    assert [line.startswith("[") and "first token" in line for line in asked.stderr.splitlines()] == [True]


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
            views = [await mesh_status(peers, n) for n in rest]
            trackers = {v.tracker for v in views}
            if len(trackers) == 1 and None not in trackers and tracker.node_id not in trackers:
                break
            await trio.sleep(0.2)
    print(f"new tracker {views[0].tracker[:12]} (term {views[0].term}) agreed "
          f"{time.perf_counter() - killed_at:.2f} s after SIGKILL of the old one")
    result = await ask_with_failover(peers, finder(peers, rest[0]), AskRequest(
        messages=[{"role": "user", "content": PROMPT}], max_tokens=TOKENS))
    assert result.tokens == expected


def workers(node: Served) -> list[int]:
    """The engine workers the daemon runs now: one per range it serves or still retires."""
    # a child is listed under the thread that started it, which need not be the main one
    tasks = Path(f"/proc/{node.proc.pid}/task").iterdir()
    return sorted(int(pid) for task in tasks for pid in (task / "children").read_text().split())


async def served_ranges(peers: Peers, node: Served) -> dict[str, list[str]]:
    view = await mesh_status(peers, node)
    return {m.node_id: [s.split(" ", 1)[1] for s in m.served] for m in view.members if m.state == "alive"}


async def test_a_volunteer_whose_worker_dies_stops_offering_its_range_until_the_worker_is_back(
        mesh: list[Served], peers: Peers) -> None:
    alive = [n for n in mesh if n.proc.poll() is None]
    await wait_converged(peers, alive)
    with trio.fail_after(60):
        while True:
            # one range, one worker: a range the last placement moved keeps its worker until its sessions end
            view = await served_ranges(peers, alive[0])
            victim = next((n for n in alive if len(view.get(n.node_id, [])) == 1 and len(workers(n)) == 1), None)
            if victim is not None:
                break
            await trio.sleep(0.2)
    before = (await served_ranges(peers, victim))[victim.node_id]
    (worker,) = workers(victim)
    os.kill(worker, signal.SIGKILL)
    seen = []
    with trio.fail_after(60):
        while not seen or seen[-1] != before or [] not in seen:
            seen.append((await served_ranges(peers, victim))[victim.node_id])
            await trio.sleep(0.05)
    # withdrawn while the supervisor restarted the worker, offered again once it was back
    assert [] in seen and seen[-1] == before and workers(victim) != [worker]


@pytest.mark.slow
async def test_a_volunteer_joining_mid_answer_moves_every_range_and_the_answer_is_unchanged(
        tmp_path: Path, peers: Peers, expected: list[int]) -> None:
    """Three 62M volunteers split the model three ways; after the first token a volunteer that holds
    it whole joins, and the tracker's fresh placement moves all three (the newcomer takes the whole
    model, the three regroup as a replica). The session keeps its old ranges to the end.

    So that the rebalance lands while tokens are still to come, whatever the speed of this machine,
    the tail's engine worker is held (SIGSTOP) until it has landed, let go for a moment every few
    seconds so that it answers its health checks (10 s) and is not taken for hung."""
    tokens = 24  # of the TOKENS of `expected`
    nodes: list[Served] = []
    held: list[int] = []
    try:
        nodes.append(start_join("--no-model", "--state-dir", str(tmp_path / "seed")))
        for i in range(3):
            nodes.append(start_join("--seed", nodes[0].address, "--state-dir", str(tmp_path / f"v{i}"), *VOLUNTEER))
        await wait_converged(peers, nodes, timeout=90)
        route = await finder(peers, nodes[0])([])
        assert len(route) == 3, "three 62M volunteers should need three stages"
        assert all(s.node_id is not None and s.layers is not None for s in route)
        ranges = {s.node_id: f"[{s.layers[0]}, {s.layers[1]})" for s in route if s.layers is not None}
        tail = next(n for n in nodes if n.node_id == route[-1].node_id)
        seen: list[int] = []
        moved: dict[str, list[str]] = {}
        landed_at: list[int] = []
        landed = trio.Event()

        async def hold_the_tail() -> None:
            (worker,) = workers(tail)
            held.append(worker)
            while not landed.is_set():
                os.kill(worker, signal.SIGSTOP)
                with trio.move_on_after(4.0):
                    await landed.wait()
                os.kill(worker, signal.SIGCONT)
                await trio.sleep(0.2)

        async def rebalance() -> None:
            nursery.start_soon(hold_the_tail)
            joiner = await trio.to_thread.run_sync(lambda: start_join(
                "--seed", nodes[0].address, "--state-dir", str(tmp_path / "joiner"), "--memory", "400M", *SESSIONS))
            nodes.append(joiner)
            with trio.fail_after(120):
                while True:
                    now_served = await served_ranges(peers, nodes[0])
                    moved.update({n: now_served[n] for n in ranges if now_served.get(n, [ranges[n]]) != [ranges[n]]})
                    if len(moved) == len(ranges) and now_served.get(joiner.node_id) == ["[0, 30)"]:
                        break
                    await trio.sleep(0.5)
            # what the tail had sent has arrived by now; the rest is still to be generated
            await trio.sleep(1.0)
            landed_at.append(len(seen))
            landed.set()

        def on_token(token: int, piece: bytes) -> None:
            seen.append(token)
            if len(seen) == 1:
                nursery.start_soon(rebalance)

        async with trio.open_nursery() as nursery:
            with trio.fail_after(300):
                result = await ask_with_failover(peers, finder(peers, nodes[0]), AskRequest(
                    messages=[{"role": "user", "content": PROMPT}], max_tokens=tokens), on_token, stall_timeout=120)
        # every stage of the session moved to a new range while the session still had tokens to give
        assert set(moved) == set(ranges) and landed_at and landed_at[0] < tokens
        assert result.tokens == expected[:tokens]
        assert result.epochs == 1, "the rebalance broke the session: it had to fail over"
        print(f"\nrebalance landed after {landed_at[0]} of {tokens} tokens; moved {moved}")
        # the old ranges go once their last session is gone, not at the retiring deadline (60 s)
        with trio.fail_after(30):
            while any(len(workers(n)) != 1 for n in nodes[1:4]):
                await trio.sleep(0.2)
        again = await ask_with_failover(peers, finder(peers, nodes[0]), AskRequest(
            messages=[{"role": "user", "content": PROMPT}], max_tokens=tokens))
        assert again.tokens == expected[:tokens]
    finally:
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        stop_all(nodes)
