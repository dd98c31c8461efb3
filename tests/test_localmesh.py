"""The test helpers leave nothing behind: daemons in their own process group that die with the
test run, and network namespaces of killed runs removed by the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import netns
import pytest
from localmesh import Served, gone, spawn, start_serve, stop_process

# local meshd processes, started and killed
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 60.0


def wait_gone(*pids: int) -> list[int]:
    """The PIDs still running when the deadline passed (polled, bounded)."""
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline and not all(gone(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not gone(p)]


def kill_all(*pids: int) -> None:
    for pid in pids:
        if pid <= 0:
            continue  # never 0 or -1: those signal whole groups, this test run's own included
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def serve_tiny(model: Path) -> Served:
    return start_serve("--model", str(model), "--threads", "1", "--max-sessions", "1", "--session-tokens", "64")


def test_a_daemon_runs_in_its_own_group_and_stops_with_everything_in_it(tiny_models: dict[str, Path]) -> None:
    served = serve_tiny(tiny_models["llama-gqa-tied"])
    try:
        daemon, worker = served.proc.pid, served.worker_pid
        assert os.getpgid(daemon) == daemon != os.getpgid(0)
        assert os.getpgid(worker) == daemon
        served.stop()
        assert wait_gone(daemon, worker) == []
    finally:
        kill_all(served.proc.pid, served.worker_pid)


def test_stopping_a_process_stops_what_it_left_in_its_group() -> None:
    # the shell leaves on SIGTERM; its child (no parent-death signal of its own) would live on
    proc = spawn(["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        assert os.getpgid(child) == proc.pid
        stop_process(proc)
        assert wait_gone(proc.pid, child) == []
    finally:
        kill_all(proc.pid, child)


RUN = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, "tools")
    from localmesh import start_serve
    served = start_serve("--model", sys.argv[1], "--threads", "1", "--max-sessions", "1", "--session-tokens", "64")
    print(served.proc.pid, served.worker_pid, flush=True)
    time.sleep(600)
""")


def test_a_killed_test_run_leaves_no_daemon_and_no_worker(tiny_models: dict[str, Path]) -> None:
    run = subprocess.Popen([sys.executable, "-c", RUN, str(tiny_models["llama-gqa-tied"])], cwd=ROOT,
                           stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert run.stdout is not None
        line = run.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, f"the run printed {line!r}"
        run.kill()
        run.wait(DEADLINE)
        assert wait_gone(*pids) == [], "a daemon or its worker outlived the killed test run"
    finally:
        kill_all(run.pid, *pids)
        stop_process(run)


def test_namespaces_of_dead_runs_are_removed_and_live_ones_kept() -> None:
    netns.require()
    dead = subprocess.Popen(["true"])
    dead.wait()
    # a PID nobody has now: the maker of a killed run (PIDs are reused only after wrapping)
    stale_ns = f"{netns.PREFIX}{dead.pid}-test-stale"
    live_ns = netns.name("test", "live")
    for ns in (stale_ns, live_ns):
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=30)
    try:
        removed = netns.remove_stale()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        assert stale_ns in removed and stale_ns not in listed
        assert live_ns not in removed and live_ns in listed
    finally:
        for ns in (stale_ns, live_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_required_namespaces_fail_instead_of_skipping(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "unavailable", lambda: "no CAP_SYS_ADMIN")
    monkeypatch.delenv("MESHD_REQUIRE_NETNS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no CAP_SYS_ADMIN"):
        netns.require()
    monkeypatch.setenv("MESHD_REQUIRE_NETNS", "1")
    # both caught, so that a skip here fails this test instead of skipping it
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception)) as raised:
        netns.require()
    assert raised.type is pytest.fail.Exception, f"skipped although required: {raised.value}"
    assert "required here" in str(raised.value) and "no CAP_SYS_ADMIN" in str(raised.value)
