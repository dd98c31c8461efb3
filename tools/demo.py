#!/usr/bin/env python3
"""The main job: a local mesh on loopback answers a question.

Starts a seed and three volunteers (`meshd join`) with the default model and
little memory each, so the tracker must cut the model into layer ranges;
waits until every layer is served; asks with `meshd ask`; shows `meshd status`;
then stops every process. Each command is printed as it was run, flag for flag (from the
process's own argv), so a line typed as printed does what it did here.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from localmesh import Served, meshd_command, run_meshd, start_join, stop_all, wait_covered

ROOT = Path(__file__).resolve().parent.parent

# Three volunteers of 64 MiB hold SmolLM2 only with a small session budget (the README says why); one
# compute thread each, as they share this machine's cores with the seed and each other.
VOLUNTEER = ["--memory", "64M", "--max-sessions", "2", "--session-tokens", "512", "--threads", "1"]


def typed(args: list[str]) -> str:
    """The command line a process ran, as a user types it: `meshd` and the process's own arguments."""
    return "$ " + shlex.join(["meshd", *args[len(meshd_command()):]])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompt", nargs="?", default="What is the capital of France? Answer in one sentence.")
    ap.add_argument("--volunteers", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    nodes: list[Served] = []
    with tempfile.TemporaryDirectory(prefix="meshd-demo-") as state:
        try:
            nodes.append(start_join("--no-model", "--state-dir", f"{state}/seed"))
            print(f"{typed(nodes[0].proc.args)}   # the seed, on {nodes[0].address}")
            for i in range(args.volunteers):
                nodes.append(start_join("--seed", nodes[0].address, "--state-dir", f"{state}/v{i}", *VOLUNTEER))
                print(f"{typed(nodes[-1].proc.args)}   # a volunteer, on {nodes[-1].address}")
            try:
                wait_covered(nodes[0])
            except AssertionError as e:
                raise SystemExit(f"demo: the mesh did not cover the model in time: {e}") from None
            asked = run_meshd("ask", "--seed", nodes[0].address, "--max-tokens", str(args.max_tokens), args.prompt)
            show(asked)
            show(run_meshd("status", "--seed", nodes[0].address))
            return asked.returncode
        finally:
            stop_all(nodes)


def show(done: subprocess.CompletedProcess[str]) -> None:
    print(f"\n{typed(done.args)}")
    sys.stdout.write(done.stdout + done.stderr)
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
