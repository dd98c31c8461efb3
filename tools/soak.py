#!/usr/bin/env python3
"""Soak and chaos: a mesh of real daemons in network namespaces, asked all along while it is disturbed.

    bridge ─ pub        seed :7000, relay :7400, a no-model member with the HTTP API (:7100, API on its
           │            loopback :8080), and this process (it enters pub's namespace to ask and to poll)
           ├─ d1..dK    volunteers on the bridge; d1's inbound traffic crosses tools/link_emulator.py
           │            (a slow link: this kernel has no netem)
           ├─ nI-nat ─ nI   volunteers at home behind MASQUERADE routers, reached through the relay
           └─ spare     a slot with no volunteer at first: joins come there

Asks run all along: `meshd ask` (greedy, seeded, Ctrl-C'd mid-way) and HTTP through the official `openai`
client (greedy, streamed, seeded, the stream closed mid-way). Meanwhile, at random (``--seed``): volunteers
SIGKILLed, SIGTERMed (a leave), SIGSTOPped then SIGCONTed, their links set down then up, the relay
stopped and continued, and volunteers joining (with their old identity or a new one).

Every greedy answer, and every prefix a cancelled greedy ask showed, is compared with the undisturbed one:
`meshd ask`'s and the API's alike with the whole model's (generated once, here, in-process, on the model's
own chat template, which both front ends render), and every complete seeded answer with the whole model's
with that seed and with the first of its kind. One that differs is wrong. Every failed ask
is kept with the error its user saw, and counts as explained when that was one line (no traceback) and a
disturbance was in force within ``EXPLAIN_WINDOW`` before it. Ghosts: a departed member still in the seed's
or the API member's status more than ``GHOST_BOUND`` after that member's status first showed it dead, left
or gone (or never shown so within ``UNCONFIRMED_BOUND``). RSS and open fds of every daemon (and its engine
worker) are sampled from /proc; growth is counted from the first sample after warm-up.

    sudo .venv/bin/python tools/soak.py --minutes 20 --volunteers 6 --seed 7 --json soak.json
    sudo .venv/bin/python tools/soak.py --smoke        # the CI profile (tests/test_soak.py): each disturbance once

Every process it starts is stopped by its PID and every namespace removed, on success, failure or
Ctrl-C (exit 130). Exit 0 when nothing was wrong, every failure was explained, no ghost was seen and no
daemon's log holds a traceback; 1 otherwise; 2 when it cannot run here.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import trio
from netns_lab import ROOT, Bridge, Process, remove_stale, unavailable
from soak_asks import ASK_STALL, PROMPTS, Asker, Outcome, meshd_command, reference_answers

SEED_ADDR = "10.77.0.1:7000"
RELAY_ADDR = "10.77.0.1:7400"
API_MEMBER = "10.77.0.1:7100"
API_URL = "http://127.0.0.1:8080/v1"
# Volunteers too small for the default model alone: three split it (SmolLM2-135M Q4_1 with this KV).
VOLUNTEER = ["--memory", "64M", "--max-sessions", "2", "--session-tokens", "512", "--threads", "1"]
GHOST_BOUND = 10.0
UNCONFIRMED_BOUND = 60.0
# A failure is put down to a disturbance in force within this before it ended: SWIM's detection (~5 s),
# a re-cut, the new stages' model load and the asker's stall timeout, with room for busy cores.
EXPLAIN_WINDOW = 60.0
# a daemon's own warm-up: ready, its range assigned and loaded, its first sessions served
WARMUP = 60.0


@dataclass
class Profile:
    minutes: float
    volunteers: int
    nat: int
    every: tuple[float, float]  # seconds between disturbances
    outage: tuple[float, float]  # how long a stop, a cut link or a departure lasts
    max_tokens: int
    sample_every: float
    calm: float  # seconds after the chaos for the mesh to settle, before the last checks
    # every kind of disturbance once (the smoke's): the spare's join beside the others, which run one after
    # another in a seeded order, and the chaos ends with the last; otherwise disturbances at random for `minutes`
    scripted: bool = False
    ask_pause: float = 0.5  # seconds an asker waits after an answer before asking again


def profile(args: argparse.Namespace) -> Profile:
    if args.smoke:
        # the CI profile: each kind of disturbance once, short, while two askers ask at a user's pace; no calm
        # beyond the ghost checks' own bounds; --minutes caps the chaos
        return Profile(args.minutes or 2.0, args.volunteers or 4, 1, (1.0, 2.0), (3.0, 5.0), 16, 5.0, 0.0,
                       scripted=True, ask_pause=2.0)
    volunteers = args.volunteers or 6
    return Profile(args.minutes or 10.0, volunteers, max(1, volunteers // 3), (10.0, 25.0), (5.0, 30.0), 32,
                   15.0, 30.0)


# -- what is running -----------------------------------------------------------------------------------

def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return out


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


@dataclass
class Daemon:
    name: str
    role: str
    process: Process
    started: float
    ended: float | None = None
    # (t, daemon's RSS KiB, its children's RSS KiB, daemon's open fds, children's open fds, children's PIDs)
    samples: list[tuple[float, int, int, int, int, tuple[int, ...]]] = field(default_factory=list)
    workers: set[int] = field(default_factory=set)
    slot: Slot | None = None

    @property
    def pid(self) -> int:
        return self.process.proc.pid

    def alive(self) -> bool:
        return self.process.proc.poll() is None


@dataclass
class Slot:
    role: str
    kind: str  # "direct", "slow", "nat" or "spare"
    generation: int = 0
    identity: int = 0  # which state directory (node key) it joins with
    daemon: Daemon | None = None
    disturbed: str = ""  # what is done to it now ("" while nothing)


class Soak:
    def __init__(self, prof: Profile, seed: int, base: Path, model: Path, log_level: str = "info") -> None:
        self.prof = prof
        self.log_env = {"MESHD_LOG": log_level}  # the daemons' (the asks' commands log as a user's do)
        self.rng = random.Random(seed)
        self.seed = seed
        self.base = base
        self.model = model
        self.bridge = Bridge(base)
        self.t0 = time.monotonic()
        self.slots: list[Slot] = []
        self.daemons: list[Daemon] = []
        self.core: dict[str, Daemon] = {}
        self.asks: list[Outcome] = []
        self.events: list[dict[str, Any]] = []
        # (start, end or None while in force, what)
        self.disturbances: list[list[Any]] = []
        self.departed: dict[str, dict[str, Any]] = {}  # node id -> its departure and what views showed
        self.ghosts: list[dict[str, Any]] = []
        self.orphans: list[dict[str, Any]] = []
        self.seeds = [seed * 7 + 1, seed * 7 + 2]
        self.asking = Asker(self.rng, SEED_ADDR, API_URL, prof.max_tokens, self.seeds, {}, self.now, self.log)
        self.http_failovers = 0
        self.chaos_until = 0.0
        self.phase = "setup"
        self.checkpoint: Path | None = None
        self.relay_stopped = False
        self.warm = float("inf")  # when warm-up ends: growth is counted from the first sample after it
        self.identities: dict[tuple[str, int], str] = {}  # (slot, identity) -> its node id

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def log(self, what: str, **detail: Any) -> None:
        self.events.append({"t": self.now(), "event": what, **detail})
        print(f"[{self.now():7.1f}] {what} {' '.join(f'{k}={v}' for k, v in detail.items())}", flush=True)

    # -- building and starting ---------------------------------------------------------------------------

    def build(self) -> None:
        self.bridge.build(["pub"])
        n_direct = self.prof.volunteers - self.prof.nat
        for i in range(1, n_direct + 1):
            self.bridge.add(f"d{i}")
            self.slots.append(Slot(f"d{i}", "slow" if i == 1 else "direct"))
        for i in range(1, self.prof.nat + 1):
            self.bridge.add_behind_nat(f"n{i}", 100 + i)
            self.slots.append(Slot(f"n{i}", "nat"))
        self.bridge.add("spare")
        self.slots.append(Slot("spare", "spare"))

    def start_core(self) -> None:
        home = self.bridge.machines["pub"].home
        self.core["seed"] = self.track("seed", "seed", self.bridge.start("seed", "pub", meshd_command(
            ["join", "--no-model", "--listen", SEED_ADDR, "--state-dir", str(home / "seed")]), env=self.log_env))
        # the others start side by side (main() waits for their ready lines with the volunteers')
        self.core["relay"] = self.track("relay", "relay", self.bridge.launch("relay", "pub", meshd_command(
            ["relay", "--listen", RELAY_ADDR, "--seed", SEED_ADDR, "--state-dir", str(home / "relay")]),
            env=self.log_env))
        self.core["api"] = self.track("api", "api", self.bridge.launch("api", "pub", meshd_command(
            ["join", "--seed", SEED_ADDR, "--no-model", "--listen", API_MEMBER, "--api", "127.0.0.1:8080",
             "--api-stall-timeout", str(ASK_STALL), "--state-dir", str(home / "api")]), env=self.log_env))
        slow = next(s for s in self.slots if s.kind == "slow")
        machine = self.bridge.machines[slow.role]
        # the slow volunteer listens on its loopback; every connection to it crosses a 15 ms (+0-10 ms) link
        link = self.bridge.launch("link-d1", slow.role, [sys.executable, str(ROOT / "tools" / "link_emulator.py"),
                                                        "--listen", f"{machine.ip}:7000", "--to", "127.0.0.1:7001",
                                                        "--delay-ms", "15", "--jitter-ms", "10",
                                                        "--seed", str(self.seed)])
        self.core["link"] = self.track("link", "link", link)
        deadline = time.monotonic() + 60
        while "ready" not in link.text():
            if time.monotonic() > deadline or link.proc.poll() is not None:
                raise SoakError(f"the link emulator did not start: {link.text()[-300:]}")
            time.sleep(0.1)

    def track(self, name: str, role: str, process: Process) -> Daemon:
        daemon = Daemon(name, role, process, self.now())
        self.daemons.append(daemon)
        return daemon

    def launch_volunteer(self, slot: Slot) -> Daemon:
        machine = self.bridge.machines[slot.role]
        slot.generation += 1
        name = f"{slot.role}#{slot.generation}"
        listen = ["--listen", "127.0.0.1:7001", "--advertise", f"{machine.ip}:7000"] if slot.kind == "slow" else \
            ["--listen", f"{machine.ip}:7000"]
        argv = meshd_command(["join", "--seed", SEED_ADDR, *listen, "--model", str(self.model),
                           "--state-dir", str(machine.home / f"state{slot.identity}"), *VOLUNTEER])
        # back with its identity: no longer departed (its row may show it alive before its ready line)
        self.departed.pop(self.identities.get((slot.role, slot.identity), ""), None)
        daemon = self.track(name, "volunteer", self.bridge.launch(name, slot.role, argv, env=self.log_env))
        daemon.slot = slot
        slot.daemon = daemon
        return daemon

    async def ready(self, daemon: Daemon) -> None:
        await trio.to_thread.run_sync(self.wait_ready, daemon)

    def wait_ready(self, daemon: Daemon) -> None:
        daemon.process.wait_ready(180.0)
        self.log("ready", daemon=daemon.name, node=daemon.process.node_id[:12])
        if daemon.slot is not None:
            self.identities[(daemon.slot.role, daemon.slot.identity)] = daemon.process.node_id

    # -- observing -----------------------------------------------------------------------------------------

    async def status(self, peers: Any, address: str) -> Any:
        from meshd.net.rpc import mesh_rpc
        from wire.meshrpc import StatusRequest

        return await mesh_rpc(peers, address, StatusRequest(), timeout=5.0)

    async def covered(self, peers: Any, timeout: float) -> float:
        def reachable(view: Any) -> bool:
            return all(m.reachability != "unknown" and (m.reachability != "nat" or m.relay_addresses)
                       for m in view.members if m.models and m.state == "alive")

        began = time.monotonic()
        with trio.move_on_after(timeout):
            while True:
                try:
                    view = await self.status(peers, SEED_ADDR)
                    # and every volunteer can be dialled, as the seed (the tracker, whose routes name where to
                    # dial each stage) and the API member see it: its reachability known (a member still
                    # "unknown" is dialled at its own address, which behind a NAT reaches nobody: a first ask
                    # then routed around it and found no route) and, behind a NAT, a relay's circuit published
                    if view.coverage and all(c.covered_layers == c.n_layers for c in view.coverage) and \
                            reachable(view) and reachable(await self.status(peers, API_MEMBER)):
                        return time.monotonic() - began
                except Exception:  # the seed or the API member not answering yet: asked again
                    pass
                await trio.sleep(1.0)
        raise SoakError(f"the model was not covered within {timeout:.0f} s")

    def sample(self) -> None:
        t = self.now()
        for daemon in self.daemons:
            if daemon.ended is not None:
                continue
            if not daemon.alive():
                daemon.ended = t
                continue
            kids = children(daemon.pid)
            daemon.workers |= set(kids)
            daemon.samples.append((t, rss_kib(daemon.pid), sum(rss_kib(k) for k in kids), fd_count(daemon.pid),
                                   sum(fd_count(k) for k in kids), tuple(sorted(kids))))

    async def watch(self, peers: Any, until: Callable[[], bool]) -> None:
        """RSS and fds every sample_every s; the status views every second (ghosts)."""
        last_sample = -1e9
        for _ in range(100_000):
            if until():
                return
            if time.monotonic() - last_sample >= self.prof.sample_every:
                last_sample = time.monotonic()
                self.sample()
                if self.checkpoint is not None:  # a long run's figures so far, should it not end well
                    self.checkpoint.write_text(json.dumps(self.report() | {"completed": False}, indent=1))
            for view_name, address in (("seed", SEED_ADDR), ("api", API_MEMBER)):
                try:
                    with trio.fail_after(5):
                        view = await self.status(peers, address)
                except Exception:  # a view that did not answer this time: no evidence either way
                    continue
                self.check_ghosts(view_name, {m.node_id: m.state for m in view.members})
            await trio.sleep(1.0)

    def undecided(self) -> list[str]:
        """Departed members a ghost could still be seen of: a view has not yet shown them gone (and
        UNCONFIRMED_BOUND has not passed since they departed), or showed it less than GHOST_BOUND ago (and a
        round of the watch since)."""
        t = self.now()
        return [node for node, dep in self.departed.items()
                if (len(dep["confirmed"]) < 2 and t - dep["at"] <= UNCONFIRMED_BOUND + 2)
                or any(t - since <= GHOST_BOUND + 2 for since in dep["confirmed"].values())]

    def check_ghosts(self, view: str, rows: dict[str, str]) -> None:
        t = self.now()
        for node, dep in self.departed.items():
            state = rows.get(node)
            confirmed = dep["confirmed"]
            if (state is None or state in ("dead", "left")) and view not in confirmed:
                confirmed[view] = t  # SWIM's confirmation, as this view shows it
                dep["shown"][view] = state or "gone"
            if state is None:
                continue
            since = confirmed.get(view)
            if since is not None and t - since > GHOST_BOUND:
                why = f"listed as {state} {t - since:.1f} s after this view first showed it {dep['shown'][view]}"
            elif since is None and t - dep["at"] > UNCONFIRMED_BOUND:
                why = f"still listed as {state} {t - dep['at']:.0f} s after it departed"
            else:
                continue
            if (node, view) not in {(g["node"], g["view"]) for g in self.ghosts}:
                self.ghosts.append({"t": t, "node": node, "daemon": dep["daemon"], "view": view, "why": why})
                self.log("GHOST", node=node[:12], view=view, why=why)

    async def asker(self, kind: str, modes: list[str], weights: list[float], until: Callable[[], bool]) -> None:
        for _ in range(10_000):
            if until():
                return
            mode = self.rng.choices(modes, weights)[0]
            out = await (self.asking.cli_ask(mode) if kind == "cli" else self.asking.http_ask(mode))
            self.record(out)
            # after a failure a user waits a little before asking again (it fails fast while nothing covers)
            await trio.sleep(max(3.0, self.prof.ask_pause) if out.status == "failed" else self.prof.ask_pause)

    def record(self, out: Outcome) -> None:
        out.t = self.now()  # when it ended
        if out.status == "failed":
            out.explained = self.explained(out)
        self.asks.append(out)
        print(f"[{self.now():7.1f}] {out.kind} {out.mode} {out.status} {out.seconds:.1f}s"
              f"{' failovers=' + str(out.failovers) if out.failovers else ''}{' ' + out.error[:200] if out.error else ''}",
              flush=True)

    def explained(self, out: Outcome) -> bool:
        if not out.error or "\n" in out.error or out.error.startswith("traceback"):
            return False
        began = out.t - out.seconds
        return any(start <= out.t and (end is None or end >= began - EXPLAIN_WINDOW)
                   for start, end, _ in self.disturbances)

    # -- disturbing -------------------------------------------------------------------------------------

    def quiet_slots(self) -> list[Slot]:
        return [s for s in self.slots if s.daemon is not None and s.daemon.alive() and not s.disturbed]

    def disturbed_count(self) -> int:
        """Volunteers disturbed now (the relay stopped disturbs every one behind a NAT)."""
        down = sum(1 for s in self.slots
                   if s.disturbed or (s.kind != "spare" and (s.daemon is None or not s.daemon.alive())))
        return down + (self.prof.nat if self.relay_stopped else 0)

    def begin(self, what: str) -> list[Any]:
        entry: list[Any] = [self.now(), None, what]
        self.disturbances.append(entry)
        return entry

    async def script(self, nursery: trio.Nursery, until: float) -> None:
        """Every kind of disturbance once: a volunteer joins at the spare slot (it takes no one away) while the
        others run in a seeded order, each once the one before it has ended (on the smoke's mesh one volunteer
        is to spare; the relay's stop takes the one behind the NAT)."""
        nursery.start_soon(self.join_spare, next(s for s in self.slots if s.kind == "spare"))
        kinds = ["kill", "leave", "stop", "link", "relay"]
        self.rng.shuffle(kinds)
        for what in kinds:
            await trio.sleep(self.rng.uniform(*self.prof.every))
            if time.monotonic() >= until:
                self.log("skip", why=f"the chaos's time is up before {what}")
                return
            outage = self.rng.uniform(*self.prof.outage)
            if what == "relay":
                await self.stop_relay(outage)
                continue
            slot = self.rng.choice([s for s in self.quiet_slots() if s.kind != "spare"])
            await {"kill": self.depart, "leave": self.depart, "stop": self.stop, "link": self.cut}[what](
                slot, outage, what)

    async def chaos(self, nursery: trio.Nursery, until: float) -> None:
        max_down = max(1, self.prof.volunteers - 3)
        for _ in range(10_000):
            await trio.sleep(self.rng.uniform(*self.prof.every))
            if time.monotonic() >= until:
                return
            spare = next(s for s in self.slots if s.kind == "spare")
            if spare.daemon is None and not spare.disturbed and self.rng.random() < 0.15:
                nursery.start_soon(self.join_spare, spare)
                continue
            if self.disturbed_count() >= max_down:
                self.log("skip", why=f"{self.disturbed_count()} volunteer(s) disturbed already")
                continue
            quiet = [s for s in self.quiet_slots() if s.kind != "spare" or self.rng.random() < 0.5]
            what = self.rng.choices(["kill", "leave", "stop", "link", "relay"], [3, 2, 3, 3, 1])[0]
            if what == "relay":
                if not self.relay_stopped and self.disturbed_count() + self.prof.nat <= max_down:
                    nursery.start_soon(self.stop_relay, self.rng.uniform(*self.prof.outage))
                continue
            if not quiet:
                continue
            slot = self.rng.choice(quiet)
            outage = self.rng.uniform(*self.prof.outage)
            nursery.start_soon({"kill": self.depart, "leave": self.depart, "stop": self.stop,
                                "link": self.cut}[what], slot, outage, what)

    async def stop(self, slot: Slot, outage: float, _: str) -> None:
        assert slot.daemon is not None
        daemon, slot.disturbed = slot.daemon, "stopped"
        entry = self.begin(f"SIGSTOP {daemon.name}")
        pids = [daemon.pid, *children(daemon.pid)]
        self.log("SIGSTOP", daemon=daemon.name, seconds=round(outage, 1))
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            await trio.sleep(outage)
        finally:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            self.log("SIGCONT", daemon=daemon.name)
            entry[1], slot.disturbed = self.now(), ""

    async def cut(self, slot: Slot, outage: float, _: str) -> None:
        assert slot.daemon is not None
        slot.disturbed = "link down"
        entry = self.begin(f"link of {slot.role} down")
        self.log("link down", slot=slot.role, seconds=round(outage, 1))
        self.bridge.link(slot.role, up=False)
        try:
            await trio.sleep(outage)
        finally:
            self.bridge.link(slot.role, up=True)
            self.log("link up", slot=slot.role)
            entry[1], slot.disturbed = self.now(), ""

    async def stop_relay(self, outage: float) -> None:
        relay = self.core["relay"]
        self.relay_stopped = True
        entry = self.begin("SIGSTOP relay")
        self.log("SIGSTOP", daemon="relay", seconds=round(outage, 1))
        os.kill(relay.pid, signal.SIGSTOP)
        try:
            await trio.sleep(outage)
        finally:
            os.kill(relay.pid, signal.SIGCONT)
            self.log("SIGCONT", daemon="relay")
            entry[1], self.relay_stopped = self.now(), False

    async def depart(self, slot: Slot, outage: float, how: str) -> None:
        assert slot.daemon is not None
        daemon, slot.disturbed = slot.daemon, how
        entry = self.begin(f"{how} {daemon.name}")
        workers = children(daemon.pid)
        node = daemon.process.node_id
        self.log("SIGKILL" if how == "kill" else "SIGTERM", daemon=daemon.name, node=node[:12])
        daemon.process.proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGTERM)
        self.departed[node] = {"at": self.now(), "daemon": daemon.name, "how": how, "confirmed": {}, "shown": {}}
        try:
            # reaped: a leave may take its time (the daemon's leave timeout), then it is SIGKILLed
            await trio.to_thread.run_sync(daemon.process.proc.wait, 20.0)
        except Exception:
            daemon.process.proc.kill()
        daemon.ended = self.now()
        # its engine worker must end with it, whatever ended the daemon (its group is killed only below),
        # within 10 s
        with trio.move_on_after(10.0):
            while any(rss_kib(pid) for pid in workers):
                await trio.sleep(0.2)
        left = [pid for pid in workers if rss_kib(pid)]
        if left:
            self.orphans.append({"t": self.now(), "daemon": daemon.name, "how": how, "pids": left})
            self.log("ORPHAN", daemon=daemon.name, pids=left)
        await trio.to_thread.run_sync(daemon.process.stop)
        slot.daemon = None
        if slot.kind == "spare":  # the spare leaves for good: its row must go from every status
            entry[1], slot.disturbed = self.now(), ""
            return
        await trio.sleep(max(0.0, outage - (self.now() - entry[0])))
        if self.rng.random() < 0.5:
            slot.identity += 1  # a new identity: the old one must leave every status for good
        try:
            await self.ready(self.launch_volunteer(slot))
        finally:
            entry[1], slot.disturbed = self.now(), ""

    async def join_spare(self, slot: Slot) -> None:
        slot.disturbed = "joining"
        entry = self.begin(f"join {slot.role}")
        self.log("join", slot=slot.role)
        try:
            await self.ready(self.launch_volunteer(slot))
        finally:
            entry[1], slot.disturbed = self.now(), ""

    async def restore(self) -> None:
        """After the chaos: every slot but the spare serves again."""
        for slot in self.slots:
            if slot.kind != "spare" and (slot.daemon is None or not slot.daemon.alive()):
                await self.ready(self.launch_volunteer(slot))

    # -- the run ----------------------------------------------------------------------------------------

    async def run(self) -> None:
        from meshd.net.peers import open_peers
        from wire.identity import NodeIdentity

        async with open_peers(NodeIdentity.generate()) as peers:
            took = await self.covered(peers, 240)
            self.log("covered", seconds=round(took, 1))
            self.phase = "calm"

            async def http_calm() -> None:
                for prompt in PROMPTS:
                    self.record(await self.asking.http_ask("greedy", prompt))

            async def cli_calm() -> None:
                self.record(await self.asking.cli_ask("greedy"))

            async with trio.open_nursery() as calm:  # the two front ends side by side
                calm.start_soon(cli_calm)
                calm.start_soon(http_calm)
            if any(a.status != "done" for a in self.asks):
                raise SoakError("the undisturbed mesh did not give the whole model's answer: "
                                + "; ".join(f"{a.kind}: {a.error}" for a in self.asks if a.status != "done"))
            before = await self.api_failovers()
            self.phase = "chaos"
            chaos_end = time.monotonic() + self.prof.minutes * 60
            self.warm = self.now() + max(30.0, self.prof.minutes * 60 / 4)
            done = chaos_over = False

            async def scripted() -> None:
                nonlocal chaos_over
                try:
                    async with trio.open_nursery() as joins:
                        await self.script(joins, chaos_end)
                finally:
                    chaos_over = True

            def over() -> bool:
                return chaos_over or time.monotonic() >= chaos_end

            async with trio.open_nursery() as watching:
                watching.start_soon(self.watch, peers, lambda: done)
                async with trio.open_nursery() as nursery:
                    if self.prof.scripted:
                        nursery.start_soon(scripted)
                    else:
                        nursery.start_soon(self.chaos, nursery, chaos_end)
                    nursery.start_soon(self.asker, "cli", ["greedy", "seeded", "cancel"], [6, 2, 2], over)
                    nursery.start_soon(self.asker, "http", ["greedy", "stream", "seeded", "cancel"], [3, 3, 2, 2],
                                       over)
                self.phase = "settle"
                self.log("chaos over")
                await self.restore()
                await trio.sleep(self.prof.calm)
                # until every departed member's ghost check is decided (the watch runs on meanwhile)
                with trio.move_on_after(UNCONFIRMED_BOUND + GHOST_BOUND + 5):
                    while self.undecided():
                        await trio.sleep(0.5)
                took = await self.covered(peers, 120)

                async def last(ask: Callable[[], Awaitable[Outcome]]) -> None:
                    self.record(await ask())

                async with trio.open_nursery() as settled:  # the two front ends side by side
                    settled.start_soon(last, lambda: self.asking.cli_ask("greedy"))
                    settled.start_soon(last, lambda: self.asking.http_ask("stream"))
                self.sample()
                done = True
            self.http_failovers = await self.api_failovers() - before

    async def api_failovers(self) -> int:
        def get() -> int:
            with urllib.request.urlopen(API_URL.removesuffix("/v1") + "/metrics", timeout=10) as reply:
                text = reply.read().decode()
            m = re.search(r"^meshd_failovers_total (\S+)$", text, re.M)
            return int(float(m.group(1))) if m else 0
        return await trio.to_thread.run_sync(get)

    # -- the report -------------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        daemons = {}
        for d in self.daemons:
            # from the first sample after the run's warm-up and after the daemon's own (its model loaded)
            after = [s for s in d.samples if s[0] >= max(self.warm, d.started + WARMUP)]
            entry: dict[str, Any] = {"role": d.role, "node": d.process.node_id, "pid": d.pid, "started": d.started,
                                     "ended": d.ended, "samples": [list(s) for s in d.samples]}
            if len(after) >= 2:
                entry["rss_growth_kib"] = max(s[1] for s in after) - after[0][1]
                entry["fd_growth"] = after[-1][3] - after[0][3]
                # a worker's growth is its own: a re-cut starts a new worker, which loads another range
                worker = [s for s in after if s[5] == after[-1][5]]
                entry["worker_rss_growth_kib"] = max(s[2] for s in worker) - worker[0][2]
                entry["worker_fd_growth"] = worker[-1][4] - worker[0][4]
            daemons[d.name] = entry
        asks = [asdict(a) for a in self.asks]
        count = {s: sum(1 for a in self.asks if a.status == s) for s in ("done", "failed", "wrong", "cancelled")}
        failed = [a for a in asks if a["status"] == "failed"]
        return {
            "profile": asdict(self.prof), "seed": self.seed, "wall_s": self.now(), "logs": str(self.base),
            "asks": count | {"total": len(self.asks), "unexplained": sum(1 for a in failed if not a["explained"])},
            "failovers": {"ask": sum(a.failovers for a in self.asks), "http": self.http_failovers},
            "failures": failed, "wrong": [a for a in asks if a["status"] == "wrong"],
            "seeded_differ": self.asking.seeded_differ,
            "seeded_as_whole_model": {"same": self.asking.seeded_whole[True], "other": self.asking.seeded_whole[False]},
            "ghosts": self.ghosts, "orphans": self.orphans,
            "departures": [{"node": n, **d} for n, d in self.departed.items()],
            "events": self.events, "disturbances": self.disturbances, "daemons": daemons, "ask_log": asks,
        }


