"""The README's commands and code, run as a reader would run them (tests/test_netns_mesh.py runs
"Using it"; tests/test_demo.py `tools/dev demo`'s printed lines).

Only what a second run on one machine must change is changed: fixed ports become free ones.
"""

from __future__ import annotations

import re
import shlex
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
from localmesh import Served, run_meshd, start_join, start_meshd, stop_all

from wire.swim import Reachability

# the README's commands, run as written: meshd processes
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def block_after(heading: str) -> list[str]:
    """The indented command lines of the block that follows the paragraph starting with `heading`."""
    text = README[README.index(heading):]
    lines = text.split("\n\n", 2)[1].splitlines()
    assert all(line.startswith("    ") for line in lines), lines
    return [line.strip() for line in lines]


def readme_line(pattern: str) -> str:
    """The one indented README line that matches `pattern`."""
    [line] = [m.group(1) for m in re.finditer(r"^    (meshd .*)$", README, re.M) if re.search(pattern, m.group(1))]
    return line


def test_the_python_snippet_runs() -> None:
    [snippet] = [code for code in re.findall(r"```python\n(.*?)```", README, re.S) if "meshd.engine" in code]
    # what its comment says `hidden` is
    check = "\nassert hidden.shape == (2, 576) and str(hidden.dtype) == 'float32', (hidden.shape, hidden.dtype)\n"
    done = subprocess.run([sys.executable, "-c", snippet + check], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_the_by_hand_block_runs_one_thread_a_stage() -> None:
    lines = block_after("By hand, without a mesh")
    serves = [shlex.split(line)[1:] for line in lines if line.startswith("meshd serve ")]
    [ask] = [shlex.split(line)[1:] for line in lines if line.startswith("meshd ask ")]
    assert len(serves) == 2 and len(lines) == 3, lines
    # two stages on one machine: each takes one core, not (the default) every core
    assert all(shlex.join(argv).endswith(" --threads 1") for argv in serves), serves
    ports = {f"127.0.0.1:{p}" for line in lines for p in re.findall(r"127\.0\.0\.1:(\d+)", line)}
    now = {old: f"127.0.0.1:{free_port()}" for old in sorted(ports)}

    def as_now(argv: list[str]) -> list[str]:
        return [",".join(now.get(a, a) for a in word.split(",")) for word in argv]

    stages: list[Served] = []
    try:
        stages = [start_meshd(*as_now(argv)) for argv in serves]
        asked = run_meshd(*as_now(ask))
        assert asked.returncode == 0 and "Paris" in asked.stdout, asked.stdout + asked.stderr
    finally:
        stop_all(stages)


def test_the_api_member_starts_beside_a_volunteer_on_the_same_machine(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A volunteer on the default state dir, then the README's API member on the same machine (HOME)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    volunteer = start_join("--no-model")  # the default state dir, as the README's volunteer line has it
    nodes = [volunteer]
    try:
        argv = shlex.split(readme_line(r"--api 8080"))[1:]
        argv = [str(tmp_path) + w[1:] if w.startswith("~/") else w for w in argv]
        argv[argv.index("--seed") + 1] = volunteer.address
        argv[argv.index("--listen") + 1] = "127.0.0.1:0"
        argv[argv.index("--api") + 1] = str(free_port())
        nodes.append(start_meshd(*argv))
    finally:
        stop_all(nodes)


def test_the_api_key_recipe_makes_a_file_only_its_owner_reads(tmp_path: Path) -> None:
    [recipe] = [line.split("#")[0].strip() for line in README.splitlines() if "openssl rand" in line and "api.key" in line]
    subprocess.run(["bash", "-c", recipe], cwd=tmp_path, check=True, timeout=30)
    key = tmp_path / "api.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_text().strip()) == 64


def test_the_status_json_keys_name_the_reachabilities_status_prints() -> None:
    """`meshd status --json` prints a member's reachability as its record says it."""
    keys = README[README.index("    node_id, tracker (null: none elected), term"):]
    said = keys[keys.index("reachability"):keys.index("memory_bytes")]
    assert set(re.findall(r'"(\w+)"', said)) == set(get_args(Reachability)), said


def test_a_newcomer_reads_what_it_runs_on_then_install_use_and_operations_before_the_deep_sections() -> None:
    """Issue 32: installation came after the threat model, and no line said which CPUs, systems and
    Pythons work, how to stop a node, where its logs go or which port to open."""
    headings = re.findall(r"^## (.+)$", README, re.M)
    wanted = ["Installing", "One machine", "Using it", "Your own model", "The HTTP API", "Operations",
              "Verification", "The fast path", "Threat model", "Figures"]
    at = [next(i for i, h in enumerate(headings) if h.startswith(w)) for w in wanted]
    assert at == sorted(at), headings
    before_install = README[:README.index("\n## ")]
    assert all(word in before_install for word in ("Linux", "x86-64-v3", "Python 3.11")), before_install
    operations = README[README.index("\n## Operations"):README.index("\n## Verification")]
    assert all(word in operations for word in ("SIGTERM", "restart", "stderr", "--state-dir", "Upgrade")), operations
    several = README[README.index("\n## Using it"):README.index("\n## Your own model")]
    assert "TCP" in several and "7000" in several and "inbound" in several, several
