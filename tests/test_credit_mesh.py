"""The credit ledger on real daemons (issue 33): an ask's stages are countersigned by the member that
asked, the stage keeps the summary, both ledgers agree, and `meshd credits` shows who earned what."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from localmesh import Served, run_meshd, start_join, stop_all

pytestmark = pytest.mark.slow  # two daemons, two engine workers

VOLUNTEER = ["--memory", "256M", "--max-sessions", "2", "--session-tokens", "256", "--threads", "1"]
SETTLE_S = 120.0


def credits(state: Path) -> dict[str, Any]:
    done = run_meshd("credits", "--state-dir", str(state), "--json")
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


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
        deadline = time.monotonic() + 30.0
        while True:
            docs = [credits(s) for s in states]
            if docs[0]["root"] == docs[1]["root"] and docs[0]["summaries"] > 0:
                break
            assert time.monotonic() < deadline, docs
            time.sleep(1.0)
        assert [d["node"] for d in docs] == ids
        earned = [d["own"]["earned"] for d in docs]
        # 6 asks of 8 new tokens over the whole model (30 layers): some of them through the other node
        assert max(earned) >= 30 * 8 * 0.5, docs
        # the same standing on both: each sees the other placed and its credit as it sees its own
        for me, other in ((0, 1), (1, 0)):
            [row] = [m for m in docs[me]["members"] if m["node_id"] == ids[other]]
            assert row["placed"] and row["earned"] == pytest.approx(docs[other]["own"]["earned"], rel=1e-3), docs
        table = run_meshd("credits", "--state-dir", str(states[0]))
        assert table.returncode == 0 and "balance" in table.stdout and ids[1][:16] in table.stdout, table.stdout
    finally:
        stop_all(nodes)
