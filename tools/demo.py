#!/usr/bin/env python3
"""The main job: a local mesh on loopback answers a question.

Starts a seed and three volunteers (`meshd join`) with the default model and
little memory each, so the tracker must cut the model into layer ranges;
waits until every layer is served; asks with `meshd ask`; shows `meshd status`;
then stops every process.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "tests"))  # the local-process helpers live with the tests
from localmesh import Served, run_meshd, start_join  # noqa: E402

VOLUNTEER = ["--memory", "64M", "--max-sessions", "2", "--session-tokens", "512", "--threads", "1"]


def wait_for_coverage(seed: Served, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = run_meshd("status", "--seed", seed.address)
        if shown.returncode == 0 and "30/30 layers covered" in shown.stdout:
            return shown.stdout
        time.sleep(0.5)
    raise SystemExit("demo: the mesh did not cover the model in time:\n" + shown.stdout + shown.stderr)


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
            print(f"$ meshd join --no-model                      # seed on {nodes[0].address}")
            for i in range(args.volunteers):
                nodes.append(start_join("--seed", nodes[0].address, "--state-dir", f"{state}/v{i}", *VOLUNTEER))
                print(f"$ meshd join --seed {nodes[0].address} --memory 64M   # volunteer on {nodes[-1].address}")
            wait_for_coverage(nodes[0])
            print(f"\n$ meshd ask --seed {nodes[0].address} \"{args.prompt}\"")
            asked = run_meshd("ask", "--seed", nodes[0].address, "--max-tokens", str(args.max_tokens), args.prompt)
            sys.stdout.write(asked.stdout)
            sys.stdout.write(asked.stderr)
            print(f"\n$ meshd status --seed {nodes[0].address}")
            shown = run_meshd("status", "--seed", nodes[0].address)
            sys.stdout.write(shown.stdout + shown.stderr)
            return asked.returncode
        finally:
            for node in reversed(nodes):
                node.stop()


if __name__ == "__main__":
    sys.exit(main())
