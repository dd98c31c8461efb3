"""Hole punching between two homes behind real NATs (network namespaces, iptables MASQUERADE).

    pub namespace: seed 10.211.0.1, relay .2, the asker (addresses on its loopback)
      ├─ veth 10.211.1.0/24 ─ router r1 (MASQUERADE; drops what nobody inside asked for) ─ home h1: volunteer
      └─ veth 10.211.2.0/24 ─ router r2 (MASQUERADE; drops what nobody inside asked for) ─ home h2: volunteer

The routers drop unsolicited packets, to themselves too, as most home routers do (a router that
answered an early SYN with a reset would need the punch's timing to beat the other SYN, which needs a
delay on the links that this kernel's missing netem cannot give). With a port-preserving MASQUERADE
the homes' link is punched, and so is the fast path's connection between the two stages
(meshd.net.fastpunch): the head's activations go to the tail's engine worker direct, and the relay's
forwarded bytes grow by the asker's few (it listens nowhere, so stays relayed), not by the hidden
states. With ``MASQUERADE --random-fully`` (a symmetric NAT) the punch fails and the relay carries
all, as before punching: tests/test_relay_netns.py, whose homes are behind symmetric NATs, shows that on its mesh.
"""

from __future__ import annotations

import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import netns
import pytest
from test_relay_netns import HIDDEN_BYTES, NEW_TOKENS, PROMPT, VOLUNTEER, Topology, build_homes, home_links, status_at, tear_down

pytestmark = pytest.mark.slow  # five namespaces, a seed, a relay and two volunteers

SEED = "10.211.0.1:7000"
RELAY = "10.211.0.2:7001"
# A punch that failed (under load, before the NAT's mapping settled) is tried again this long on, not the
# product's 90 s (PunchLimits.retry_after).
PUNCH_RETRY = 10.0
HOMES = ("10.212.1.2:7100", "10.212.2.2:7100")


def start(topo: Topology) -> None:
    topo.start("seed", "pub", "join", "--no-model", "--listen", SEED, "--state-dir", str(topo.base / "seed"),
               "--max-sessions", "2", "--session-tokens", "512")
    # the relay and the volunteers start side by side
    started = [topo.launch("relay", "pub", "relay", "--listen", RELAY, "--seed", SEED,
                           "--state-dir", str(topo.base / "relay"), "--tap", str(topo.base / "relay.tap"))]
    started += [topo.launch(f"v{i}", f"h{i}", "join", "--seed", SEED, "--listen", address,
                            "--state-dir", str(topo.base / f"v{i}"), *VOLUNTEER, "--punch-retry", str(PUNCH_RETRY))
                for i, address in enumerate(HOMES, start=1)]
    for process in started:
        process.wait_ready(90.0)


@pytest.fixture
def homes(tmp_path: Path) -> Iterator[Topology]:
    netns.require()
    netns.remove_stale()
    if shutil.which("iptables") is None:
        pytest.fail("iptables is missing (tools/dev installs it)")
    topo = Topology(secrets.token_hex(3), tmp_path)
    try:
        build_homes(topo, (SEED, RELAY, "10.211.0.4:0"), "10.211", "10.212")
        start(topo)
        yield topo
    finally:
        tear_down(topo)


def covered(topo: Topology) -> bool:
    doc = status_at(topo, "pub", SEED)
    return any(c["covered"] and c["n_layers"] == 30 for c in doc.get("coverage", [])) and \
        sum(m["reachability"] == "nat" and bool(m["relay_addresses"]) for m in doc.get("members", [])) == 2


def wait(topo: Topology, ok: Any, what: str, timeout: float) -> float:
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if ok():
            return time.monotonic() - began
        time.sleep(1.0)
    raise AssertionError(f"{what} not within {timeout:.0f} s\n{topo.logs()}")


def relayed_bytes(topo: Topology) -> int:
    return status_at(topo, "pub", RELAY).get("relayed_bytes") or 0


def test_two_homes_behind_nats_punch_through_and_the_relay_carries_no_stage_bytes(homes: Topology) -> None:
    topo = homes
    took = wait(topo, lambda: covered(topo), "both homes reserved on the relay and the model covered", 180)
    print(f"\nport-preserving NATs: covered after {took:.1f} s")
    # a punch that failed under load is tried again PUNCH_RETRY s on, then twice that
    wait(topo, lambda: all(link.get("path") == "punched" for link in home_links(topo, HOMES)), "punched links",
         6 * PUNCH_RETRY + 60)
    links = home_links(topo, HOMES)
    print(f"h1 -> h2: {links[0]}\nh2 -> h1: {links[1]}")
    assert [link["path"] for link in links] == ["punched", "punched"], links
    assert "went direct to" in topo.logs()

    before = relayed_bytes(topo)
    tap_before = (topo.base / "relay.tap").stat().st_size
    began = time.monotonic()
    asked = topo.meshd("pub", "ask", "--seed", SEED, "--max-tokens", str(NEW_TOKENS), "--timeout", "60", PROMPT,
                       timeout=240)
    assert asked.returncode == 0, f"{asked.stderr}\n{topo.logs()}"
    seconds = time.monotonic() - began
    grown = relayed_bytes(topo) - before
    tapped = (topo.base / "relay.tap").stat().st_size - tap_before
    print(f"ask: {seconds:.1f} s, {len(asked.stdout)} chars; the relay forwarded {grown} bytes "
          f"(tap {tapped}); hidden states alone are {HIDDEN_BYTES} bytes; {asked.stderr.strip()}")
    assert len(asked.stdout.strip()) > 20
    # the relay's own counter (status) and its tap (every chunk it forwarded) agree, but for keepalives
    # between the two reads
    assert abs(grown - tapped) < 4096, (grown, tapped)
    volunteers = "".join(topo.processes[f"v{i}"].log.read_text() for i in (1, 2))
    # the fast path's rows went engine worker to engine worker over a connection punched through both
    # NATs beside the homes' punched link; the relay forwarded only the asker's own exchanges with the
    # two stages (it listens nowhere to punch to), the prompt and the tokens, no hidden states
    assert "punched a connection over the punched link" in volunteers, volunteers[-4000:]
    assert grown < HIDDEN_BYTES / 2
