#!/usr/bin/env python3
"""Output verification: how soon a lying stage is caught, what checking costs in tok/s, and the bytes it adds.

Stages of the default model run here (1 thread each, each with its own engine
worker): a 3-stage route of even ranges in this process, and in a process of
their own (as in a mesh, where they are other machines) one replica of the
head and the tail ranges and two of the middle one (a mismatch there is
settled by a third node, which makes a proof).

Every ask takes the default path, the fast one (rows worker to worker, each
stage's daemon signing a receipt per span of 16 positions off the rows' path),
unless it says "daemons' path".

(a) Positions until caught: an attacker serves the route's middle range: its
engine worker (tools/lying_worker.py, meshd's own with its fast path patched,
restarted for each such run) flips one float of its output at a random decode
position, and its daemon signs what was sent as an honest one would; the asker
checks 1 in 16 positions on a chain of replicas (meshd.client.chain_check).
Per run: the positions from the lie until the asker laid it at the attacker,
and whether the answer (regenerated on a route without it) is the undisturbed
one. Each answer's last span is checked once it is in, so every lie is checked;
a run without a catch is a miss (and prints what went unchecked). The runs
take the lies in turn: that flip (a third node settles the mismatch: a proof);
the flip with the attacker's daemon keeping from the check the inputs it then
asks for to settle it (handing over none, all but the last, reordered, or none
within the deadline), which fails the check as surely as a mismatch; and the
attacker's daemon never signing its last span.

(b) Decode tok/s of the honest 3-stage route with verification at 1 in 16,
receipts only and off, and verified on the daemons' path, alternating in one
run; and on the rewriting task (tools/bench_spec.py's) with prompt-lookup
speculation, unverified and verified, against no speculation. As in a mesh, the asker is
another machine than the route's: it runs in a process of its own, with the
replicas (other machines too, which run at the lowest priority, so that
their replays do not slow the asker). Where there are two or more CPUs the
route (this process, whose one event loop runs the three stage services, and
their engine workers) is pinned to all but one, and the asker's and the
replicas' processes and workers to that one. The bench reports, per decode token and mode, the CPU
of the route (its stage services apart), of the asker, and of the replicas per
step a spot check replays. (c) The bytes per decode token that verification
adds, counted from the messages of the verified answers: the receipts the
asker gets (every stage's, a span each), and beside them the inputs spot checks
fetch from the stages under check (as many again go on to a replica).

Usage: .venv/bin/python tools/bench_verify.py [--runs 20] [--tokens 96] [--rate-tokens 64] [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import lying_worker
import trio
from benchlib.procs import pin as pin_threads
from benchlib.procs import process_cpu_ns
from benchlib.result import parser, publish
from benchlib.smoke import use_tiny_model

from meshd.client.ask import AskRequest, AskResult
from meshd.client.audit import SpanAudit
from meshd.client.failover import ask_with_failover
from meshd.client.route import Stage
from meshd.client.session import run_session
from meshd.client.verifier import Verifier
from meshd.client.verify import CheckPlan
from meshd.mesh.models import default_model_path
from meshd.net.peers import PeersConfig, open_peers
from meshd.stage.books import StageLimits
from meshd.stage.node import StageNode, stage_node
from meshd.stage.service import StageService
from meshd.stage.state import Session
from wire.identity import NodeIdentity
from wire.message import encode
from wire.receipt import Receipts
from wire.stage import Inputs, InputsRequest, Seal

RANGES = {"head": (0, 10), "mid": (10, 20), "tail": (20, 30)}
REPLICAS = {"head2": (0, 10), "mid2": (10, 20), "mid3": (10, 20), "tail2": (20, 30)}
PASSAGE = ("The lighthouse keeper climbed the stairs every evening at dusk. He wiped the lens, trimmed the wick "
           "and lit the lamp, and the beam swept across the dark water until morning. Ships far out at sea saw "
           "the light and knew where the rocks were, and in the morning he put the lamp out and slept.")
REWRITE = [f"Repeat the following passage word for word.\n\n{PASSAGE}",
           f"Rewrite the following passage in the present tense.\n\n{PASSAGE}"]
PROMPTS = ["Write a short story about a dragon who learns to cook.",
           "Explain how a bicycle stays upright.",
           "What should I pack for a week of hiking in the mountains?"]
EVERY = 16
ROUTE = ("head", "mid", "tail")
def cpu_seconds(pid: int) -> float:
    """User and system CPU a process has used (an engine worker: where a stage computes)."""
    return process_cpu_ns(pid) / 1e9


def pin(nodes: dict[str, StageNode], replica_pids: list[int]) -> tuple[str, set[int] | None]:
    """The route (this process and its workers) on all CPUs but one, the replicas' process and workers on
    that one; says so, and returns the CPUs that the asker's process is to share with the replicas."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return "not pinned (one CPU)", None
    mine, theirs = set(cpus[:-1]), {cpus[-1]}
    os.sched_setaffinity(0, mine)
    for node in nodes.values():
        pid = node.service.engine.pid
        assert pid is not None
        pin_threads(pid, mine)
    for pid in replica_pids:
        pin_threads(pid, theirs)
    return (f"the asker's process, the replicas' process and their workers on CPU {cpus[-1]}; the route's stage "
            f"services (one process) and engine workers on {sorted(mine)}"), theirs