class SoakError(Exception):
    pass


def flatten(exc: BaseException) -> list[BaseException]:
    """The exceptions in a (nested) group from trio's nurseries, or the one."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in flatten(e)]
    return [exc]


def interrupted(signum: int, frame: object) -> None:
    """SIGTERM ends a soak as Ctrl-C does: through its clean-up."""
    raise KeyboardInterrupt


def enter_namespace(namespace: str) -> None:
    """This process's network namespace becomes `namespace`'s (threads started later follow it): its asks
    and status polls go from the pub segment, as a client there would."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise SoakError(f"cannot enter {namespace}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


# a log line at info or worse: "<time> <LEVEL> <logger>: <message>"
_TOLD = re.compile(r"^\S+T(\S+)Z (INFO|WARNING|ERROR|CRITICAL) (\S+): (.*)$")


def last_words(daemons: list[Daemon], api_lines: int = 10, lines: int = 3, width: int = 200) -> str:
    """Each daemon's last few log lines at info or worse (the API member's failovers, which name the routes that
    failed, and warnings), short, for a run that went wrong: its workdir may be gone by the time anyone reads
    why."""
    out = ["what each daemon logged last (info and worse):"]
    # the API member's last, nearest the summary (a test shows the output's tail)
    for d in sorted(daemons, key=lambda d: d.role == "api"):
        told = []
        for line in d.process.text().splitlines():
            m = _TOLD.match(line)
            # the API member's failovers and warnings (its spot checks' notes would crowd them out)
            if m and (d.role != "api" or m.group(3) == "meshd.client.failover" or m.group(2) != "INFO"):
                when, level, logger, message = m.groups()
                told.append(f"    {when} {level[0]} {logger.removeprefix('meshd.')}: {message}"[:width])
        keep = told[-(api_lines if d.role == "api" else lines):]
        if keep:
            out += [f"  {d.name}:", *keep]
    return "\n".join(out)


