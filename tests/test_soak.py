"""tools/soak.py's CI profile (issue 32, part 6): a seed, a relay, an HTTP API member and four volunteers
(one behind a MASQUERADE NAT, one behind an emulated slow link) in network namespaces, asked by `meshd ask`
and the `openai` client while, once each, a volunteer is SIGKILLed, one SIGTERMed, one SIGSTOPped, one cut
off, the relay stopped and a volunteer joined. Every greedy answer equals the whole model's, every failure is
one line put down to a disturbance, no departed member stays in a status past its bound, and no daemon's log
holds a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import netns
import pytest
from netns import ROOT

pytestmark = pytest.mark.slow


def test_the_smoke_soak_gives_no_wrong_answer_no_unexplained_failure_and_no_ghost(tmp_path: Path) -> None:
    netns.require()
    removed = netns.remove_stale()
    if removed:
        print(f"removed stale namespaces: {', '.join(removed)}")
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "soak.py"), "--smoke", "--seed", "3", "--json", str(out),
                          "--workdir", str(tmp_path / "soak")], capture_output=True, text=True, timeout=600)
    tail = f"{run.stdout[-12000:]}\n{run.stderr[-3000:]}"
    print(run.stdout[-3000:])
    assert out.exists(), tail
    rep = json.loads(out.read_text())
    asks = rep["asks"]
    assert rep["completed"], tail
    # it did what it says: asks of every kind answered, and the mesh disturbed while they ran
    assert asks["done"] >= 6 and {a["kind"] for a in rep["ask_log"] if a["status"] == "done"} == {"cli", "http"}, tail
    events = {(e["event"], e.get("daemon", "")) for e in rep["events"]}
    assert {"SIGKILL", "SIGTERM", "link down", "join"} <= {event for event, _ in events}, tail
    assert ("SIGSTOP", "relay") in events and any(e == "SIGSTOP" and d != "relay" for e, d in events), tail
    assert asks["wrong"] == 0, rep["wrong"]
    assert asks["unexplained"] == 0, [f for f in rep["failures"] if not f["explained"]]
    assert all(f["error"] and "Traceback" not in f["error"] for f in rep["failures"]), rep["failures"]
    assert rep["ghosts"] == [], rep["ghosts"]
    assert rep["orphans"] == [], rep["orphans"]
    assert rep["tracebacks"] == [], f"a traceback in the log of {rep['tracebacks']}; logs in {rep['logs']}"
    assert run.returncode == 0, tail
    # every namespace it made is gone
    listed = {line.split(" ", 1)[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                               timeout=30).stdout.splitlines()}
    assert rep["namespaces"] and not listed & set(rep["namespaces"]), listed