async def serve_replicas() -> None:
    """The replicas' process: serves REPLICAS, says where on stdout (a JSON line each, then "ready"),
    and ends when stdin closes."""
    # other machines in a mesh: here they take only what CPU the asker (which shares theirs) leaves, so
    # the asker is not slowed by their replays as it would not be on machines of their own (the
    # engine workers they start inherit this)
    os.nice(19)
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
async def child(flag: str) -> AsyncIterator[trio.Process]:
    """This script again, as the process ``flag`` names, its stdin and stdout piped; killed if it has not
    ended 10 s after its stdin closes."""
    proc = await trio.lowlevel.open_process([sys.executable, __file__, flag], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE)
    try:
        yield proc
    finally:
        with trio.CancelScope(shield=True):
            if proc.stdin is not None:
                await proc.stdin.aclose()
            with trio.move_on_after(10):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def read_until(proc: trio.Process, end: bytes, what: str, timeout: float) -> str:
    """What ``proc`` prints up to and including ``end``."""
    assert proc.stdout is not None
    buffered = b""
    with trio.fail_after(timeout):
        while not buffered.endswith(end):
            chunk = await proc.stdout.receive_some()
            if not chunk:
                raise SystemExit(f"{what} ended before it said all (its errors are above)")
            buffered += chunk
    return buffered.decode()


@asynccontextmanager
async def replicas_apart() -> AsyncIterator[tuple[dict[str, Stage], list[int]]]:
    """The replicas in a process of their own: their stages by name, and every pid whose CPU is theirs."""
    async with child("--serve-replicas") as proc:
        stages: dict[str, Stage] = {}
        pids = [proc.pid]
        for line in (await read_until(proc, b"ready\n", "the replicas' process", 300)).splitlines()[:-1]:
            r = json.loads(line)
            stages[r["name"]] = Stage(r["address"], r["node_id"], r["digest"], tuple(r["layers"]))
            pids.append(r["pid"])
        yield stages, pids


def stage_json(stage: Stage) -> dict[str, Any]:
    return {"address": stage.address, "node_id": stage.node_id, "digest": stage.model_digest, "layers": stage.layers}


def stage_from(d: dict[str, Any]) -> Stage:
    return Stage(d["address"], d["node_id"], d["digest"], tuple(d["layers"]))


async def rates_apart(spec: dict[str, Any], cpus: set[int] | None) -> dict[str, Any]:
    """(b) and (c) run by the asker's own process (``ask_apart``), on ``cpus``, while this one serves the route."""
    async with child("--ask-apart") as proc:
        assert proc.stdin is not None
        if cpus is not None:
            os.sched_setaffinity(proc.pid, cpus)
        await proc.stdin.send_all((json.dumps(spec) + "\n").encode())
        figures: dict[str, Any] = json.loads(await read_until(proc, b"\n", "the asker's process", 3600))
        return figures


async def ask_apart() -> None:
    """The asker's process: reads what to ask on stdin (a JSON line), prints the figures of ``rate_runs``."""
    spec = json.loads(await trio.to_thread.run_sync(sys.stdin.readline))
    print(json.dumps(await rate_runs(spec)), flush=True)


MODES = ("off", "receipts", "verify", "daemons")
# the rewriting task: no speculation, prompt lookup unverified, and verified
SPEC_MODES = ("plain", "spec_off", "spec_verify")


