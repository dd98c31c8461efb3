"""Volunteers behind real NATs serve through relays: network namespaces, veth pairs, iptables MASQUERADE.

    pub namespace: seed 10.201.0.1, relays .2 and .3, the asker (addresses on its loopback)
      ├─ veth 10.201.1.0/24 ─ router r1 (MASQUERADE --random-fully, drops new inbound) ─ 10.202.1.0/24 ─ home h1: volunteer
      └─ veth 10.201.2.0/24 ─ router r2 (MASQUERADE --random-fully, drops new inbound) ─ 10.202.2.0/24 ─ home h2: volunteer
    (``build_homes``, which tests/test_punch_netns.py builds its homes with too)

The public segment even has routes to the home subnets, so what keeps it out
is the routers' NAT, as at home. Traffic goes only to addresses inside these
namespaces.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import netns
import pytest
from localmesh import spawn, terminate_together
from netns import Process, StatusProbe, sh

pytestmark = pytest.mark.slow  # five namespaces, relays and daemons

PROMPT = "Write a short story about a lighthouse keeper named CANARY-5f3a9c-KEEPER."
CANARY = b"CANARY-5f3a9c"
NEW_TOKENS = 24
# Hidden states of NEW_TOKENS steps from head to tail: 576 floats a token, f32.
HIDDEN_BYTES = NEW_TOKENS * 576 * 4
SEED = "10.201.0.1:7000"
RELAYS = ("10.201.0.2:7001", "10.201.0.3:7002")
HOMES = ("10.202.1.2:7100", "10.202.2.2:7100")
KV = ["--max-sessions", "2", "--session-tokens", "512"]
# Two volunteers, each too small for the whole model: the tracker splits it across them.
VOLUNTEER = ["--memory", "110M", "--threads", "1", *KV]


@dataclass
class Topology:
    tag: str
    base: Path
    namespaces: dict[str, str] = field(default_factory=dict)
    veths: list[str] = field(default_factory=list)
    processes: dict[str, Process] = field(default_factory=dict)
    probes: dict[str, StatusProbe] = field(default_factory=dict)

    def ns(self, role: str) -> str:
        return self.namespaces[role]

    def exec(self, role: str, *argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.ns(role), *argv], capture_output=True, text=True,
                              timeout=timeout, env=os.environ | {"PYTHONUNBUFFERED": "1"})

    def meshd(self, role: str, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
        return self.exec(role, sys.executable, "-m", "meshd.cli", *args, timeout=timeout)

    def start(self, name: str, role: str, *args: str, timeout: float = 90.0,
              env: dict[str, str] | None = None) -> Process:
        """`meshd ARGS` in ``role``'s namespace, once it prints its ready line."""
        return self.launch(name, role, *args, env=env).wait_ready(timeout)

    def launch(self, name: str, role: str, *args: str, env: dict[str, str] | None = None) -> Process:
        """`meshd ARGS` in ``role``'s namespace, at once (wait_ready waits for its ready line)."""
        log = self.base / f"{name}.log"
        with log.open("w") as out:
            proc = spawn(["ip", "netns", "exec", self.ns(role), sys.executable, "-m", "meshd.cli", *args],
                         stdout=out, stderr=subprocess.STDOUT, text=True,
                         env=os.environ | {"PYTHONUNBUFFERED": "1", "MESHD_LOG": "INFO"} | (env or {}))
        process = Process(name, proc, log)
        self.processes[name] = process
        return process

    def probe(self, role: str) -> StatusProbe:
        """The lasting status asker in ``role``'s namespace."""
        if role not in self.probes:
            self.probes[role] = StatusProbe(self.ns(role))
        return self.probes[role]

    def logs(self) -> str:
        return "\n".join(f"----- {p.name}\n{p.log.read_text()[-4000:]}" for p in self.processes.values())


