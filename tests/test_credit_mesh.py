"""The credit ledger on real daemons (issue 33): an ask's stages are countersigned by the member that
asked, the stage keeps the summary, both ledgers agree, and `meshd credits` shows who earned what."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from localmesh import Launched, Served, launch_meshd, meshd_command, run_meshd, spawn, start_join, stop_all, stop_started

from meshd.client.ledger import STANDING_EVERY
from meshd.net.control import control_request
from meshd.net.peers import PeersConfig, open_peers
from meshd.net.rpc import mesh_rpc
from tests.credit_helpers import served as served_summary
from wire.credit import CreditsReply, CreditsRequest, WorkGive, WorkSummary, WorkTaken
from wire.identity import NodeIdentity

pytestmark = pytest.mark.slow  # real daemons and engine workers

# Every daemon works its ledger's credit out every 2 s, not the product's STANDING_EVERY (10 s): the loops
# that wait for a standing to show what the ledger holds wait seconds (what is worked out is the same).
STANDING = ["--standing-every", "2"]
VOLUNTEER = ["--memory", "256M", "--max-sessions", "2", "--session-tokens", "256", "--threads", "1", *STANDING]
SETTLE_S = 120.0


def credits(state: Path) -> dict[str, Any]:
    done = run_meshd("credits", "--state-dir", str(state), "--json")
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


async def ledger(state: Path) -> dict[str, Any]:
    """What `credits(state)` gives, asked from this process: for the loops that look every second or so, as
    a `meshd credits` process each time costs a second of CPU. Its fields are the command's."""
    reply = await control_request(state, CreditsRequest(), timeout=20.0)
    assert isinstance(reply, CreditsReply) and len(reply.members) == reply.total_members  # one page: a few members
    return {"node": reply.node_id, "own": reply.own.model_dump(), "summaries": reply.summaries,
            "root": reply.root.hex(), "members": [m.model_dump() for m in reply.members]}


def test_asks_between_two_volunteers_are_countersigned_kept_by_both_and_earn_the_serving_one_credit(
        default_model: Path, tmp_path: Path) -> None:
    states = [tmp_path / "a", tmp_path / "b"]
    nodes: list[Served] = []
    try:
        nodes.append(start_join("--state-dir", str(states[0]), "--model", str(default_model), *VOLUNTEER))
        nodes.append(start_join("--seed", nodes[0].address, "--state-dir", str(states[1]), "--model",
                                str(default_model), *VOLUNTEER))
        # each asks through its own daemon; a route through the asker itself earns nothing (a stage does
        # not countersign itself), so whichever node the routes go to earns from the other's asks
        deadline = time.monotonic() + SETTLE_S
        for state in states * 3:
            while True:
                done = run_meshd("ask", "--state-dir", str(state), "--max-tokens", "8", "--wait", "60", "Hi")
                if done.returncode == 0 or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
            assert done.returncode == 0, done.stderr
        ids = [n.node_id for n in nodes]

        def agree(docs: list[dict[str, Any]]) -> bool:
            """The same ledger on both, and the same standing worked out of it (each reckons every 2 s)."""
            if docs[0]["root"] != docs[1]["root"] or not docs[0]["summaries"]:
                return False
            for me, other in ((0, 1), (1, 0)):
                rows = [m for m in docs[me]["members"] if m["node_id"] == ids[other]]
                if not rows or rows[0]["earned"] != pytest.approx(docs[other]["own"]["earned"], rel=1e-3):
                    return False
            return True

        deadline = time.monotonic() + 30.0
        while not agree(docs := [trio.run(ledger, s) for s in states]):
            assert time.monotonic() < deadline, docs
            time.sleep(1.0)
        # as `meshd credits --json` shows them: polled too, as each node reckons on its own clock every 2 s and
        # the two commands ask a second or two apart (one of them read the other's standing before a reckoning)
        deadline = time.monotonic() + 30.0
        while not agree(docs := [credits(s) for s in states]):
            assert time.monotonic() < deadline, docs
            time.sleep(1.0)
        assert [d["node"] for d in docs] == ids
        earned = [d["own"]["earned"] for d in docs]
        # 6 asks of 8 new tokens over the whole model (30 layers): some of them through the other node
        assert max(earned) >= 30 * 8 * 0.5, docs
        # each sees the other placed
        assert all(m["placed"] for d in docs for m in d["members"]), docs
        table = run_meshd("credits", "--state-dir", str(states[0]))
        assert table.returncode == 0 and "balance" in table.stdout and ids[1][:16] in table.stdout, table.stdout
        # any member's ledger, asked over the mesh as `meshd status --seed` asks
        remote = run_meshd("credits", "--seed", nodes[1].address, "--json")
        assert remote.returncode == 0, remote.stderr
        assert (json.loads(remote.stdout)["node"], json.loads(remote.stdout)["root"]) == (ids[1], docs[1]["root"])
    finally:
        stop_all(nodes)