async def rate_runs(spec: dict[str, Any]) -> dict[str, Any]:
    """(b) and (c), at the asker: every prompt in every mode, alternating the order, ``repeats`` rounds.

    CPU seconds by mode and part, per decode token: the route (its stage services' process and
    engine workers), its stage services alone, the asker (this process), and the replicas (per step
    replayed), read from /proc around each answer."""
    route, replicas = [stage_from(d) for d in spec["route"]], [stage_from(d) for d in spec["replicas"]]
    route_pids, replica_pids = spec["route_pids"], spec["replica_pids"]
    rng = random.Random(spec["seed"])
    rates: dict[str, list[float]] = {m: [] for m in MODES + SPEC_MODES}
    ttfts: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, dict[str, float]] = {part: dict.fromkeys(MODES, 0.0) for part in ("route", "stages", "asker")}
    decoded = dict.fromkeys(MODES + SPEC_MODES, 0)
    counted = {m: Counts() for m in MODES + SPEC_MODES}
    replica_cpu = 0.0
    replayed = 0

    def spent() -> dict[str, float]:
        return {"route": sum(cpu_seconds(p) for p in route_pids), "stages": cpu_seconds(route_pids[0]),
                "asker": time.process_time(), "replicas": sum(cpu_seconds(p) for p in replica_pids)}

    async def answer(mode: str, request: AskRequest) -> AskResult:
        every = EVERY if "verify" in mode or mode == "daemons" else 0
        verifier = None if mode in ("off", "plain", "spec_off") else Counting(
            peers, CheckPlan(every=every, candidates=replicas, rng=random.Random(rng.random())), counted[mode])
        if mode == "daemons":
            request = dataclasses.replace(request, fast=False)
        if mode.startswith("spec"):
            request = dataclasses.replace(request, speculate="ngram")
        with trio.fail_after(600):
            # (a client takes the tokens: a verified fast ask hands each over once its span's receipts agree,
            # so its time to first token is the client's)
            result = await run_session(peers, route, request, AskResult(), on_token=lambda token, piece: None,
                                       stall_timeout=120, verifier=verifier)
        if every and not result.verified:
            raise SystemExit(f"an honest answer in mode {mode} was not verified: {result.unverified}")
        decoded[mode] += len(result.tokens)
        rates[mode].append(result.decode_rate)
        return result

    async with open_peers(NodeIdentity.generate(), PeersConfig(drain_timeout=0.5)) as peers:
        for round_ in range(spec["repeats"]):
            for i, prompt in enumerate(PROMPTS[:spec["prompts"]]):
                request = AskRequest(messages=[{"role": "user", "content": prompt}], max_tokens=spec["rate_tokens"])
                order = MODES[::1 if (round_ + i) % 2 == 0 else -1]
                answers = {}
                for mode in order:
                    before = spent()
                    answers[mode] = await answer(mode, request)
                    after = spent()
                    for part in cpu:
                        cpu[part][mode] += after[part] - before[part]
                    if mode == "verify":
                        replica_cpu += after["replicas"] - before["replicas"]
                        replayed += counted[mode].compared
                    if answers[mode].ttft is not None:
                        ttfts[mode].append(answers[mode].ttft)
                if len({tuple(a.tokens) for a in answers.values()}) != 1:
                    raise SystemExit(f"verification changed the answer to {prompt[:40]!r}")
            for i, prompt in enumerate(REWRITE[:spec["prompts"]]):
                request = AskRequest(messages=[{"role": "user", "content": prompt}], max_tokens=spec["rate_tokens"])
                answers = {mode: await answer(mode, request)
                           for mode in SPEC_MODES[::1 if (round_ + i) % 2 == 0 else -1]}
                if len({tuple(a.tokens) for a in answers.values()}) != 1:
                    raise SystemExit(f"speculation or its verification changed the answer to {prompt[:40]!r}")
    return {"rates": rates, "ttfts": ttfts, "decoded": decoded,
            "ms_per_token": {part: {m: 1000 * cpu[part][m] / max(1, decoded[m]) for m in MODES} for part in cpu},
            "replica_steps_replayed": replayed,
            "replica_ms_per_replayed_step": 1000 * replica_cpu / replayed if replayed else None,
            "bytes": {m: {"receipts": c.receipts / max(1, decoded[m]), "inputs": c.inputs / max(1, decoded[m])}
                      for m, c in counted.items() if c.receipts}}