def build_homes(topo: Topology, public: Sequence[str], wan: str, lan: str, symmetric: bool = False) -> None:
    """Five namespaces: pub, the public segment, with the hosts of ``public`` on its loopback, and two homes
    h1 and h2 (``lan``.i.2) behind routers r1 and r2 (``wan``.i.2 on pub's ``wan``.i.0/24). The routers
    MASQUERADE (``symmetric``: with --random-fully, a symmetric NAT) and drop what nobody inside asked for,
    to themselves too, as most home routers do."""
    t = topo.tag
    for role in ("pub", "r1", "r2", "h1", "h2"):
        name = netns.name(t, role)
        sh("ip", "netns", "add", name)
        topo.namespaces[role] = name
        sh("ip", "-n", name, "link", "set", "lo", "up")
    pub = topo.ns("pub")
    for address in public:
        sh("ip", "-n", pub, "addr", "add", f"{address.split(':')[0]}/32", "dev", "lo")
    # the public segment routes between the homes' routers, as the internet does
    sh("ip", "netns", "exec", pub, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")

    def veth(a_role: str, a_addr: str, b_role: str, b_addr: str, label: str) -> tuple[str, str]:
        a, b = f"m{t}{label}a", f"m{t}{label}b"
        sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        topo.veths.append(a)
        for dev, role, addr in ((a, a_role, a_addr), (b, b_role, b_addr)):
            sh("ip", "link", "set", dev, "netns", topo.ns(role))
            sh("ip", "-n", topo.ns(role), "addr", "add", addr, "dev", dev)
            sh("ip", "-n", topo.ns(role), "link", "set", dev, "up")
        return a, b

    for i in (1, 2):
        router, home = topo.ns(f"r{i}"), topo.ns(f"h{i}")
        _, uplink = veth("pub", f"{wan}.{i}.1/24", f"r{i}", f"{wan}.{i}.2/24", f"u{i}")
        veth(f"r{i}", f"{lan}.{i}.1/24", f"h{i}", f"{lan}.{i}.2/24", f"h{i}")
        sh("ip", "-n", router, "route", "add", "default", "via", f"{wan}.{i}.1")
        sh("ip", "-n", home, "route", "add", "default", "via", f"{lan}.{i}.1")
        sh("ip", "-n", pub, "route", "add", f"{lan}.{i}.0/24", "via", f"{wan}.{i}.2")
        # /proc rather than sysctl(8), which minimal images lack; the setting is per namespace.
        sh("ip", "netns", "exec", router, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        ipt = ["ip", "netns", "exec", router, "iptables"]
        sh(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", uplink, "-j", "MASQUERADE",
           *(["--random-fully"] if symmetric else []))
        for chain in ("FORWARD", "INPUT"):
            sh(*ipt, "-A", chain, "-i", uplink, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
               "-j", "ACCEPT")
            sh(*ipt, "-A", chain, "-i", uplink, "-j", "DROP")


def tear_down(topo: Topology) -> None:
    """Every step runs even if one before it fails (first failure raised at the end)."""
    with contextlib.ExitStack() as stack:
        # callbacks run last-in first-out: processes, then namespaces, then stray veths
        for dev in topo.veths:
            # Gone with its namespace, unless setup failed before moving it there.
            stack.callback(subprocess.run, ["ip", "link", "del", dev], capture_output=True, timeout=30)
        for name in topo.namespaces.values():
            stack.callback(subprocess.run, ["ip", "netns", "del", name], capture_output=True, timeout=30)
        for process in topo.processes.values():
            stack.callback(process.stop)
        for probe in topo.probes.values():
            stack.callback(probe.stop)
        # first of all (and so registered last): every process told to leave at once, not one after another
        stack.callback(terminate_together, [p.proc for p in topo.processes.values()])


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    netns.require()
    netns.remove_stale()
    if shutil.which("iptables") is None:
        pytest.fail("iptables is missing (tools/dev installs it)")
    topo = Topology(secrets.token_hex(3), tmp_path_factory.mktemp("netns"))
    try:
        # symmetric NATs: no hole punch between the homes opens, so the relays carry the stages' traffic
        # (tests/test_punch_netns.py has the homes behind port-preserving NATs)
        build_homes(topo, (SEED, *RELAYS, "10.201.0.4:0"), "10.201", "10.202", symmetric=True)
        topo.start("seed", "pub", "join", "--no-model", "--listen", SEED, "--state-dir", str(topo.base / "seed"), *KV)
        # the relays and volunteers start side by side
        started = [topo.launch(f"relay{i}", "pub", "relay", "--listen", address, "--seed", SEED,
                               "--state-dir", str(topo.base / f"relay{i}"), "--tap", str(topo.base / f"relay{i}.tap"))
                   for i, address in enumerate(RELAYS)]
        started += [topo.launch(f"v{i}", f"h{i}", "join", "--seed", SEED, "--listen", address,
                                "--state-dir", str(topo.base / f"v{i}"), *VOLUNTEER)
                    for i, address in enumerate(HOMES, start=1)]
        for process in started:
            process.wait_ready(90.0)
        yield topo
    finally:
        tear_down(topo)


@pytest.fixture(scope="module")
def expected(default_model: Path) -> str:
    """The whole model's greedy answer on the chat template `meshd ask` renders (the model's own)."""
    from meshd.engine import Model
    from tests.conftest import greedy_chat_reference

    with Model(default_model) as m:
        return m.detokenize(greedy_chat_reference(default_model, [PROMPT], NEW_TOKENS)[PROMPT])


def status_at(topo: Topology, role: str, address: str) -> dict[str, Any]:
    """What `meshd status --json` says of the node at ``address``, asked from namespace ``role`` ({} while it
    cannot answer)."""
    return topo.probe(role).status(address)


def status(topo: Topology) -> dict[str, Any]:
    """`meshd status --json` from the public segment ({} while it cannot answer)."""
    return status_at(topo, "pub", SEED)


def home_links(topo: Topology, homes: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each home's (h1's, h2's, listening at ``homes``) view of its link to the other home ({} while there is none)."""
    views = [status_at(topo, f"h{i}", address) for i, address in enumerate(homes, start=1)]
    ids = [v.get("node_id") for v in views]
    found = []
    for view, other in zip(views, reversed(ids), strict=True):
        found.append(next((link for link in view.get("links", []) if link["node_id"] == other), {}))
    return found[0], found[1]


def behind_nat(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in doc.get("members", []) if m["reachability"] == "nat"]


def covered(doc: dict[str, Any]) -> bool:
    return any(c["covered"] and c["n_layers"] == 30 for c in doc.get("coverage", []))


def relayed(doc: dict[str, Any], through: tuple[str, ...]) -> bool:
    """Both volunteers are behind NAT and advertise circuits through exactly the relays ``through``."""
    members = behind_nat(doc)
    if len(members) != 2:
        return False
    for m in members:
        via = m["relay_addresses"]
        if sorted(a.split("/p2p-circuit/")[0] for a in via if "/p2p-circuit/" in a) != sorted(through):
            return False
    return True


def wait_for(topo: Topology, ok, what: str, timeout: float) -> tuple[dict[str, Any], float]:
    began = time.monotonic()
    text: dict[str, Any] = {}
    for _ in range(int(timeout)):
        if time.monotonic() - began > timeout:
            break
        text = status(topo)
        if ok(text):
            return text, time.monotonic() - began
        time.sleep(1.0)
    raise AssertionError(f"{what} not within {timeout:.0f} s; last status:\n{text}\n{topo.logs()}")


def tap_bytes(topo: Topology, i: int) -> bytes:
    path = topo.base / f"relay{i}.tap"
    return path.read_bytes() if path.exists() else b""


def ask(topo: Topology) -> tuple[str, str]:
    asked = topo.meshd("pub", "ask", "--seed", SEED, "--max-tokens", str(NEW_TOKENS), "--timeout", "60", PROMPT,
                       timeout=240)
    assert asked.returncode == 0, f"{asked.stderr}\n{topo.logs()}"
    return asked.stdout.rstrip("\n"), asked.stderr


ROUTE = """
import sys, trio
from meshd.net.rpc import mesh_rpc
from meshd.net.peers import open_peers
from wire.identity import NodeIdentity
from wire.meshrpc import RouteRequest

async def main():
    async with open_peers(NodeIdentity.generate()) as peers:
        reply = await mesh_rpc(peers, sys.argv[1], RouteRequest(), timeout=20)
        for stage in reply.stages:
            print(stage.start, stage.end, stage.address)

trio.run(main)
"""


def route(topo: Topology) -> list[str]:
    """The stage addresses the seed hands an asker."""
    found = topo.exec("pub", sys.executable, "-c", ROUTE, SEED)
    assert found.returncode == 0, found.stderr
    return [line.split()[2] for line in found.stdout.splitlines()]


def assert_opaque(forwarded: bytes, answer: str) -> None:
    assert CANARY not in forwarded
    text = answer.encode()
    for start in range(0, max(1, len(text) - 16), 8):
        assert text[start:start + 16] not in forwarded


def test_homes_behind_symmetric_nats_try_a_punch_stay_relayed_and_the_relays_carry_the_stage_bytes(
        topology: Topology) -> None:
    """The counterpart of tests/test_punch_netns.py's port-preserving NATs: each home's link to the other is
    made (SWIM) and a hole punch tried over a relay's circuit; every round fails, the link stays relayed, and
    an ask's hidden states cross the relays, with no fast path between the stages."""
    topo = topology
    _, took = wait_for(topo, lambda s: covered(s) and len(behind_nat(s)) == 2 and
                       all(m["relay_addresses"] for m in behind_nat(s)),
                       "both homes reserved on a relay and the model covered", 180)
    print(f"\nsymmetric NATs: covered after {took:.1f} s")
    began = time.monotonic()
    while not all(link.get("path") == "relayed" for link in home_links(topo, HOMES)):
        assert time.monotonic() - began < 60, f"relayed links not within 60 s\n{topo.logs()}"
        time.sleep(1.0)
    # every round of a punch failed (each bounded by its timeouts), and the link stays relayed after
    while "staying relayed" not in topo.logs():
        assert time.monotonic() - began < 120, f"no failed punch within 120 s\n{topo.logs()}"
        time.sleep(1.0)
    links = home_links(topo, HOMES)
    print(f"h1 -> h2: {links[0]}\nh2 -> h1: {links[1]}")
    assert [link["path"] for link in links] == ["relayed", "relayed"], links
    assert "hole punch to" in topo.logs()

    def relayed_bytes() -> int:
        return sum(status_at(topo, "pub", relay).get("relayed_bytes") or 0 for relay in RELAYS)

    before, tap_before = relayed_bytes(), sum(len(tap_bytes(topo, i)) for i in range(2))
    answer, figures = ask(topo)
    grown = relayed_bytes() - before
    tapped = sum(len(tap_bytes(topo, i)) for i in range(2)) - tap_before
    print(f"ask: {len(answer)} chars; the relays forwarded {grown} bytes (taps {tapped}); hidden states alone "
          f"are {HIDDEN_BYTES} bytes; {figures.strip()}")
    assert len(answer.strip()) > 20
    # the relays' own counters (status) and their taps (every chunk forwarded) agree, but for keepalives
    # between the reads
    assert abs(grown - tapped) < 2 * 4096, (grown, tapped)
    volunteers = "".join(topo.processes[f"v{i}"].log.read_text() for i in (1, 2))
    # the stages said at the session's open that a relay's circuit is their hop, and the ask went on on the
    # daemons' path, through a relay
    assert "fast path to" not in volunteers
    assert grown > HIDDEN_BYTES


def test_volunteers_behind_nat_serve_through_relays(topology: Topology, expected: str) -> None:
    topo = topology
    shown, took = wait_for(topo, lambda s: covered(s) and relayed(s, RELAYS),
                           "both volunteers reserved on both relays and the model covered", 180)
    print(f"\nmesh up, volunteers behind NAT reserved on both relays, model covered {took:.1f} s after the last daemon started")
    assert len(behind_nat(shown)) == 2 and shown["tracker"] is not None
    [model] = shown["coverage"]
    assert len(model["assigned"]) == 2 and not any("[0, 30)" in a for a in model["assigned"]), shown

    # The NAT keeps the public segment out, though the volunteers listen and it has a route to them.
    for i, home in enumerate(HOMES, start=1):
        host, port = home.split(":")
        probe = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)\n"
                 "except OSError as e:\n print('refused', e)\nelse:\n print('connected')")
        outside = topo.exec("pub", sys.executable, "-c", probe, host, port)
        inside = topo.exec(f"h{i}", sys.executable, "-c", probe, host, port)
        assert "refused" in outside.stdout, outside
        assert "connected" in inside.stdout, inside

    stage_addresses = route(topo)
    assert len(stage_addresses) == 2 and all("/p2p-circuit/" in a for a in stage_addresses), stage_addresses
    print(f"route: {stage_addresses}")
    before = [len(tap_bytes(topo, i)) for i in range(2)]
    answer, figures = ask(topo)
    print(f"asked through the relays: {figures.strip()}")
    assert answer.strip() == expected.strip() and len(answer) > 20
    taps = [tap_bytes(topo, i) for i in range(2)]
    grown = [len(taps[i]) - before[i] for i in range(2)]
    # Hidden states of ~NEW_TOKENS steps cross from head to tail (576 floats a token), then tokens come back.
    assert sum(grown) > HIDDEN_BYTES, grown
    for forwarded in taps:
        assert_opaque(forwarded, answer)

    # SIGKILL the relay the volunteers are reached through; they keep only the other, and asks go on.
    used = max(range(2), key=lambda i: grown[i])
    victim, spare = topo.processes[f"relay{used}"], RELAYS[1 - used]
    began = time.monotonic()
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    _, moved = wait_for(topo, lambda s: relayed(s, (spare,)), "volunteers moved to the other relay", 60)
    print(f"SIGKILL relay {RELAYS[used]}: both volunteers reachable only through {spare} after {moved:.1f} s")
    before_spare = len(tap_bytes(topo, 1 - used))
    answer_after, figures = ask(topo)
    print(f"asked again after the kill ({time.monotonic() - began:.1f} s after it): {figures.strip()}")
    assert answer_after.strip() == expected.strip()
    spare_tap = tap_bytes(topo, 1 - used)
    assert len(spare_tap) - before_spare > HIDDEN_BYTES
    assert_opaque(spare_tap, answer_after)