def _give(address: str, summaries: list[WorkSummary]) -> WorkTaken:
    """Hands `summaries` to the member at `address` from an identity of the test's own."""
    async def give() -> WorkTaken:
        async with open_peers(NodeIdentity.generate(), PeersConfig()) as peers:
            reply = await mesh_rpc(peers, address, WorkGive(summaries=summaries), timeout=10.0)
        assert isinstance(reply, WorkTaken)
        return reply

    return trio.run(give)


def test_a_server_with_credit_takes_a_one_slot_stage_from_one_without_and_forgeries_and_rings_earn_nothing(
        default_model: Path, tiny_draft_model: Path, tmp_path: Path) -> None:
    states = {name: tmp_path / name for name in ("stage", "server", "newcomer")}
    nodes: list[Served] = []
    launched: list[Launched] = []
    try:
        # the stage serves the default model with one slot; the server volunteers another (tiny) model
        stage = start_join("--state-dir", str(states["stage"]), "--model", str(default_model), "--memory", "256M",
                           "--max-sessions", "1", "--session-tokens", "2048", "--threads", "1", *STANDING)
        nodes.append(stage)
        # the other two start side by side
        launched = [launch_meshd("join", "--seed", stage.address, "--state-dir", str(states["server"]), "--model",
                                 str(tiny_draft_model), *VOLUNTEER),
                    launch_meshd("join", "--seed", stage.address, "--state-dir", str(states["newcomer"]), "--no-model",
                                 *STANDING)]
        for one in launched:
            nodes.append(one.ready())
        server, newcomer = nodes[1:]
        # the stage's member asks the server's model: the server serves it (100 tokens and more), verified
        # by its receipts, and the stage's member countersigns it
        for _ in range(3):
            done = run_meshd("ask", "--state-dir", str(states["stage"]), "--model", "draft-llama", "--raw",
                             "--max-tokens", "48", "--wait", "90", "Once upon a time")
            assert done.returncode == 0, done.stderr
        deadline = time.monotonic() + 30.0
        while True:
            rows = {m["node_id"]: m for m in trio.run(ledger, states["stage"])["members"]}
            if rows.get(server.node_id, {}).get("balance", 0) > 0:
                break
            assert time.monotonic() < deadline, rows
            time.sleep(1.0)

        # forged summaries and a ring's made-up work are refused or earn nothing
        ring = [NodeIdentity.generate() for _ in range(10)]
        now = time.time()
        made_up = [served_summary(a, s, tokens=500, session=f"{i}-{j}", at=now) for i, a in enumerate(ring)
                   for j, s in enumerate(ring) if i != j][:60]
        taken = _give(stage.address, made_up)
        assert taken.taken == len(made_up)
        honest = served_summary(NodeIdentity.generate(), NodeIdentity.generate(), tokens=100, at=now)
        forged = [honest.model_copy(update={"signature": bytes(64)}),
                  WorkSummary.create(ring[0], honest.model, 0, 8, 1000, 0, True, int(now), honest.head),
                  served_summary(ring[1], ring[1], tokens=100, at=now)]
        assert _give(stage.address, forged) == WorkTaken(taken=0, refused=3)
        # the ledger's credit is worked out again every 2 s (STANDING): once it holds the ring's summaries,
        # each ring member that asked stands in it (it spent), and no ring member earned anything
        askers = {summary.asker for summary in made_up}
        deadline = time.monotonic() + 3 * STANDING_EVERY
        while not askers <= (rows := {m["node_id"]: m for m in trio.run(ledger, states["stage"])["members"]}).keys():
            assert time.monotonic() < deadline, rows
            time.sleep(1.0)
        assert all(rows.get(r.node_id, {}).get("earned", 0.0) == 0.0 for r in ring), rows

        # the newcomer's long answer holds the stage's one slot; the server asks the same model meanwhile
        model = ["--model", default_model.stem, "--raw", "--wait", "60"]
        long_ask = spawn(meshd_command("ask", "--state-dir", str(states["newcomer"]), *model, "--max-tokens", "600",
                                       "Count: 1, 2, 3,"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | {"MESHD_LOG": "info"})
        try:
            assert long_ask.stdout is not None
            if not long_ask.stdout.read(8):  # it streams: its session holds the slot
                pytest.fail(f"the long answer did not stream: {long_ask.communicate(timeout=30)[1]}")
            quick = run_meshd("ask", "--state-dir", str(states["server"]), *model, "--max-tokens", "8", "Hello")
            assert quick.returncode == 0, quick.stderr
            # the long answer's log as far as the word of its slot given up (or all of it, if that never
            # comes): the rest of its 600 tokens, failed over, shows nothing more
            assert long_ask.stderr is not None
            err = ""
            for line in long_ask.stderr:
                err += line
                if "an asker with more credit" in line:
                    break
        finally:
            long_ask.terminate()
            long_ask.communicate(timeout=60)
        # the server was let in at once: the newcomer's session gave up the slot to it
        assert "an asker with more credit" in err, err
    finally:
        stop_started(nodes, launched)
