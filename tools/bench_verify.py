#!/usr/bin/env python3
"""Output verification: how soon a lying stage is caught, what checking costs in tok/s, and the bytes it adds.

Stages of the default model run here (1 thread each, each with its own engine
worker): a 3-stage route of even ranges in this process, and in a process of
their own (as in a mesh, where they are other machines) one replica of the
head and the tail ranges and two of the middle one (a mismatch there is
settled by a third node, which makes a proof).

(a) Steps until caught: an attacker (meshd's own stage service, patched)
serves the route's middle range and flips one float of its output at a random
decode step, signing what it sends as an honest stage would; the asker checks
1 in 16 steps. Per run: the steps from the lie until the asker laid it at the
attacker, and whether the answer (regenerated on a route without it) is the
undisturbed one. Each answer's last steps are checked once it is in, so every lie
is checked; a run without a catch is a miss (and prints what went unchecked).

(b) Decode tok/s of the honest 3-stage route with verification at 1 in 16 and
off, alternating in one run. The replicas' process and engine workers are
pinned to a CPU of their own (where there are two or more: the route's workers
and this process get the others) and their CPU is reported apart, per step a
spot check replays. The route's stage services and the asker share this
process's one event loop, so their CPU cannot be told apart here: the bench
reports it per decode token and mode, the receipts' and checks' share of it
included; (c) the bytes per decode token the signed hashes
add (every hop's chain of receipts, the ring's, and the one the asker gets),
and beside it the bytes spot checks move at 1 in 16 (inputs fetched and fed to
a replica), measured from the messages of a real answer.

Usage: .venv/bin/python tools/bench_verify.py [--runs 20] [--tokens 96] [--rate-tokens 64] [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import trio

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from meshd.client.ask import AskRequest, AskResult, Stage, ask_with_failover, run_session  # noqa: E402
from meshd.client.verify import CheckPlan, Verifier  # noqa: E402
from meshd.mesh.models import default_model_path  # noqa: E402
from meshd.net.peers import PeersConfig, open_peers  # noqa: E402
from meshd.stage.service import StageLimits, StageNode, StageService, stage_node  # noqa: E402
from wire.codec import encode  # noqa: E402
from wire.identity import NodeIdentity  # noqa: E402
from wire.receipt import Receipt, Receipts, pack_chain, unpack_chain  # noqa: E402
from wire.stage import Inputs  # noqa: E402

RANGES = {"head": (0, 10), "mid": (10, 20), "tail": (20, 30)}
REPLICAS = {"head2": (0, 10), "mid2": (10, 20), "mid3": (10, 20), "tail2": (20, 30)}
PROMPTS = ["Write a short story about a dragon who learns to cook.",
           "Explain how a bicycle stays upright.",
           "What should I pack for a week of hiking in the mountains?"]
EVERY = 16
ROUTE = ("head", "mid", "tail")
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User and system CPU a process has used (an engine worker: where a stage computes)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def pin(nodes: dict[str, StageNode], replica_pids: list[int]) -> str:
    """The replicas' process and workers on a CPU of their own, the route's and this process on the rest."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return "not pinned (one CPU)"
    mine, theirs = set(cpus[:-1]), {cpus[-1]}
    os.sched_setaffinity(0, mine)
    for node in nodes.values():
        pid = node.service.engine.pid
        assert pid is not None
        os.sched_setaffinity(pid, mine)
    for pid in replica_pids:
        os.sched_setaffinity(pid, theirs)
    return f"replicas (process and workers) on CPU {cpus[-1]}, route workers and the event loop on {sorted(mine)}"


async def serve_replicas() -> None:
    """The replicas' process: serves REPLICAS, says where on stdout (a JSON line each, then "ready"),
    and ends when stdin closes."""
    limits = StageLimits(max_sessions=8, max_session_tokens=1024)
    async with AsyncExitStack() as stack:
        for name, layers in REPLICAS.items():
            node = await stack.enter_async_context(stage_node(
                default_model_path(), layers, limits, NodeIdentity.generate(), PeersConfig(drain_timeout=0.5),
                threads=1))
            r = node.service.report
            print(json.dumps({"name": name, "address": node.address, "node_id": node.peers.node_id,
                              "digest": node.service.digest, "layers": [r.layer_begin, r.layer_end],
                              "pid": node.service.engine.pid}), flush=True)
        print("ready", flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)


