"""The README's multi-machine commands, as written, on five "machines": network namespaces on one bridge.

    10.77.0.1  seed      meshd join --no-model --listen 0.0.0.0:7000
    10.77.0.2  v1  ┐
    10.77.0.3  v2  ├─    meshd join --seed 10.77.0.1:7000 --memory 64M ...   (three 64 MiB volunteers)
    10.77.0.4  v3  ┘
    10.77.0.5  asker     meshd status --seed ... ; meshd ask --seed ...       (no model, no daemon)

The command lines come from the README's "Using it" section, so the README
cannot drift from what is tested. Each machine has its own HOME, so its own
node key and state directory. The greedy answer must be the whole model's,
token for token, and `meshd status` must show every member at its namespace's
address (never 0.0.0.0 or loopback).
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Iterator
from pathlib import Path

import netns
import pytest
from netns import ROOT, Bridge, meshd_argv

pytestmark = pytest.mark.slow

ROLES = ["seed", "v1", "v2", "v3", "asker"]
VOLUNTEERS = ["v1", "v2", "v3"]


def readme_commands() -> dict[str, list[str]]:
    """The `meshd` lines of the first block of the README's "Using it" section, by what they do."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Using it", 1)[1].split("\n## ", 1)[0]
    lines: list[str] = []
    for line in section.splitlines():
        if line.startswith("    meshd "):
            lines.append(line.strip())
        elif lines and line.strip():
            break
    commands: dict[str, list[str]] = {}
    for line in lines:
        words = shlex.split(line, comments=True)
        kind = "seed" if words[1] == "join" and "--no-model" in words else \
            "volunteer" if words[1] == "join" else words[1]
        assert kind not in commands, f"two README lines for {kind}: {line}"
        commands[kind] = words
    assert set(commands) == {"seed", "volunteer", "status", "ask"}, commands
    return commands


COMMANDS = readme_commands()
SEED = next(w for w in COMMANDS["volunteer"] if re.fullmatch(r"[\d.]+:\d+", w))
PROMPT = COMMANDS["ask"][-1]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bridge]:
    netns.require()
    removed = netns.remove_stale()
    if removed:
        print(f"removed stale namespaces: {', '.join(removed)}")
    bridge = Bridge(tmp_path_factory.mktemp("netns-mesh"))
    try:
        bridge.build(ROLES)
        assert SEED.split(":")[0] == bridge.machines["seed"].ip, "the README's seed address is the seed's"
        env = {"MESHD_LOG": "INFO"}
        bridge.start("seed", "seed", meshd_argv(COMMANDS["seed"]), env=env)
        # the volunteers start side by side, as on their own machines
        for process in [bridge.launch(role, role, meshd_argv(COMMANDS["volunteer"]), env=env) for role in VOLUNTEERS]:
            process.wait_ready(90.0)
        yield bridge
    finally:
        errors = bridge.tear_down()
        assert not errors, errors


@pytest.fixture(scope="module")
def expected(default_model: Path) -> str:
    """The whole model's greedy answer, in this process, on the chat template `meshd ask` renders (the model's own)."""
    from meshd.engine import Model
    from tests.conftest import greedy_chat_reference

    max_tokens = 256  # `meshd ask`'s default, which the README's line keeps
    with Model(default_model) as m:
        return m.detokenize(greedy_chat_reference(default_model, [PROMPT], max_tokens)[PROMPT])


def status(mesh: Bridge) -> str:
    shown = mesh.run("asker", meshd_argv(COMMANDS["status"]), timeout=60)
    assert "Traceback" not in shown.stderr, shown.stderr
    return shown.stdout if shown.returncode == 0 else ""


def member_addresses(shown: str) -> dict[str, str]:
    """node id prefix -> the address column of `meshd status`."""
    rows = {}
    for line in shown.splitlines():
        m = re.match(r"^([0-9a-f]{16})\s+(\S+)\s+(alive|suspect|dead|left)\b", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_the_readme_commands_form_a_mesh_across_machines(mesh: Bridge, expected: str) -> None:
    ids = {p.name: p.node_id[:16] for p in mesh.processes}
    want = {ids[role]: f"{mesh.machines[role].ip}:7000" for role in ["seed", *VOLUNTEERS]}
    began = time.monotonic()
    # polled by one lasting process (a README `meshd status` a second cost a Python start-up each), then shown
    # by the README's command
    for _ in range(240):
        doc = mesh.probe("asker").status(SEED)
        if any(c["covered"] and c["n_layers"] == 30 for c in doc.get("coverage", [])) and \
                {m["node_id"][:16]: m["address"] for m in doc["members"]} == want or time.monotonic() - began > 240:
            break
        time.sleep(1.0)
    shown = status(mesh)
    assert "30/30 layers covered" in shown and member_addresses(shown) == want, \
        f"after {time.monotonic() - began:.0f} s, want members at {want}:\n{shown}\n{mesh.logs()}"
    print(f"\nmesh covered {time.monotonic() - began:.1f} s after the last volunteer was ready:\n{shown}")
    assert "0.0.0.0" not in shown and "127.0.0.1" not in shown
    assert "behind NAT" not in shown and "not covered" not in shown
    stages = re.search(r"stages: (.*)$", shown, re.M)
    # Three 64 MiB volunteers cannot hold the model alone: every one serves a part of it.
    assert stages is not None and len(stages.group(1).split("; ")) == 3 and "[0, 30)" not in shown, shown

    asked = mesh.run("asker", meshd_argv(COMMANDS["ask"]), timeout=300)
    assert asked.returncode == 0, f"{asked.stderr}\n{mesh.logs()}"
    print(f"{PROMPT!r} -> {asked.stdout.strip()[:120]!r}... {asked.stderr.strip()}")
    assert asked.stdout.strip() == expected.strip() and len(expected) > 20
    # unverified, the same ask takes the fast path: the volunteers' workers dial each other at their
    # namespaces' addresses, and the answer is the same
    fast = mesh.run("asker", meshd_argv([*COMMANDS["ask"][:-1], "--verify", "0", PROMPT]), timeout=300)
    assert fast.returncode == 0, f"{fast.stderr}\n{mesh.logs()}"
    assert fast.stdout == asked.stdout and "failed over" not in fast.stderr, fast.stderr
