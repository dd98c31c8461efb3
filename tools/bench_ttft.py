#!/usr/bin/env python3
"""Time to first token of a cold `meshd ask --route` over three `meshd serve` stages.

Each ask is a fresh `meshd ask` process, so every link (dial, WebSocket upgrade,
Noise handshake) is made anew: this is what a user's first question pays. The
figure is the one `meshd ask` prints ("first token N ms", measured from the
start of the session, route given) and the wall time of the whole command.

Usage: .venv/bin/python tools/bench_ttft.py [--asks 7] [--stages 3] [--json OUT]
"""

from __future__ import annotations

import re
import statistics
import sys
import time

from benchlib.result import parser, publish
from localmesh import Served, run_meshd, start_serve

FIRST = re.compile(r"first token (\d+) ms")


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--asks", type=int, default=7, help="cold asks to time (default 7)")
    ap.add_argument("--stages", type=int, default=3, help="stages of the route (default 3)")
    ap.add_argument("--prompt", default="What is the capital of France?", help="the question")
    args = ap.parse_args()
    if args.smoke:  # the smallest run through every part: two stages, one timed ask
        args.asks, args.stages = 1, 2
    n_layer = 30
    cuts = [round(i * n_layer / args.stages) for i in range(args.stages + 1)]
    stages: list[Served] = []
    try:
        for a, b in zip(cuts, cuts[1:], strict=False):
            stages.append(start_serve("--layers", f"{a}:{b}", "--threads", "1", "--max-sessions", "2",
                                      "--session-tokens", "256"))
        route = ",".join(s.address for s in stages)
        if not args.smoke:  # warm the workers' caches (a smoke run's one ask goes the same way; its figure is none)
            run_meshd("ask", "--route", route, "--max-tokens", "4", args.prompt)
        firsts, walls = [], []
        for _ in range(args.asks):
            t0 = time.perf_counter()
            done = run_meshd("ask", "--route", route, "--max-tokens", "4", args.prompt)
            walls.append((time.perf_counter() - t0) * 1000)
            m = FIRST.search(done.stderr + done.stdout)
            if done.returncode != 0 or m is None:
                print(f"ask failed (rc {done.returncode}): {done.stderr.strip()}", file=sys.stderr)
                return 1
            firsts.append(int(m.group(1)))
        publish("ttft", args, {"first_token_ms": firsts, "command_ms": walls,
                               "median": {"first_token_ms": statistics.median(firsts),
                                          "command_ms": statistics.median(walls)}},
                f"{args.stages} stages, {args.asks} cold asks: first token median {statistics.median(firsts):.0f} ms "
                f"(min {min(firsts)}, max {max(firsts)}); whole `meshd ask` command median "
                f"{statistics.median(walls):.0f} ms")
        return 0
    finally:
        for s in reversed(stages):
            s.stop()


if __name__ == "__main__":
    sys.exit(main())
