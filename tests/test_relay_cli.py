"""`meshd relay` from the command line: bad flags, and a relay joining a loopback mesh with its role."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from localmesh import run_meshd, start_join, start_meshd, stop_all

# meshd relay and join processes
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("flags, says", [
    (["--max-reservations", "0"], "argument --max-reservations: must be a whole number from 1"),
    (["--circuit-seconds", "-1"], "argument --circuit-seconds: must be a number above 0"),
    (["--max-circuit-bytes", "lots"], "argument --max-circuit-bytes: 'lots' is not a size"),
    (["--listen", "nowhere"], "argument --listen: 'nowhere' is not HOST:PORT"),
    (["--advertise", "x"], "argument --advertise: 'x' is not HOST:PORT"),
])
def test_bad_relay_flags_end_in_one_line(flags: list[str], says: str, tmp_path: Path) -> None:
    done = run_meshd("relay", "--state-dir", str(tmp_path), *flags, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"meshd relay: {says}"), done.stderr


def test_a_relay_joins_the_mesh_with_the_relay_role(tmp_path: Path) -> None:
    seed = start_join("--no-model", "--state-dir", str(tmp_path / "seed"))
    relay = None
    try:
        relay = start_meshd("relay", "--seed", seed.address, "--state-dir", str(tmp_path / "relay"),
                            "--max-reservations", "4", "--max-circuit-bytes", "16M")
        shown = ""
        for _ in range(60):
            shown = run_meshd("status", "--seed", seed.address).stdout
            if any(relay.node_id[:16] in line and "relay" in line for line in shown.splitlines()):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the relay never showed up with its role:\n{shown}")
    finally:
        stop_all([seed] if relay is None else [seed, relay])
