"""`tools/dev demo`'s printed command lines, typed again as printed, make a mesh that answers.

The demo is run as a user runs it; then its `$ meshd ...` lines are run again as new processes,
word for word but for the seed's address (port 0 picks another one each run).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from localmesh import Served, run_meshd, start_meshd, stop_all, wait_covered

ROOT = Path(__file__).resolve().parent.parent
# the demo's own bound for the mesh to cover the model, and its start-up and teardown beside it
DEMO_SECONDS = 240
COVERAGE_SECONDS = 120.0

pytestmark = pytest.mark.slow


def printed_commands(out: str) -> list[list[str]]:
    """The demo's `$ meshd ...` lines as argv (without `meshd`), comments dropped."""
    return [shlex.split(line[2:], comments=True)[1:] for line in out.splitlines() if line.startswith("$ meshd ")]


def test_the_demos_printed_lines_run_as_printed() -> None:
    demo = subprocess.run([sys.executable, str(ROOT / "tools" / "demo.py"), "--max-tokens", "8"],
                          capture_output=True, text=True, timeout=DEMO_SECONDS)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    commands = printed_commands(demo.stdout)
    assert [c[0] for c in commands] == ["join", "join", "join", "join", "ask", "status"], demo.stdout
    seed_line, *volunteers = commands[:4]
    nodes: list[Served] = []
    try:
        nodes.append(start_meshd(*seed_line))
        # where the demo's seed listened, this run's listens: the one word a second run changes
        [old_seed] = {c[c.index("--seed") + 1] for c in commands[1:]}

        def as_now(argv: list[str]) -> list[str]:
            return [nodes[0].address if word == old_seed else word for word in argv]

        nodes += [start_meshd(*as_now(line)) for line in volunteers]
        # waited for in this process (a `meshd status` a poll is most of a second of CPU); then the printed
        # status line, run once, says so too
        wait_covered(nodes[0], timeout=COVERAGE_SECONDS)
        shown = run_meshd(*as_now(commands[5]))
        assert "30/30 layers covered" in shown.stdout, f"typed as printed, the volunteers do not cover the model:\n" \
            f"{shown.stdout}{shown.stderr}"
        asked = run_meshd(*as_now(commands[4]))
        assert asked.returncode == 0 and asked.stdout.strip(), asked.stderr
    finally:
        stop_all(nodes)
        # the state dirs the lines name, made again by this run (the demo removed its own)
        for line in commands[:4]:
            shutil.rmtree(Path(line[line.index("--state-dir") + 1]).parent, ignore_errors=True)
