"""A partition mid-answer, on "machines" that are network namespaces on one bridge:

    10.77.0.1  seed      meshd join --no-model --listen 0.0.0.0:7000
    10.77.0.2  v1  ┐
    10.77.0.3  v2  ├─    meshd join --seed 10.77.0.1:7000 --model TINY --memory 760K ...   (two ranges, each twice)
    10.77.0.4  v3  │
    10.77.0.5  v4  ┘
    10.77.0.6  asker     meshd ask --seed 10.77.0.1:7000 --timeout 4 ...

While `meshd ask` streams its answer, the bridge ports of the two volunteers on its route (half
the volunteers) go down: their packets are dropped, nothing is closed or refused. The asker notices
the stall, probes the route, routes around both in one failover, and prints the whole model's
answer; its figures line says it failed over and what that cost.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import netns
import pytest
from localmesh import spawn
from netns import Bridge, Process, meshd_argv, sh

pytestmark = pytest.mark.slow

VOLUNTEERS = ["v1", "v2", "v3", "v4"]
ROLES = ["seed", *VOLUNTEERS, "asker"]
SEED = "10.77.0.1:7000"
PROMPT = "Tell me about lighthouses."
# long enough that the partition lands mid-answer; within the tiny model's 256-token context
TOKENS = 96
STALL = 4


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> Path:
    # f32 weights: see test_failover_mesh.MODEL
    return tiny_models["llama-gqa-untied"]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[Bridge]:
    netns.require()
    removed = netns.remove_stale()
    if removed:
        print(f"removed stale namespaces: {', '.join(removed)}")
    bridge = Bridge(tmp_path_factory.mktemp("failover-netns"))
    try:
        bridge.build(ROLES)
        bridge.start("seed", "seed", meshd_argv(["meshd", "join", "--no-model", "--listen", "0.0.0.0:7000"]))
        # 760 KiB: three of the tiny model's six layers with their KV, so two ranges, each served twice; the
        # volunteers start side by side
        started = [bridge.launch(role, role, meshd_argv(["meshd", "join", "--seed", SEED, "--model", str(model),
                                                         "--memory", "760K", "--max-sessions", "2",
                                                         "--session-tokens", "256", "--threads", "1"]))
                   for role in VOLUNTEERS]
        for process in started:
            process.wait_ready(90.0)
        yield bridge
    finally:
        errors = bridge.tear_down()
        assert not errors, errors


@pytest.fixture(scope="module")
def expected(model: Path) -> str:
    """The whole model's greedy answer as `meshd ask` prints it (its pieces decoded as they come), to the
    chat rendered on the model's own template."""
    from meshd.engine import Model
    from tests.conftest import greedy_chat_reference

    tokens = greedy_chat_reference(model, [PROMPT], TOKENS)[PROMPT]
    assert len(tokens) == TOKENS, "the reference answer ends early: the partition would come after it"
    with Model(model) as m:
        # the tail sends each token's piece; `meshd ask` decodes them as they come, bad bytes replaced
        return b"".join(m.token_piece(t) for t in tokens).decode(errors="replace")


def served_twice(mesh: Bridge) -> bool:
    shown = mesh.run("asker", meshd_argv(["meshd", "status", "--seed", SEED, "--json"]), timeout=60)
    if shown.returncode != 0:
        return False
    view = json.loads(shown.stdout)
    ranges = [s.split(" ", 1)[1] for m in view["members"] if m["state"] == "alive" for s in m["served"]]
    return len(ranges) == 4 and sorted(set(ranges)) == ["[0, 3)", "[3, 6)"] and \
        all(ranges.count(r) == 2 for r in set(ranges))


def test_half_the_volunteers_partitioned_away_mid_answer_still_give_the_whole_models_answer(
        mesh: Bridge, expected: str) -> None:
    began = time.monotonic()
    while not served_twice(mesh):
        assert time.monotonic() - began < 120, f"the ranges were never served twice:\n{mesh.logs()}"
        time.sleep(0.5)
    print(f"\nboth ranges served twice {time.monotonic() - began:.1f} s after the last volunteer was ready")

    machine = mesh.machines["asker"]
    out, err = mesh.base / "ask.out", mesh.base / "ask.err"
    # the daemons' path: on the fast path (the default) the tiny model's whole answer is out within a few
    # polls of the loop below, before a partition can land mid-answer (the fast path's failover mid-answer:
    # tests/test_spec_ring.py)
    argv = meshd_argv(["meshd", "ask", "--seed", SEED, "--max-tokens", str(TOKENS), "--timeout", str(STALL),
                       "--no-fast", PROMPT])
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = spawn(["ip", "netns", "exec", machine.namespace, *argv], stdout=stdout, stderr=stderr, text=True,
                     env=machine.env() | {"MESHD_LOG": "DEBUG"}, cwd=machine.home)
    # the bridge's tear-down stops it by PID with the daemons
    mesh.processes.append(Process("asker", proc, err))
    by_id = {p.node_id: p.name for p in mesh.processes if p.name in VOLUNTEERS}
    cut: list[str] = []
    deadline = time.monotonic() + 60
    while not cut:
        assert proc.poll() is None, f"the answer ended before the partition ({len(out.read_bytes())} bytes):\n" + \
            "\n".join(line for line in err.read_text().splitlines() if "meshd" in line)
        assert time.monotonic() < deadline, f"no route and tokens seen:\n{err.read_text()}\n{mesh.logs()}"
        route = re.search(r"epoch 0 of session \S+: route (.*)$", err.read_text(), re.M)
        if route is not None and len(out.read_bytes()) >= 24:
            cut = [by_id[node] for node in re.findall(r"([0-9a-f]{16,64})\[", route.group(1))]
            for role in cut:
                # the volunteer's port on the bridge: its packets are dropped from here on
                sh("ip", "-n", mesh.hub, "link", "set", f"p{ROLES.index(role) + 1}", "down")
        time.sleep(0.02)
    try:
        partitioned_at = time.monotonic()
        streamed = len(out.read_bytes())
        assert proc.wait(timeout=120) == 0, f"{err.read_text()}\n{mesh.logs()}"
        answered = time.monotonic() - partitioned_at
    finally:
        # cut off for good: the tear-down's graceful leave would wait out its timeout on each
        for process in mesh.processes:
            if process.name in cut:
                process.proc.kill()
                process.proc.wait(timeout=10)
    figures = err.read_text().strip().splitlines()[-1]
    print(f"partitioned {', '.join(cut)} (the whole route) after {streamed} bytes of the answer; "
          f"the answer ended {answered:.1f} s later: {figures}")
    assert len(cut) == 2 and streamed < len(expected.encode())
    text = out.read_text()
    first = next((i for i, (a, b) in enumerate(zip(text, expected, strict=False)) if a != b), None)
    assert text == expected + "\n", f"the answer differs from character {first} on; the asker said:\n" + \
        "\n".join(line for line in err.read_text().splitlines() if "meshd" in line)
    assert re.search(r"failed over 1 time \(2 stages routed around, [\d.]+ s lost\)", figures), figures
