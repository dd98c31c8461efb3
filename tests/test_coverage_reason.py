"""Why a model is not covered: memory needed against memory offered, and the flag that would change it."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from localmesh import Served, run_meshd, start_join, stop_all

from meshd.mesh.assignment import ModelSpec, NodeCapacity
from meshd.mesh.placement import assign
from meshd.mesh.records import ModelInfo
from meshd.mesh.shortfall import coverage_shortfall

MIB = 1 << 20
# SmolLM2-135M Q4_1 as model_info measures it.
SMOLLM2 = ModelInfo(digest="b179c952", name="SmolLM2", n_layers=30, bytes_per_layer=2216448, kv_bytes_per_token=768,
                    head_bytes=30081024, tail_bytes=30083328)


def volunteers(*mib: int) -> list[NodeCapacity]:
    return [NodeCapacity(f"n{i}", m * MIB, 0.0) for i, m in enumerate(mib)]


def covers(nodes: list[NodeCapacity], spec: ModelSpec) -> bool:
    return coverage_shortfall(nodes, spec) is None


def test_three_64_mib_volunteers_at_the_default_session_budget_are_told_what_is_missing() -> None:
    spec = ModelSpec.from_info(SMOLLM2, 4 * 1024)  # join's defaults: 4 sessions x 1024 tokens
    reason = coverage_shortfall(volunteers(64, 64, 64), spec)
    assert reason == (
        "the model needs 121 MiB of weights + 90 MiB of KV (4,096 tokens a stage: --max-sessions × "
        "--session-tokens) but the 3 volunteers offer 3 × 64 MiB (19 MiB short); raise --memory to 72M on each "
        "volunteer, lower --max-sessions × --session-tokens to 3,140 tokens or fewer, or add volunteers")
    # Each remedy is the least that works: exactly it covers, a step short does not.
    assert covers(volunteers(72, 72, 72), spec) and not covers(volunteers(71, 71, 71), spec)
    assert covers(volunteers(64, 64, 64), spec.with_kv_tokens(3140))
    assert not covers(volunteers(64, 64, 64), spec.with_kv_tokens(3141))
    # The README's flags (2 sessions x 512 tokens) cover it: no reason.
    assert coverage_shortfall(volunteers(64, 64, 64), ModelSpec.from_info(SMOLLM2, 2 * 512)) is None


def test_the_reason_names_what_blocks_when_memory_in_total_suffices() -> None:
    spec = ModelSpec.from_info(SMOLLM2, 1024)
    tiny = coverage_shortfall(volunteers(1, 1, 1), spec)
    assert tiny is not None and "none of which holds one layer (a layer takes 2 MiB + 1 MiB of KV)" in tiny
    # Eight 20 MiB volunteers offer 160 MiB, more than the 143 MiB needed, but the 29 MiB embedding fits none.
    head = coverage_shortfall(volunteers(*[20] * 8), spec)
    assert head is not None and "none of which holds the first stage: the token embedding (29 MiB)" in head
    assert "8 volunteers offer 8 × 20 MiB" in head
    mixed = coverage_shortfall(volunteers(40, 30, 20), spec)
    assert mixed is not None and "offer 90 MiB in all (the largest 40 MiB)" in mixed
    # Without KV a smaller session budget cannot help, so it is not offered as a remedy.
    no_kv = coverage_shortfall(volunteers(40, 40), ModelSpec.from_info(SMOLLM2, 0))
    assert no_kv is not None and "--session-tokens" not in no_kv and "raise --memory to" in no_kv
    assert coverage_shortfall([], spec) == "no member volunteers the model"


@pytest.mark.parametrize("memories", [(64, 64, 64), (10, 50, 90), (30,) * 5, (200,)])
@pytest.mark.parametrize("kv_tokens", [0, 1024, 8192])
def test_the_memory_named_covers_the_model_and_the_reason_agrees_with_assign(
        memories: tuple[int, ...], kv_tokens: int) -> None:
    spec = ModelSpec.from_info(SMOLLM2, kv_tokens)
    nodes = volunteers(*memories)
    reason = coverage_shortfall(nodes, spec)
    try:
        assign(nodes, spec)
    except ValueError as exc:
        assert reason is not None and str(exc) == reason
    else:
        assert reason is None
        return
    m = re.search(r"raise --memory to (\d+)M", reason)
    assert m is not None, reason
    raised = [NodeCapacity(n.node_id, max(n.memory_bytes, int(m.group(1)) * MIB), 0.0) for n in nodes]
    assert covers(raised, spec)


# ----- from real daemons

@pytest.fixture(scope="module")
def short_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Served]]:
    base = tmp_path_factory.mktemp("short")
    nodes: list[Served] = []
    try:
        nodes.append(start_join("--no-model", "--state-dir", str(base / "seed")))
        for i in range(3):
            # join's default session budget: 4 sessions x 1024 tokens
            nodes.append(start_join("--seed", nodes[0].address, "--state-dir", str(base / f"v{i}"),
                                    "--memory", "64M", "--threads", "1"))
        yield nodes
    finally:
        stop_all(nodes)


@pytest.mark.slow
def test_status_and_ask_say_why_three_small_volunteers_cannot_cover_the_model(
        short_mesh: list[Served], default_model: Path) -> None:
    seed = short_mesh[0].address
    shown = ""
    deadline = time.monotonic() + 60
    for _ in range(120):
        shown = run_meshd("status", "--seed", seed).stdout
        if "3 volunteers offer" in shown or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(shown)
    # the reason wraps to the table's 80 columns: read it as one line
    flat = " ".join(shown.split())
    assert "0/30 layers covered" in flat, shown
    assert "not covered: the model needs 121 MiB of weights + 90 MiB of KV" in flat, shown
    assert "the 3 volunteers offer 3 × 64 MiB" in flat and "raise --memory to 72M" in flat
    asked = run_meshd("ask", "--seed", seed, "--max-tokens", "4", "hello")
    print(asked.stderr)
    assert asked.returncode != 0 and "Traceback" not in asked.stderr
    lines = asked.stderr.strip().splitlines()
    assert len(lines) == 1 and "lower --max-sessions × --session-tokens to 3,140 tokens" in lines[0], asked.stderr
