#!/usr/bin/env python3
"""Speculative decoding across the ring: tok/s with and without, and acceptance rates, in one run.

Three stages of the default model (even layer ranges, 1 thread each) run in
this process, each with its own engine worker, and each behind a
tools/link_emulator.py proxy adding the one-way delay to every connection
made to it: the route's addresses are the proxies', so every stage-to-stage
hop and the ring from the tail to the head cross one emulated link. The asker
(also in this process) runs each task greedy with ``speculate`` off and
``ngram``, in alternating order per round, and checks the answers are the
same tokens.

Tasks: *rewrite*, a chat asking to repeat a given passage (repetitive: prompt
lookup drafts well), and *chat*, free-form questions. Decode tok/s is (tokens
- 1) / (time from the first token to the last) at the asker; acceptance is
accepted / drafted tokens at the tail.

Usage: .venv/bin/python tools/bench_spec.py [--delays 0,20] [--tokens 64] [--repeats 1] [--json out.json]
"""

from __future__ import annotations

import json
import statistics
import sys
from contextlib import AsyncExitStack
from typing import Any

import trio
from benchlib.result import parser, publish
from link_emulator import LinkEmulator, LinkSpec

from meshd.client.ask import AskRequest, AskResult
from meshd.client.route import route_at
from meshd.client.session import run_session
from meshd.mesh.models import default_model_path
from meshd.net.peers import PeersConfig, open_peers
from meshd.stage.books import StageLimits
from meshd.stage.node import stage_node
from wire.identity import NodeIdentity

PASSAGE = ("The lighthouse keeper climbed the stairs every evening at dusk. He wiped the lens, trimmed the wick "
           "and lit the lamp, and the beam swept across the dark water until morning. Ships far out at sea saw "
           "the light and knew where the rocks were, and in the morning he put the lamp out and slept.")
TASKS = {
    "rewrite": [f"Repeat the following passage word for word.\n\n{PASSAGE}",
                f"Rewrite the following passage in the present tense.\n\n{PASSAGE}"],
    "chat": ["Write a short story about a dragon who learns to cook.",
             "Explain how a bicycle stays upright.",
             "What should I pack for a week of hiking in the mountains?"],
}
RANGES = [(0, 10), (10, 20), (20, 30)]


async def bench(delays: list[float], tokens: int, repeats: int, prompts_per_task: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    model = default_model_path()
    limits = StageLimits(max_sessions=4, max_session_tokens=1024)
    async with trio.open_nursery() as nursery:
        for delay_ms in delays:
            # fresh stages and asker for each delay: they would reuse the links made at another one;
            # the proxies (in the nursery) outlive them
            async with AsyncExitStack() as stack:
                nodes = [await stack.enter_async_context(stage_node(model, layers, limits, NodeIdentity.generate(),
                                                                    PeersConfig(drain_timeout=0.5), threads=1))
                         for layers in RANGES]
                peers = await stack.enter_async_context(open_peers(NodeIdentity.generate()))
                proxies = []
                for node in nodes:
                    host, port = node.address.rsplit(":", 1)
                    emulator = LinkEmulator((host, int(port)), LinkSpec(delay=delay_ms / 1000))
                    proxies.append(f"127.0.0.1:{await nursery.start(emulator.serve, '127.0.0.1', 0)}")
                route = route_at(proxies)
                for task, every in TASKS.items():
                    prompts = every[:prompts_per_task]
                    rates: dict[str, list[float]] = {"off": [], "ngram": []}
                    drafted = accepted = 0
                    for round_ in range(repeats):
                        for i, prompt in enumerate(prompts):
                            order = ["off", "ngram"] if (round_ + i) % 2 == 0 else ["ngram", "off"]
                            answers: dict[str, AskResult] = {}
                            for mode in order:
                                request = AskRequest(messages=[{"role": "user", "content": prompt}], max_tokens=tokens,
                                                     speculate=mode)  # type: ignore[arg-type]
                                with trio.fail_after(600):
                                    answers[mode] = await run_session(peers, route, request, AskResult(),
                                                                      stall_timeout=120)
                                rates[mode].append(answers[mode].decode_rate)
                            if answers["off"].tokens != answers["ngram"].tokens:
                                raise SystemExit(f"speculation changed the answer to {prompt[:40]!r}")
                            drafted += answers["ngram"].drafted
                            accepted += answers["ngram"].accepted
                    off, on = statistics.median(rates["off"]), statistics.median(rates["ngram"])
                    rows.append({"delay_ms": delay_ms, "task": task, "off_tok_s": off, "ngram_tok_s": on,
                                 "speedup": on / off, "drafted": drafted, "accepted": accepted,
                                 "acceptance": accepted / drafted if drafted else 0.0, "answers_identical": True})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        nursery.cancel_scope.cancel()
    return rows


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--delays", default="0,20", help="one-way delays per hop in ms, comma-separated")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per answer (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds over every prompt (default: %(default)s)")
    args = ap.parse_args()
    per_task = len(max(TASKS.values(), key=len))
    if args.smoke:  # the smallest run through every part: no delay, one prompt of each task, a few tokens
        args.delays, args.tokens, args.repeats, per_task = "0", 8, 1, 1
    try:
        delays = [float(d) for d in args.delays.split(",")]
    except ValueError:
        ap.error(f"--delays takes numbers of ms, comma-separated, not {args.delays!r}")
    rows = trio.run(bench, delays, args.tokens, args.repeats, per_task)
    lines = ["| one-way delay | task | tok/s off | tok/s ngram | speedup | accepted / drafted |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['delay_ms']:g} ms | {r['task']} | {r['off_tok_s']:.1f} | {r['ngram_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['accepted']}/{r['drafted']} ({r['acceptance']:.0%}) |" for r in rows]
    publish("spec", args, {"rows": rows}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
