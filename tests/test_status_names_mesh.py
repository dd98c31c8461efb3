"""Issue 32's defect 11, as a user meets it in `meshd models` and `meshd status` on real daemons: a model
is known by its file's name as well as by the GGUF's own `general.name` (a volunteer joins by it), a
range two members serve counts as a replica, and a node with no model offers no memory.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from localmesh import Served, run_meshd, start_join, stop_all

from meshd.cli.main import main

pytestmark = pytest.mark.slow  # five daemons, four engine workers

# A file name that is not the GGUF's own name ("Smollm2 135M 8k Lc100K Mix1 Ep2"), as a user's download has.
FILE_STEM = "SmolLM2-135M-Instruct-Q4_1"
# As the README's volunteers: three of them cover the default model in three stages, so a fourth is a replica.
VOLUNTEER = ["--memory", "64M", "--max-sessions", "2", "--session-tokens", "512", "--threads", "1"]
# Four workers loading, a fetch of one range and the tracker's placement, on two shared cores.
SETTLE_S = 180.0


def status_json(seed: Served) -> dict[str, Any]:
    # `meshd status --json` in this process: polled every second, a process each time would cost more than
    # the daemons it watches (the plain `meshd status` and `meshd models` below run as the user runs them)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["status", "--seed", seed.address, "--json"]) == 0
    status: dict[str, Any] = json.loads(out.getvalue())
    return status


def duplicated(assigned: list[str]) -> int:
    """How many stages of `assigned` ("<node> [start, end)") repeat a range another stage serves."""
    ranges = [re.sub(r"^\S+ ", "", a) for a in assigned]
    return len(ranges) - len(set(ranges))


def test_a_model_is_joined_by_its_file_name_replicas_are_counted_and_a_seed_offers_no_memory(
        default_model: Path, tmp_path: Path) -> None:
    named = tmp_path / f"{FILE_STEM}.gguf"
    named.symlink_to(default_model)
    nodes: list[Served] = []
    try:
        seed = start_join("--no-model", "--state-dir", str(tmp_path / "seed"))
        nodes.append(seed)
        for i in range(3):
            nodes.append(start_join("--seed", seed.address, "--state-dir", str(tmp_path / f"v{i}"),
                                    "--model", str(named), *VOLUNTEER))
        # no file: the mesh is asked for the model by the name its holders' file has
        fetcher = start_join("--seed", seed.address, "--state-dir", str(tmp_path / "fetcher"),
                             "--model-id", FILE_STEM, "--disk", "1G", *VOLUNTEER)
        nodes.append(fetcher)
        deadline = time.monotonic() + SETTLE_S
        while True:
            status = status_json(seed)
            members = {m["node_id"]: m for m in status["members"]}
            [coverage] = status["coverage"] or [None]
            if coverage is not None and coverage["covered"] and members.get(fetcher.node_id, {}).get("served") \
                    and duplicated(coverage["assigned"]):
                break
            assert time.monotonic() < deadline, f"no replica placed on the fetcher: {status}"
            time.sleep(0.5)

        assert coverage["file"] == FILE_STEM and coverage["name"] != FILE_STEM, coverage
        # every stage that repeats another's range is a replica, though the other ranges have none
        assert coverage["replicas"] == duplicated(coverage["assigned"]) >= 1, coverage
        assert members[seed.node_id]["memory_bytes"] == 0, members[seed.node_id]

        models = run_meshd("models", "--seed", seed.address)
        assert models.returncode == 0 and f"file {FILE_STEM}" in models.stdout, models.stdout + models.stderr
        shown = run_meshd("status", "--seed", seed.address)
        assert shown.returncode == 0, shown.stderr
        assert f"{FILE_STEM}.gguf" in shown.stdout and " 0 spare replicas" not in shown.stdout, shown.stdout
        [seed_row] = [line for line in shown.stdout.splitlines() if line.startswith(seed.node_id[:8])]
        assert "MiB" not in seed_row, seed_row
    finally:
        stop_all(nodes)