def summary(rep: dict[str, Any]) -> str:
    a = rep["asks"]
    lines = [f"asks {a['total']}: done {a['done']}, cancelled {a['cancelled']}, failed {a['failed']} "
             f"({a['unexplained']} unexplained), wrong {a['wrong']}; failovers: meshd ask {rep['failovers']['ask']}, "
             f"HTTP {rep['failovers']['http']}; seeded answers that differed {len(rep['seeded_differ'])} "
             f"(as the whole model's: {rep['seeded_as_whole_model']['same']} of "
             f"{sum(rep['seeded_as_whole_model'].values())}); "
             f"ghosts {len(rep['ghosts'])}; orphaned workers {len(rep['orphans'])}; {rep['wall_s']:.0f} s"]
    for f in rep["failures"]:
        lines.append(f"  failed at {f['t']:.0f} s ({f['kind']} {f['mode']}, "
                     f"{'explained' if f['explained'] else 'UNEXPLAINED'}): {f['error'][:200]}")
    if rep.get("tracebacks"):
        lines.append(f"  a traceback in the log of {', '.join(rep['tracebacks'])}")
    for name, d in rep["daemons"].items():
        if "rss_growth_kib" in d:
            last = d["samples"][-1]
            lines.append(f"  {name:10} rss {last[1] / 1024:6.1f} MiB (+{d['rss_growth_kib'] / 1024:.1f} after warm-up), "
                         f"worker {last[2] / 1024:6.1f} MiB (+{d['worker_rss_growth_kib'] / 1024:.1f}), "
                         f"fds {last[3]} ({d['fd_growth']:+d}), worker fds {last[4]} ({d['worker_fd_growth']:+d})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=None,
                    help="length of the chaos (default: 10; --smoke: each disturbance once, at most 2)")
    ap.add_argument("--volunteers", type=int, default=None, help="volunteers at the start (default: 6; --smoke: 4)")
    ap.add_argument("--seed", type=int, default=1, help="seed of every random choice (default: 1)")
    ap.add_argument("--json", type=Path, default=None, help="write the whole report here")
    ap.add_argument("--smoke", action="store_true", help="the CI profile: each kind of disturbance once, about a minute")
    ap.add_argument("--log-level", choices=["debug", "info"], default="info",
                    help="the daemons' log level (default: info; debug to read a failing run's stages)")
    ap.add_argument("--workdir", type=Path, default=None, help="logs and homes here (default: a new temporary dir)")
    args = ap.parse_args(argv)
    if args.minutes is not None and not 0 < args.minutes <= 24 * 60:
        ap.error("--minutes must be more than 0 and at most a day")
    if args.volunteers is not None and not 4 <= args.volunteers <= 12:
        ap.error("--volunteers must be 4 to 12 (three 64 MiB volunteers cover the model, one more to disturb)")
    if args.json is not None and not args.json.parent.is_dir():
        ap.error(f"--json: {args.json.parent} is not a directory")
    if os.geteuid() != 0:
        print("soak: network namespaces need root (run it with sudo)", file=sys.stderr)
        return 2
    reason = unavailable()
    if reason is not None:
        print(f"soak: {reason}", file=sys.stderr)
        return 2
    prof = profile(args)
    from meshd.mesh.models import default_model_path

    model = default_model_path()
    base = args.workdir or Path(tempfile.mkdtemp(prefix="meshd-soak-"))
    base.mkdir(parents=True, exist_ok=True)
    soak = Soak(prof, args.seed, base, model, args.log_level)
    soak.checkpoint = args.json
    print(f"soak: {prof}, seed {args.seed}, logs in {base}", flush=True)
    signal.signal(signal.SIGTERM, interrupted)
    code = 0
    try:
        removed = remove_stale()
        if removed:
            print(f"removed stale namespaces: {', '.join(removed)}")
        soak.build()
        enter_namespace(soak.bridge.machines["pub"].namespace)
        soak.start_core()
        started = [soak.launch_volunteer(s) for s in soak.slots if s.kind != "spare"]
        # the whole model's answers while the daemons start
        soak.asking.references = reference_answers(model, prof.max_tokens, soak.seeds)
        for daemon in [soak.core["relay"], soak.core["api"], *started]:
            soak.wait_ready(daemon)
        soak.log("volunteers ready", count=len(started))
        trio.run(soak.run)
    except BaseException as exc:  # noqa: BLE001 - each kind is told below, after the clean-up starts
        leaves = flatten(exc)
        if any(isinstance(e, KeyboardInterrupt) for e in leaves):
            print("soak: interrupted; stopping everything", file=sys.stderr)
            code = 130
        elif all(isinstance(e, SoakError | RuntimeError) for e in leaves):
            for e in leaves:
                print(f"soak: {e}", file=sys.stderr)
            code = 1
        else:
            traceback.print_exception(exc)
            code = 1
    finally:
        errors = soak.bridge.tear_down()
        for error in errors:
            print(f"soak: clean-up: {error}", file=sys.stderr)
    rep = soak.report()
    rep["completed"] = code == 0
    rep["namespaces"] = soak.bridge.namespaces
    # every daemon's log, once all are stopped: a traceback (a leave that raised, say) is a failure a user sees
    rep["tracebacks"] = [d.name for d in soak.daemons if "Traceback" in d.process.text()]
    ok = code == 0 and rep["asks"]["wrong"] == 0 and rep["asks"]["unexplained"] == 0 and not rep["ghosts"] and \
        not rep["tracebacks"]
    rep["ok"] = ok
    if args.json:
        args.json.write_text(json.dumps(rep, indent=1))
    if not ok:
        # what the daemons said last, where the next failure explains itself (CI keeps no workdir)
        print(last_words(soak.daemons), flush=True)
    print(summary(rep))
    return code or (0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