@asynccontextmanager
async def replicas_apart() -> AsyncIterator[tuple[dict[str, Stage], list[int]]]:
    """The replicas in a process of their own: their stages by name, and every pid whose CPU is theirs."""
    proc = await trio.lowlevel.open_process([sys.executable, __file__, "--serve-replicas"], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        stages: dict[str, Stage] = {}
        pids = [proc.pid]
        buffered = b""
        with trio.fail_after(300):
            while b"ready\n" not in buffered:
                chunk = await proc.stdout.receive_some()
                if not chunk:
                    raise SystemExit("the replicas' process ended before it was ready")
                buffered += chunk
        for line in buffered.decode().splitlines()[:-1]:
            r = json.loads(line)
            stages[r["name"]] = Stage(r["address"], r["node_id"], r["digest"], tuple(r["layers"]))
            pids.append(r["pid"])
        yield stages, pids
    finally:
        with trio.CancelScope(shield=True):
            if proc.stdin is not None:
                await proc.stdin.aclose()
            with trio.move_on_after(10):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


def stage_of(node: StageNode) -> Stage:
    r = node.service.report
    return Stage(node.address, node.peers.node_id, node.service.digest, (r.layer_begin, r.layer_end))


class FlippingAttacker:
    """Patches an honest stage service into an attacker: at its ``at``-th engine call of a routed session it
    flips the sign of one float of its output (and signs what it sends, as an honest stage would)."""

    def __init__(self, service: StageService) -> None:
        self.honest = service._dispatch
        self.at = 0
        self.calls = 0
        service._dispatch = self.dispatch  # type: ignore[method-assign]

    def arm(self, at: int) -> None:
        self.at, self.calls = at, 0

    def dispatch(self, batch: list[Any], reply: dict[str, Any], body: bytearray) -> None:
        if any(not w.payload.session.open.check for w in batch):
            self.calls += 1
            if self.calls == self.at:
                rows = np.frombuffer(body, dtype=np.float32)
                rows[0] = -rows[0] if rows[0] else 1.0
        self.honest(batch, reply, body)


class Counting(Verifier):
    """A verifier that keeps a decode step's chain of receipts, whose bytes the figures count: read
    once the runs are done, so the asker's CPU per token is what ``Verifier`` costs, no more."""

    decode_chain: tuple[bytes, str, int, str] | None = None

    def on_chain(self, session: str, epoch: int, chain: bytes) -> None:
        assert self.audit is not None
        super().on_chain(session, epoch, chain)
        if self.audit.prompt_len is not None and self.audit.next_pos > self.audit.prompt_len:
            Counting.decode_chain = (chain, session, epoch, self.audit.model)


def receipt_bytes(chain: list[Receipt]) -> int:
    """What a chain adds to the message it rides in (an activation, a token): its field's bytes."""
    bare = {"type": "token", "v": 1, "session": "0" * 24, "epoch": 0, "index": 0, "token": 0, "piece": b""}
    return len(encode({**bare, "receipts": pack_chain(chain)})) - len(encode({**bare, "receipts": None}))


async def bench(runs: int, tokens: int, rate_tokens: int, repeats: int, seed: int, pin_cpus: bool) -> dict[str, Any]:
    model = default_model_path()
    limits = StageLimits(max_sessions=8, max_session_tokens=1024)
    rng = random.Random(seed)
    async with AsyncExitStack() as stack:
        nodes = {name: await stack.enter_async_context(stage_node(
            model, layers, limits, NodeIdentity.generate(), PeersConfig(drain_timeout=0.5), threads=1))
            for name, layers in RANGES.items()}
        apart, replica_pids = await stack.enter_async_context(replicas_apart())
        peers = await stack.enter_async_context(open_peers(NodeIdentity.generate(), PeersConfig(drain_timeout=0.5)))
        pinning = pin(nodes, replica_pids) if pin_cpus else "not pinned"
        route = [stage_of(nodes[n]) for n in ROUTE]
        replicas = list(apart.values())
        everyone = route + replicas

        async def find(excluded: list[str]) -> list[Stage]:
            return [next(s for s in everyone if s.layers is not None and s.layers[0] == begin
                         and s.node_id not in excluded) for begin in (0, 10, 20)]

        # (b) and (c): the honest route, verification at 1 in 16 against off
        rates: dict[str, list[float]] = {"off": [], "receipts": [], "verify": []}
        # CPU seconds by mode: this process's event loop (stages and asker), per decode token
        loop_cpu: dict[str, float] = {"off": 0.0, "receipts": 0.0, "verify": 0.0}
        decoded: dict[str, int] = {"off": 0, "receipts": 0, "verify": 0}
        # the route's engine workers' CPU seconds by mode: with the event loop's, what the route costs a
        # token, which the box's other load does not change as it changes tok/s
        route_pids = [n.service.engine.pid for n in nodes.values() if n.service.engine.pid is not None]
        route_cpu: dict[str, float] = {"off": 0.0, "receipts": 0.0, "verify": 0.0}
        replica_cpu = 0.0
        replayed = 0
        sizes: dict[str, float] = {}
        for round_ in range(repeats):
            for i, prompt in enumerate(PROMPTS):
                request = AskRequest(messages=[{"role": "user", "content": prompt}], max_tokens=rate_tokens)
                order = ["off", "receipts", "verify"][::1 if (round_ + i) % 2 == 0 else -1]
                answers = {}
                for mode in order:
                    every = {"off": 0, "receipts": 0, "verify": EVERY}[mode]
                    verifier = None if mode == "off" else Counting(peers, CheckPlan(every=every, candidates=replicas,
                                                                                  rng=random.Random(rng.random())))
                    loop0 = time.thread_time()
                    replica0 = sum(cpu_seconds(p) for p in replica_pids)
                    route0 = sum(cpu_seconds(p) for p in route_pids)
                    with trio.fail_after(600):
                        answers[mode] = await run_session(peers, route, request, AskResult(), stall_timeout=120,
                                                          verifier=verifier)
                    loop_cpu[mode] += time.thread_time() - loop0
                    route_cpu[mode] += sum(cpu_seconds(p) for p in route_pids) - route0
                    decoded[mode] += len(answers[mode].tokens)
                    if mode == "verify":
                        assert verifier is not None
                        replica_cpu += sum(cpu_seconds(p) for p in replica_pids) - replica0
                        replayed += verifier.plan.compared
                    rates[mode].append(answers[mode].decode_rate)
                if not answers["off"].tokens == answers["receipts"].tokens == answers["verify"].tokens:
                    raise SystemExit(f"verification changed the answer to {prompt[:40]!r}")
        assert Counting.decode_chain is not None
        chain = list(unpack_chain(*Counting.decode_chain))
        assert chain[0].layer_begin > 0, "a decode step's chain starts with the tail's receipt of its token"
        # inside the messages on the way: the head's activation (the ring's receipt and its own), the
        # middle's (three), the ring's (the tail's receipt alone) and the token to the asker (the whole
        # route's, four)
        sizes = {"head_to_mid": receipt_bytes(chain[:2]), "mid_to_tail": receipt_bytes(chain[:3]),
                 "tail_ring_to_head": receipt_bytes(chain[-1:]), "tail_to_asker": receipt_bytes(chain)}
        width = nodes["mid"].service.report.stage_width
        # a spot check moves, per token of each range past the head: the row fetched, fed to the replica
        # (about its size each: raw f32), and the replica's receipt back
        receipt_one = len(encode(Receipts(session=chain[0].session, epoch=chain[0].epoch, chain=pack_chain(chain[-1:]))))
        step_input = len(encode(Inputs(session=chain[0].session, epoch=chain[0].epoch, steps=[]))) + 4 * width + 96
        spot = 2 * (2 * step_input) + 3 * receipt_one

        # (a) steps until caught
        attacker = FlippingAttacker(nodes["mid"].service)
        caught: list[int] = []
        missed = 0
        identical = True
        clean: dict[str, AskResult] = {}
        for run in range(runs):
            prompt = PROMPTS[run % len(PROMPTS)]
            request = AskRequest(messages=[{"role": "user", "content": prompt}], max_tokens=tokens)
            if prompt not in clean:
                with trio.fail_after(600):
                    clean[prompt] = await run_session(peers, [route[0], apart["mid2"], route[2]], request,
                                                      AskResult(), stall_timeout=120)
            lie_at = rng.randrange(2, tokens // 2)
            attacker.arm(lie_at)
            checker = Verifier(peers, CheckPlan(every=EVERY, candidates=replicas, rng=random.Random(rng.random())))
            with trio.fail_after(600):
                answer = await ask_with_failover(peers, find, request, stall_timeout=120, verifier=checker)
            identical = identical and answer.tokens == clean[prompt].tokens
            if checker.caught_at:
                caught.append(checker.caught_at[0] - lie_at)
            else:
                missed += 1
            print(json.dumps({"run": run, "lie_at_step": lie_at, "caught_after": caught[-1] if checker.caught_at
                              else None, "proofs": len(checker.proofs), "identical": answer.tokens == clean[prompt].tokens,
                              "unverified": answer.unverified}),
                  file=sys.stderr, flush=True)
            attacker.arm(0)
    return {
        "every": EVERY,
        "caught": {"runs": runs, "caught": len(caught), "missed": missed,
                   "median_steps": statistics.median(caught) if caught else None,
                   "max_steps": max(caught) if caught else None, "answers_identical": identical},
        "decode_tok_s": {"off": statistics.median(rates["off"]), "receipts": statistics.median(rates["receipts"]),
                         "verify": statistics.median(rates["verify"]),
                         "receipts_slowdown": 1 - statistics.median(rates["receipts"]) / statistics.median(rates["off"]),
                         "slowdown": 1 - statistics.median(rates["verify"]) / statistics.median(rates["off"]),
                         "samples": len(rates["off"])},
        "cpu": {"pinning": pinning,
                "event_loop_ms_per_token": {m: 1000 * loop_cpu[m] / max(1, decoded[m]) for m in loop_cpu},
                "route_workers_ms_per_token": {m: 1000 * route_cpu[m] / max(1, decoded[m]) for m in route_cpu},
                "replica_steps_replayed": replayed,
                "replica_ms_per_replayed_step": 1000 * replica_cpu / replayed if replayed else None},
        "bytes_per_token": {"receipts": sizes, "receipts_total": sum(sizes.values()),
                            "spot_checks_at_1_in_16": spot / EVERY, "row_bytes": 4 * width},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help="runs with a lying stage (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per answer of those runs (default: %(default)s)")
    ap.add_argument("--rate-tokens", type=int, default=64, help="new tokens per answer for tok/s (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds over the prompts for tok/s (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=14, help="seed of the lies' steps and the checks' draws")
    ap.add_argument("--no-pin", action="store_true", help="leave every engine worker on every CPU")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    ap.add_argument("--serve-replicas", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_replicas:
        trio.run(serve_replicas)
        return 0
    out = trio.run(bench, args.runs, args.tokens, args.rate_tokens, args.repeats, args.seed, not args.no_pin)
    c, r, b = out["caught"], out["decode_tok_s"], out["bytes_per_token"]
    print(json.dumps(out, indent=2))
    print("| figure | value |")
    print("|---|---|")
    print(f"| lying stage caught (1 in {out['every']}) | {c['caught']}/{c['runs']} runs, median {c['median_steps']} "
          f"steps after the lie, max {c['max_steps']}; answers identical: {c['answers_identical']} |")
    print(f"| decode tok/s, 3 stages, off | {r['off']:.1f} |")
    print(f"| decode tok/s, 3 stages, receipts only (--verify 0 would be off) | {r['receipts']:.1f} "
          f"({r['receipts_slowdown']:+.1%} slower) |")
    print(f"| decode tok/s, 3 stages, verify 1 in {out['every']} | {r['verify']:.1f} ({r['slowdown']:+.1%} slower) |")
    cpu, loop = out["cpu"], out["cpu"]["event_loop_ms_per_token"]
    print(f"| event loop CPU per token (stages + asker, one process) | off {loop['off']:.1f} ms, receipts "
          f"{loop['receipts']:.1f} ms, verify 1 in {out['every']} {loop['verify']:.1f} ms |")
    workers = cpu["route_workers_ms_per_token"]
    total = {m: loop[m] + workers[m] for m in loop}
    print(f"| CPU per token, route and asker (event loop + the route's engine workers) | off {total['off']:.1f} ms, receipts "
          f"{total['receipts']:.1f} ms ({total['receipts'] / total['off'] - 1:+.1%}), verify 1 in {out['every']} "
          f"{total['verify']:.1f} ms ({total['verify'] / total['off'] - 1:+.1%}) |")
    per_step = cpu["replica_ms_per_replayed_step"]
    print(f"| replicas' CPU per replayed step (stage services and engine workers; other machines in a mesh) | "
          f"{'-' if per_step is None else f'{per_step:.1f} ms'} over {cpu['replica_steps_replayed']} steps "
          f"({cpu['pinning']}) |")
    parts = ", ".join(f"{k} {v}" for k, v in b["receipts"].items())
    print(f"| signed hashes, bytes per token | {b['receipts_total']} ({parts}) |")
    print(f"| spot checks, bytes per token | {b['spot_checks_at_1_in_16']:.0f} (rows of {b['row_bytes']} bytes) |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