def stage_of(node: StageNode) -> Stage:
    r = node.service.report
    return Stage(node.address, node.peers.node_id, node.service.digest, (r.layer_begin, r.layer_end))


# The lies of (a), a run each in turn: a float flipped at a random decode position (only a spot check on a
# replica catches it); that, and the inputs the check then asks for to settle it withheld (none, all but the
# last, reordered, or none in time); and the last span never signed: a check dodged is a check failed
LIES = ("flip", "nothing", "short", "reordered", "late", "seal")


class WithholdingAttacker:
    """Patches an honest stage service into an attacker that keeps its inputs from spot checks, as ``kind``
    says (None: it hands them over as an honest stage does)."""

    def __init__(self, service: StageService) -> None:
        self.service = service
        self.kind: str | None = None
        self.honest_send_inputs = service.signing.send_inputs
        service.signing.send_inputs = self.send_inputs  # type: ignore[method-assign]
        self.honest_seal = service.fast.seal
        service.fast.seal = self.seal  # type: ignore[method-assign]

    async def seal(self, session: Session, msg: Seal) -> None:
        """The asker's word that the answer ended: ``seal`` never signs the last span."""
        if self.kind != "seal":
            await self.honest_seal(session, msg)

    def send_inputs(self, session: Session, msg: InputsRequest) -> None:
        if self.kind is None:
            self.honest_send_inputs(session, msg)
            return
        taken = [s for s in session.kept if s.pos < msg.until]
        session.kept = session.kept[len(taken):]
        if self.kind != "late":
            steps = {"nothing": [], "short": taken[:-1], "reordered": taken[::-1]}[self.kind]
            session.to_asker.send_nowait(Inputs(session=session.book.id, epoch=session.book.epoch, steps=steps))


@dataclass
class Counts:
    """Bytes the asker got for verification: receipts (every stage's, or the chains the tail hands over),
    and the inputs spot checks fetched; and steps compared on replicas."""

    receipts: int = 0
    inputs: int = 0
    compared: int = 0


class CountingInbox:
    """A spot check's inbox, counting the inputs that come into it."""

    def __init__(self, inbox: trio.MemorySendChannel[Inputs], counts: Counts) -> None:
        self.inbox = inbox
        self.counts = counts

    async def send(self, msg: Inputs) -> None:
        self.counts.inputs += len(encode(msg))
        await self.inbox.send(msg)

    def close(self) -> None:
        self.inbox.close()


class Counting(Verifier):
    """A verifier that counts the bytes verification brings the asker (``Counts``); an encode a message,
    a few µs against a token's tens of milliseconds."""

    def __init__(self, peers: Any, plan: CheckPlan, counts: Counts) -> None:
        super().__init__(peers, plan)
        self.counts = counts

    def on_receipts(self, index: int, msg: Receipts) -> None:
        self.counts.receipts += len(encode(msg))
        if isinstance(self.audit, SpanAudit):
            super().on_receipts(index, msg)
        else:
            # (counted here, not again as a chain inside a token)
            Verifier.on_chain(self, msg.session, msg.epoch, msg.chain)

    def on_chain(self, session: str, epoch: int, chain: bytes) -> None:
        # the daemons' path: the chain inside each token (the ones alone come through on_receipts)
        if self.audit is not None and not isinstance(self.audit, SpanAudit):
            self.counts.receipts += len(chain)
        super().on_chain(session, epoch, chain)

    def inbox(self, index: int) -> Any:
        inbox = super().inbox(index)
        return None if inbox is None else CountingInbox(inbox, self.counts)

    async def settle(self, timeout: float) -> None:
        await super().settle(timeout)
        self.counts.compared += self.plan.compared


