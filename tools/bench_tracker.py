#!/usr/bin/env python3
"""How long the tracker's work takes for a large mesh: assignment, rebalancing and routing.

A synthetic mesh of --nodes volunteers holding a 70B-class model (80 layers of
~0.5 GiB at Q4, KV for 4 sessions of 8k tokens): memory from 4 to 48 GiB,
speeds spread around 5 ms per layer, positions on a plane whose distances give
the RTTs (1 to ~60 ms). Every figure is the median of --repeat runs (max in
brackets), in milliseconds of one CPU core.
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from collections.abc import Callable

from benchlib.result import parser, publish

from meshd.mesh.assignment import ModelSpec, NodeCapacity, capacities
from meshd.mesh.placement import assign
from meshd.mesh.records import CapabilityRecord, ModelInfo, ServedRange
from meshd.mesh.routing import StageOption, plan_route, stage_options
from wire.identity import NodeIdentity

GIB = 2**30
MODEL = ModelInfo(
    digest="sha256:bench-70b-q4",
    name="bench-70b-q4",
    n_layers=80,
    bytes_per_layer=int(0.48 * GIB),
    kv_bytes_per_token=4096,  # 8 KV heads x 128 x (K + V) x f16
    head_bytes=int(0.55 * GIB),
    tail_bytes=int(0.55 * GIB),
)
KV_TOKENS = 4 * 8192


def timed(fn: Callable[[], object], repeat: int) -> tuple[object, float, float]:
    """The result and the median and max wall time in ms."""
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - start) * 1000)
    return result, statistics.median(times), max(times)


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--routes", type=int, default=100, help="routes planned per run, from random askers")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.smoke:  # the smallest mesh that goes through every part
        args.nodes, args.repeat, args.routes = 60, 1, 4
    lines: list[str] = []
    figures: dict[str, dict[str, float]] = {}

    def timed_as(key: str, fn: Callable[[], object]) -> tuple[object, float, float]:
        result, median, worst = timed(fn, args.repeat)
        figures[key] = {"median_ms": median, "max_ms": worst}
        return result, median, worst

    rng = random.Random(args.seed)
    model = ModelSpec.from_info(MODEL, KV_TOKENS)
    names = [f"node{i:05d}" for i in range(args.nodes)]
    nodes = [
        NodeCapacity(name, rng.choice([4, 8, 12, 16, 24, 32, 48]) * GIB, 0.005 * math.exp(rng.gauss(0, 0.5)))
        for name in names
    ]
    place = {name: (rng.uniform(0, 30), rng.uniform(0, 30)) for name in names + ["asker"]}

    def rtt(a: str | None, b: str) -> float:
        (xa, ya), (xb, yb) = place[a or "asker"], place[b]
        return 0.001 + math.hypot(xa - xb, ya - yb) / 1000

    total = sum(n.memory_bytes for n in nodes) / GIB
    whole = model.stage_bytes(0, model.n_layers) / GIB
    lines.append(
        f"mesh: {args.nodes} nodes, {total:.0f} GiB in all; "
        f"model: {model.n_layers} layers, {whole:.1f} GiB with KV for {KV_TOKENS} tokens"
    )

    assignment, median, worst = timed_as("assign", lambda: assign(nodes, model))
    segments = len(assignment.boundaries) - 1
    lines.append(
        f"assign (fresh):            {median:8.1f} ms  [{worst:.1f}]  -> {segments} segments "
        f"{list(assignment.boundaries)}, {len(assignment.stages)} stages, "
        f"fastest chain of {len(assignment.chain)} at {assignment.seconds_per_token * 1000:.0f} ms/token"
    )

    # Churn: 10 nodes leave, 10 join; the placement is kept where it can be.
    gone = set(rng.sample(names, 10))
    joiners = [NodeCapacity(f"joiner{i}", rng.choice([8, 16, 32]) * GIB, 0.005) for i in range(10)]
    churned = [n for n in nodes if n.node_id not in gone] + joiners
    rebalanced, median, worst = timed_as("rebalance", lambda: assign(churned, model, current=assignment))
    moved = sum(
        1 for node_id, r in rebalanced.ranges().items() if assignment.ranges().get(node_id) not in (None, r)
    )
    lines.append(
        f"assign (10 leave, 10 join):{median:8.1f} ms  [{worst:.1f}]  -> {moved} nodes moved, "
        f"{sum(1 for n in rebalanced.ranges() if n.startswith('joiner'))} joiners placed"
    )

    speed = {n.node_id: n.seconds_per_layer for n in nodes}
    options = [
        StageOption(s.node_id, s.start, s.end, speed[s.node_id], rng.uniform(0, 1)) for s in assignment.stages
    ]
    askers = [rng.choice(names) for _ in range(args.routes)]

    def routes() -> list:
        return [plan_route(options, model.n_layers, rtt=rtt, asker=asker) for asker in askers]

    planned, median, worst = timed_as("plan_routes", routes)
    hops = statistics.mean(len(route.stages) for route in planned)
    cost = statistics.mean(route.seconds for route in planned) * 1000
    lines.append(
        f"plan_route x{args.routes}:            {median:8.1f} ms  [{worst:.1f}]  -> "
        f"{median / args.routes:.2f} ms per route, {hops:.1f} stages, {cost:.0f} ms/token on average"
    )

    failed = planned[0].stages[len(planned[0].stages) // 2].node_id
    _, median, worst = timed_as(
        "plan_route_failover", lambda: plan_route(options, model.n_layers, rtt=rtt, asker=askers[0], exclude={failed})
    )
    lines.append(f"plan_route (failover):     {median:8.1f} ms  [{worst:.1f}]")

    # What a node does from its membership view: records in, capacities and stage options out.
    identities = [NodeIdentity.generate() for _ in range(args.nodes)]
    ranges = list(assignment.ranges().values())
    records = [
        CapabilityRecord.create(
            identity,
            1,
            memory_bytes=node.memory_bytes,
            seconds_per_layer=node.seconds_per_layer,
            models=[MODEL],
            served=[ServedRange(model=MODEL.digest, start=ranges[i][0], end=ranges[i][1])]
            if i < len(ranges)
            else [],
        )
        for i, (identity, node) in enumerate(zip(identities, nodes, strict=False))
    ]

    def from_view() -> tuple:
        caps = capacities(records, MODEL.digest)
        return assign(caps, model), plan_route(stage_options(records, MODEL.digest), model.n_layers)

    _, median, worst = timed_as("from_records", from_view)
    lines.append(f"from {args.nodes} records (assign + route): {median:.1f} ms  [{worst:.1f}]")
    publish("tracker", args, figures, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
