"""Round trips over a relayed link against a punched one, between two homes behind MASQUERADE NATs.

Network namespaces (root): a relay on a public segment, homes h1 and h2 behind routers that
MASQUERADE (port-preserving) and drop what nobody inside asked for. In h2 two targets reserve on
the relay, one that never punches (the baseline: every byte through the relay) and one that does;
a dialer in h1 reaches each through its circuit and times ``--pings`` round trips of 64 bytes on
one stream (after the punch, for the second). Prints medians and their ratio; ``--json`` writes
the result (schema meshd-bench/1).

    sudo .venv/bin/python tools/punch_rtt.py [--pings 500] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchlib.procs import median
from benchlib.result import fail, parser, publish

KEY = b"punch-rtt mesh key"
ECHO = "bench/echo"
RELAY = "10.211.0.2:7001"


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def build(tag: str) -> tuple[dict[str, str], list[str]]:
    """The namespaces by role, and the veths made (gone with their namespaces)."""
    ns = {role: f"mpr{tag}-{role}" for role in ("pub", "r1", "r2", "h1", "h2")}
    veths: list[str] = []
    for name in ns.values():
        sh("ip", "netns", "add", name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
    sh("ip", "-n", ns["pub"], "addr", "add", f"{RELAY.split(':')[0]}/32", "dev", "lo")
    sh("ip", "netns", "exec", ns["pub"], "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
    for i in (1, 2):
        uplink = f"mpr{tag}u{i}b"
        for a, a_role, a_addr, b, b_role, b_addr in (
                (f"mpr{tag}u{i}a", "pub", f"10.211.{i}.1/24", uplink, f"r{i}", f"10.211.{i}.2/24"),
                (f"mpr{tag}h{i}a", f"r{i}", f"10.212.{i}.1/24", f"mpr{tag}h{i}b", f"h{i}", f"10.212.{i}.2/24")):
            sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            veths.append(a)
            for dev, role, addr in ((a, a_role, a_addr), (b, b_role, b_addr)):
                sh("ip", "link", "set", dev, "netns", ns[role])
                sh("ip", "-n", ns[role], "addr", "add", addr, "dev", dev)
                sh("ip", "-n", ns[role], "link", "set", dev, "up")
        sh("ip", "-n", ns[f"r{i}"], "route", "add", "default", "via", f"10.211.{i}.1")
        sh("ip", "-n", ns[f"h{i}"], "route", "add", "default", "via", f"10.212.{i}.1")
        sh("ip", "-n", ns["pub"], "route", "add", f"10.212.{i}.0/24", "via", f"10.211.{i}.2")
        sh("ip", "netns", "exec", ns[f"r{i}"], "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        ipt = ["ip", "netns", "exec", ns[f"r{i}"], "iptables"]
        sh(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", uplink, "-j", "MASQUERADE")
        for chain in ("FORWARD", "INPUT"):
            sh(*ipt, "-A", chain, "-i", uplink, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
            sh(*ipt, "-A", chain, "-i", uplink, "-j", "DROP")
    return ns, veths


async def node(role: str, listen: str, relay_id: str, target: str, pings: int) -> None:
    """One process of the run: the relay, a target (`punch` or `relayed`) or the dialer."""
    import logging

    import trio

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from meshd.net.link import LinkTimings
    from meshd.net.peers import PeersConfig, open_peers
    from meshd.net.stream import Stream
    from meshd.relay.circuit import enable_circuits
    from meshd.relay.punch import Puncher
    from meshd.relay.reservations import RelayCandidate, ReservationKeeper
    from meshd.relay.service import RelayService
    from wire.identity import NodeIdentity

    async def echo(stream: Stream) -> None:
        while data := await stream.receive_some():
            await stream.send_all(data)

    config = PeersConfig(mesh_key=KEY, timings=LinkTimings(keepalive_interval=300, dead_after=900))
    async with open_peers(NodeIdentity.generate(), config) as peers, trio.open_nursery() as nursery:
        peers.handle(ECHO, echo)
        host, port = listen.rsplit(":", 1)
        await peers.listen(host, int(port))
        puncher = Puncher(peers)
        keeper: list[ReservationKeeper] = []
        enable_circuits(peers, lambda relay: bool(keeper) and keeper[0].reserved_on(relay),
                        puncher.initiate if role in ("punch", "dial") else None)
        if role == "relay":
            RelayService(peers)
            print(f"ready {peers.node_id}", flush=True)
            await trio.sleep_forever()
        if role in ("punch", "relayed"):
            keeper.append(ReservationKeeper(peers, lambda: [RelayCandidate(relay_id, RELAY)],
                                            lambda held: print(f"held {held[0]}", flush=True) if held else None))
            nursery.start_soon(keeper[0].run)
            await trio.sleep_forever()
        figures: dict[str, Any] = {}
        for name, address in (("relayed", target.split(",")[0]), ("punched", target.split(",")[1])):
            node_id = address.rsplit("/", 1)[1]
            link = await peers.connect(address, node_id=node_id)
            if name == "punched":
                with trio.fail_after(15):
                    while (link := peers.link_to(node_id) or link).path == "relayed":
                        await trio.sleep(0.05)
            stream = link.open_stream(ECHO)
            samples = []
            for _ in range(pings):
                began = time.perf_counter()
                await stream.send_all(b"x" * 64)
                got = b""
                while len(got) < 64:
                    got += await stream.receive_some()
                samples.append((time.perf_counter() - began) * 1000.0)
            await stream.aclose()
            figures[name] = {"path": link.path, "samples_ms": samples}
        print("figures " + json.dumps(figures), flush=True)
        nursery.cancel_scope.cancel()


LOGS = Path(os.environ.get("TMPDIR", "/tmp"))


def launch(ns: str, role: str, listen: str, *extra: str) -> subprocess.Popen[str]:
    """One node in namespace ``ns``; its stderr (logs, a traceback) in $TMPDIR/punch_rtt-ROLE.log."""
    with (LOGS / f"punch_rtt-{role}.log").open("w") as log:
        return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, __file__, "--node", role, "--listen",
                                 listen, *extra], stdout=subprocess.PIPE, stderr=log, text=True,
                                env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])})


def line(proc: subprocess.Popen[str], prefix: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        text = proc.stdout.readline()
        if text.startswith(prefix):
            return text[len(prefix):].strip()
        if not text and proc.poll() is not None:
            break
    raise RuntimeError(f"no {prefix.strip()!r} line from {proc.args!r} (its log: {LOGS})")


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--pings", type=int, default=500)
    ap.add_argument("--node", help=argparse.SUPPRESS)
    ap.add_argument("--listen", help=argparse.SUPPRESS)
    ap.add_argument("--relay-id", default="", help=argparse.SUPPRESS)
    ap.add_argument("--target", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.node:
        import trio

        trio.run(node, args.node, args.listen, args.relay_id, args.target, args.pings)
        return 0
    if os.geteuid() != 0 or shutil.which("iptables") is None:
        return fail("punch_rtt", "needs root and iptables (network namespaces, NAT)")
    pings = 20 if args.smoke else args.pings
    ns, _ = build(secrets.token_hex(2))
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(relay := launch(ns["pub"], "relay", RELAY))
        relay_id = line(relay, "ready ")
        circuits = []
        for role, port in (("relayed", 7100), ("punch", 7101)):
            procs.append(target := launch(ns["h2"], role, f"10.212.2.2:{port}", "--relay-id", relay_id))
            circuits.append(line(target, "held "))
        procs.append(dialer := launch(ns["h1"], "dial", "10.212.1.2:7100", "--target", ",".join(circuits),
                                      "--pings", str(pings)))
        figures = json.loads(line(dialer, "figures ", 120))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
        for name in ns.values():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    for name in ("relayed", "punched"):
        figures[name]["median_ms"] = median(figures[name]["samples_ms"])
    ratio = figures["relayed"]["median_ms"] / figures["punched"]["median_ms"]
    figures["ratio"] = ratio
    table = "\n".join([f"{pings} round trips of 64 bytes, h1 -> h2, each home behind a MASQUERADE NAT:",
                       *(f"  {name:8} link ({figures[name]['path']}): median {figures[name]['median_ms']:.3f} ms"
                         for name in ("relayed", "punched")),
                       f"  relayed / punched: {ratio:.2f}x"])
    publish("punch_rtt", args, figures, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