async def bench(runs: int, tokens: int, rate_tokens: int, repeats: int, seed: int, pin_cpus: bool,
                prompts: int = len(PROMPTS)) -> dict[str, Any]:
    model = default_model_path()
    limits = StageLimits(max_sessions=8, max_session_tokens=1024)
    rng = random.Random(seed)
    async with AsyncExitStack() as stack:
        nodes = {name: await stack.enter_async_context(stage_node(
            model, layers, limits, NodeIdentity.generate(), PeersConfig(drain_timeout=0.5), threads=1))
            for name, layers in RANGES.items()}
        apart, replica_pids = await stack.enter_async_context(replicas_apart())
        peers = await stack.enter_async_context(open_peers(NodeIdentity.generate(), PeersConfig(drain_timeout=0.5)))
        pinning, asker_cpus = pin(nodes, replica_pids) if pin_cpus else ("not pinned", None)
        route = [stage_of(nodes[n]) for n in ROUTE]
        replicas = list(apart.values())
        everyone = route + replicas

        async def find(excluded: list[str]) -> list[Stage]:
            return [next(s for s in everyone if s.layers is not None and s.layers[0] == begin
                         and s.node_id not in excluded) for begin in (0, 10, 20)]

        # (b) and (c): the honest route, verification at 1 in 16 against off, asked from another process
        route_pids = [os.getpid()] + [n.service.engine.pid for n in nodes.values() if n.service.engine.pid is not None]
        b = await rates_apart({"route": [stage_json(s) for s in route], "replicas": [stage_json(s) for s in replicas],
                               "route_pids": route_pids, "replica_pids": replica_pids, "seed": rng.random(),
                               "repeats": repeats, "rate_tokens": rate_tokens, "prompts": prompts,
                               "width": nodes["mid"].service.report.stage_width}, asker_cpus)
        rates = b["rates"]

        # (a) positions until caught
        honest_spec = nodes["mid"].service.engine.spec
        lying = False
        withholder = WithholdingAttacker(nodes["mid"].service)
        caught: list[int] = []
        by_lie = {lie: {"runs": 0, "caught": 0} for lie in LIES}
        missed = 0
        identical = True
        clean: dict[str, AskResult] = {}
        for run in range(runs):
            prompt = PROMPTS[run % len(PROMPTS)]
            lie = LIES[run % len(LIES)]
            request = AskRequest(messages=[{"role": "user", "content": prompt}], max_tokens=tokens)
            if prompt not in clean:
                with trio.fail_after(600):
                    clean[prompt] = await run_session(peers, [route[0], apart["mid2"], route[2]], request,
                                                      AskResult(), stall_timeout=120)
            # every lie but the last span's withheld flips a float, so that the chain's check asks for the
            # attacker's inputs to settle it (withheld, a failed check) or a third node settles it (a proof)
            lie_at = len(clean[prompt].prompt_tokens) + (rng.randrange(2, tokens // 2) if lie != "seal" else 0)
            if lie != "seal":
                await lying_worker.restart_worker(nodes["mid"], lying_worker.lying(honest_spec, lie_at))
                lying = True
            elif lying:
                await lying_worker.restart_worker(nodes["mid"], honest_spec)
                lying = False
            withholder.kind = None if lie == "flip" else lie
            checker = Verifier(peers, CheckPlan(every=EVERY, candidates=replicas, rng=random.Random(rng.random())))
            with trio.fail_after(600):
                answer = await ask_with_failover(peers, find, request, stall_timeout=120, verifier=checker)
            identical = identical and answer.tokens == clean[prompt].tokens
            by_lie[lie]["runs"] += 1
            if nodes["mid"].peers.node_id in checker.liars:
                by_lie[lie]["caught"] += 1
                caught.append(checker.caught_at[0] - lie_at)
            else:
                missed += 1
            print(json.dumps({"run": run, "lie": lie, "lie_at_position": lie_at,
                              "caught_after": caught[-1] if nodes["mid"].peers.node_id in checker.liars else None,
                              "proofs": len(checker.proofs), "identical": answer.tokens == clean[prompt].tokens,
                              "unverified": [str(n) for n in answer.unverified]}),
                  file=sys.stderr, flush=True)
            withholder.kind = None
    return {
        "every": EVERY,
        "caught": {"runs": runs, "caught": len(caught), "missed": missed, "by_lie": by_lie,
                   "median_steps": statistics.median(caught) if caught else None,
                   "max_steps": max(caught) if caught else None, "answers_identical": identical},
        "decode_tok_s": {m: statistics.median(rates[m]) for m in MODES + SPEC_MODES},
        "samples": len(rates["off"]),
        # the route's replicas are known before the session opens (a tracker's route names them), as here
        "ttft_ms": {m: 1000 * statistics.median(b["ttfts"][m]) for m in MODES},
        "cpu": {"pinning": pinning, **{f"{part}_ms_per_token": v for part, v in b["ms_per_token"].items()},
                "replica_steps_replayed": b["replica_steps_replayed"],
                "replica_ms_per_replayed_step": b["replica_ms_per_replayed_step"]},
        "bytes_per_token": b["bytes"],
        "row_bytes": 4 * nodes["mid"].service.report.stage_width,
    }


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=20, help="runs with a lying stage (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per answer of those runs (default: %(default)s)")
    ap.add_argument("--rate-tokens", type=int, default=64, help="new tokens per answer for tok/s (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds over the prompts for tok/s (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=14, help="seed of the lies' steps and the checks' draws")
    ap.add_argument("--no-pin", action="store_true", help="leave every engine worker on every CPU")
    ap.add_argument("--serve-replicas", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ask-apart", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_replicas:
        trio.run(serve_replicas)
        return 0
    if args.ask_apart:
        trio.run(ask_apart)
        return 0
    if args.smoke:  # the smallest run through every part: two lies, one round of short answers, a tiny model
        args.runs, args.tokens, args.rate_tokens, args.repeats = 2, 24, 8, 1
        use_tiny_model()
    # the rates' prompts: every one, or in a smoke run the first of each task
    prompts = 1 if args.smoke else len(PROMPTS)
    out = trio.run(bench, args.runs, args.tokens, args.rate_tokens, args.repeats, args.seed, not args.no_pin, prompts)
    c, r, b = out["caught"], out["decode_tok_s"], out["bytes_per_token"]
    lines: list[str] = []
    say = lines.append
    say("| figure | value |")
    say("|---|---|")
    say(f"| lying stage caught (1 in {out['every']}) | {c['caught']}/{c['runs']} runs, median {c['median_steps']} "
          f"positions after the lie, max {c['max_steps']}; answers identical: {c['answers_identical']} |")
    say("| caught, by lie | " + ", ".join(f"{lie} {n['caught']}/{n['runs']}" for lie, n in c["by_lie"].items()) + " |")
    say(f"| decode tok/s, 3 stages, fast path, unverified | {r['off']:.1f} |")
    say(f"| decode tok/s, fast path, receipts only | {r['receipts']:.1f} ({r['receipts'] / r['off']:.2f}x) |")
    say(f"| decode tok/s, fast path, verify 1 in {out['every']} (the default ask) | {r['verify']:.1f} "
          f"({r['verify'] / r['off']:.2f}x unverified) |")
    say(f"| decode tok/s, daemons' path, verify 1 in {out['every']} | {r['daemons']:.1f} "
          f"({r['daemons'] / r['off']:.2f}x) |")
    say(f"| rewriting task, decode tok/s | no speculation {r['plain']:.1f}; prompt lookup unverified "
          f"{r['spec_off']:.1f} ({r['spec_off'] / r['plain']:.2f}x), verified {r['spec_verify']:.1f} "
          f"({r['spec_verify'] / r['plain']:.2f}x; {r['spec_verify'] / r['spec_off']:.2f} of unverified's) |")
    t = out["ttft_ms"]
    say(f"| time to first token, ms (median) | unverified {t['off']:.0f}, receipts {t['receipts']:.0f}, verify "
          f"{t['verify']:.0f} ({t['verify'] / t['off']:.2f}x), daemons' path verify {t['daemons']:.0f} |")
    cpu = out["cpu"]

    def by_mode(part: str) -> str:
        ms = cpu[f"{part}_ms_per_token"]
        return ", ".join(f"{m} {ms[m]:.1f} ms" for m in MODES)

    say(f"| route CPU per token (stage services + engine workers) | {by_mode('route')} |")
    say(f"| of which the stage services (one process, one event loop) | {by_mode('stages')} |")
    say(f"| asker CPU per token (a process of its own: another machine) | {by_mode('asker')} |")
    per_step = cpu["replica_ms_per_replayed_step"]
    say(f"| replicas' CPU per span compared, every range of the chain (stage services and engine workers; "
          f"other machines in a mesh) | {'-' if per_step is None else f'{per_step:.1f} ms'} over "
          f"{cpu['replica_steps_replayed']} spans ({cpu['pinning']}) |")
    say("| verification bytes per token at the asker: receipts; spot checks' inputs fetched | " + "; ".join(
        f"{m} {v['receipts']:.0f}, {v['inputs']:.0f}" for m, v in b.items()) + f" (a row is {out['row_bytes']} bytes) |")
    publish("verify", args, out, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
