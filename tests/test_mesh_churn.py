"""Real `meshd join` daemons on loopback under churn while asks run (issue 32, defects 9 and 10): joins and
leaves move only the ranges the departures force, a member back within the grace gets its range back, and
no departed member is left in status or routes.

Four alike 62M volunteers cut the default model in three segments (one with a replica). Then, asks
running all along: a fifth joins (it replicates a segment with none: no move), one of a replicated pair
leaves (no move: no segment has three hosts to give one up), it comes back with its identity within the
grace (its range again, no move), and the sole host of a segment is SIGKILLed (one move: a replica takes
its range; today's code re-cut every range there). So the test allows one move in all."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import trio
from localmesh import Served, mesh_status, start_join, stop_all
from test_mesh_daemons import SESSIONS, finder

from meshd.client.ask import AskRequest
from meshd.client.failover import ask_with_failover
from meshd.net.peers import Peers
from wire.errors import ProtocolError

pytestmark = pytest.mark.slow  # six daemons and their workers

VOLUNTEER = ["--memory", "62M", *SESSIONS]
# SWIM's detection of a SIGKILLed member here: probe timeouts and a suspicion of 4-6 x log10(N) probe
# periods (4 to 5 s with six members, less as accusers confirm it). A departed member must be out of
# every status within GHOST_BOUND of that confirmation, so within both of a SIGKILL.
DETECTION = 10.0
GHOST_BOUND = 10.0
# The ranges the steps' departures force to move (the sole host's range, taken by a replica).
FORCED_MOVES = 1


async def test_joins_and_leaves_while_asks_run_move_only_forced_ranges_and_leave_no_ghost(
        tmp_path: Path, peers: Peers) -> None:
    started = time.perf_counter()
    nodes: list[Served] = []
    try:
        seed = start_join("--no-model", "--state-dir", str(tmp_path / "seed"))
        nodes.append(seed)

        names: dict[str, str] = {}  # node id: its state directory's name

        def volunteer(name: str) -> Served:
            node = start_join("--seed", seed.address, "--state-dir", str(tmp_path / name), *VOLUNTEER)
            nodes.append(node)
            names[node.node_id] = name
            return node

        for i in range(4):
            volunteer(f"v{i}")
        history: dict[str, list[str]] = {}  # node id: the distinct ranges it served, in order

        async def settled(members: list[Served], timeout: float = 40.0) -> dict[str, str]:
            """Every volunteer of `members` serves a range, the model is covered, and no one else is listed."""
            ids = {n.node_id for n in members}
            with trio.fail_after(timeout):
                while True:
                    view = await mesh_status(peers, seed)
                    now = {m.node_id: m.served[0].split(" ", 1)[1] for m in view.members if m.served}
                    for node_id, rng in now.items():
                        if not history.get(node_id) or history[node_id][-1] != rng:
                            history.setdefault(node_id, []).append(rng)
                    if {m.node_id for m in view.members} == ids and set(now) == ids - {seed.node_id} and \
                            view.coverage and all(c.covered_layers == c.n_layers for c in view.coverage):
                        return now
                    await trio.sleep(0.3)

        async def no_ghost(departed: Served, live: list[Served], since: float, bound: float) -> float:
            """Seconds after `since` until no live member lists `departed` nor routes through it."""
            with trio.fail_after(bound):
                while True:
                    views = [await mesh_status(peers, n) for n in live]
                    try:
                        route = {s.node_id for s in await finder(peers, seed)([])}
                    except ProtocolError:  # no route while a range is placed anew: asked again
                        route = {departed.node_id}
                    if all(departed.node_id not in {m.node_id for m in v.members} for v in views) and \
                            departed.node_id not in route:
                        return time.perf_counter() - since
                    await trio.sleep(0.2)

        first = await settled(nodes)
        assert sorted(list(first.values()).count(r) for r in set(first.values())) == [1, 1, 2]
        answers: list[list[int]] = []
        # Asks the churn failed, with the error the asker saw: the load here, not what this test
        # judges (an ask routed to a member that came back with its identity can fail: issue 32's notes).
        failed: list[str] = []
        asking = True

        async def ask_all_along() -> None:
            while asking:
                try:
                    result = await ask_with_failover(peers, finder(peers, seed), AskRequest(
                        messages=[{"role": "user", "content": "Name three colours."}], max_tokens=8))
                except ProtocolError as exc:
                    failed.append(exc.message)
                    await trio.sleep(0.5)
                else:
                    answers.append(result.tokens)
                    # at a user's pace, not back to back: each ask's stages compete with the churn for the CPU
                    await trio.sleep(1.0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask_all_along)
            # 1. a fifth volunteer joins: it replicates the segment with none
            fifth = await trio.to_thread.run_sync(volunteer, "v4")
            now = await settled(nodes)
            assert sorted(list(now.values()).count(r) for r in set(now.values())) == [1, 2, 2]
            # 2. one of a replicated pair leaves (Ctrl-C's graceful leave): gone from status at once
            pairs = [n for n in nodes[1:] if list(now.values()).count(now[n.node_id]) == 2]
            leaver = pairs[-1]
            had = now[leaver.node_id]
            left_at = time.perf_counter()
            await trio.to_thread.run_sync(leaver.stop)
            nodes.remove(leaver)
            print(f"\nleaver out of status and routes {await no_ghost(leaver, nodes, left_at, GHOST_BOUND):.1f} s "
                  "after its SIGTERM")
            await settled(nodes)
            # 3. it comes back with its identity (its state directory) within the grace: its range again
            back = await trio.to_thread.run_sync(volunteer, names[leaver.node_id])
            assert back.node_id == leaver.node_id
            now = await settled(nodes)
            assert now[back.node_id] == had
            # 4. the sole host of a segment is SIGKILLed: a replica takes its range, within bound of no ghost
            (lone,) = [n for n in nodes[1:] if list(now.values()).count(now[n.node_id]) == 1]
            killed_at = time.perf_counter()
            os.kill(lone.proc.pid, signal.SIGKILL)
            nodes.remove(lone)
            took = await no_ghost(lone, nodes, killed_at, DETECTION + GHOST_BOUND)
            print(f"SIGKILLed member out of status and routes {took:.1f} s after the kill")
            await settled(nodes)
            asking = False
        settled_answer = await ask_with_failover(peers, finder(peers, seed), AskRequest(
            messages=[{"role": "user", "content": "Name three colours."}], max_tokens=8))
        # every range a member that stayed throughout served: changes beyond its first are moves
        stayed = [n.node_id for n in nodes[1:] if n is not fifth and n is not back]
        moves = sum(len(history[node_id]) - 1 for node_id in stayed)
        print(f"{len(answers)} asks answered, {len(failed)} failed {failed[:3]}; moves {moves}; history {history}; "
              f"{time.perf_counter() - started:.0f} s in all")
        assert moves <= FORCED_MOVES
        # greedy: the same answer whatever the churn, and the settled mesh answers
        assert answers and all(a == settled_answer.tokens for a in answers)
    finally:
        stop_all(nodes)
