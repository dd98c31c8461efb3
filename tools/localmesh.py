"""Local `meshd` processes (tests, demo, benchmarks): started, awaited until ready, always stopped."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import trio

from meshd.net.peers import Peers, open_peers
from meshd.net.rpc import mesh_rpc
from wire.identity import NodeIdentity
from wire.meshrpc import StatusReply, StatusRequest

READY = re.compile(r"^ready (\S+) pid=(\d+) (?:worker|node)=(\w+)")


@dataclass
class Served:
    proc: subprocess.Popen[str]
    address: str
    worker_pid: int
    lines: list[str] = field(default_factory=list)
    node_id: str = ""
    log: Path | None = None
    # set when a test failed while this daemon ran: its log outlives it, for the next look
    keep_log: bool = False

    def __post_init__(self) -> None:
        if self.log is not None:
            _RUNNING[self.proc.pid] = self

    def stop(self) -> None:
        stop_process(self.proc)
        _RUNNING.pop(self.proc.pid, None)
        if self.log is not None and not self.keep_log:
            self.log.unlink(missing_ok=True)


# The daemons with a log that were started and not yet stopped, by PID: what a failure report shows
_RUNNING: dict[int, Served] = {}
TAIL_LINES = 80


def running_logs() -> str:
    """The tail of each running daemon's log, which is kept on disk from now on: a failing test's
    evidence (a module's mesh is torn down, logs and all, after its report is written)."""
    parts = []
    for served in _RUNNING.values():
        assert served.log is not None
        served.keep_log = True
        try:
            lines = served.log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            continue
        name = served.node_id[:12] or served.address
        shown = lines[-TAIL_LINES:]
        parts.append(f"----- {name} pid={served.proc.pid} {served.log} (its last {len(shown)} of {len(lines)} lines)\n"
                     + "\n".join(shown))
    return "\n".join(parts)


# PIDs that spawn() made leaders of their own process group: stop_process ends the group
_GROUPS: set[int] = set()


def _die_with_parent() -> None:
    # runs in the child between fork and exec: SIGKILL it when the test process dies,
    # however it dies (survives exec, and `ip netns exec` execs in place)
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def spawn(argv: list[str], **popen: Any) -> subprocess.Popen[Any]:
    """A process of a test in its own process group, SIGKILLed when this process dies.

    Its own group: stop_process ends everything it started (a worker, a shell's
    children) by one group signal. The parent-death signal follows the thread that
    forks, so it is armed only from the main thread (a worker thread, such as
    trio.to_thread's, exits when idle and would take the process with it).
    """
    arm = sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread()
    proc: subprocess.Popen[Any] = subprocess.Popen(argv, start_new_session=True,
                                                   preexec_fn=_die_with_parent if arm else None, **popen)
    _GROUPS.add(proc.pid)
    return proc


def stop_process(proc: subprocess.Popen[str] | subprocess.Popen[bytes]) -> None:
    """SIGTERM (a daemon leaves gracefully), then SIGKILL if it takes too long; then its whole group."""
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    finally:
        if proc.pid in _GROUPS:
            # whatever the leader left running in its group (by PID: the group is the leader's)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            _GROUPS.discard(proc.pid)


class Stoppable(Protocol):
    def stop(self) -> None: ...


def terminate_together(procs: Iterable[subprocess.Popen[str] | subprocess.Popen[bytes]], timeout: float = 10.0) -> None:
    """SIGTERM to every running one at once, then waits (at most `timeout` for all): each daemon's
    graceful leave (up to its leave_timeout) runs beside the others' instead of after them. Whatever
    is still running then is for stop_process to end."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))


def stop_all(items: Iterable[Stoppable]) -> None:
    """Stops every item even if stopping one fails; the first failure is raised after all were tried."""
    items = list(items)
    terminate_together(proc for item in items if isinstance(proc := getattr(item, "proc", None), subprocess.Popen))
    with contextlib.ExitStack() as stack:
        for item in items:
            stack.callback(item.stop)


@contextlib.contextmanager
def serving(ranges: Iterable[str], sessions: int, session_tokens: int) -> Iterator[list[Served]]:
    """`meshd serve` of each layer range of the default model (one thread each), stopped at the end; the
    stages start side by side (each loads its range meanwhile), not one after another."""
    launched: list[Launched] = []
    served: list[Served] = []
    try:
        for r in ranges:
            launched.append(launch_meshd("serve", "--layers", r, "--threads", "1", "--max-sessions", str(sessions),
                                         "--session-tokens", str(session_tokens)))
        for one in launched:
            served.append(one.ready())
        yield served
    finally:
        stop_started(served, launched)


def stop_started(nodes: Iterable[Served], launched: Iterable[Launched]) -> None:
    """Stops `nodes` (those that became ready), then each of `launched` that never did."""
    nodes = list(nodes)
    try:
        stop_all(nodes)
    finally:
        held = {n.proc for n in nodes}
        for one in launched:
            if one.proc not in held:
                stop_process(one.proc)


def meshd_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshd.cli", *args]


def start_serve(*args: str, timeout: float = 60.0) -> Served:
    """`meshd serve ARGS --listen 127.0.0.1:0`, returned once it prints its ready line."""
    return start_meshd("serve", *args, timeout=timeout)


def start_join(*args: str, timeout: float = 60.0) -> Served:
    """`meshd join ARGS --listen 127.0.0.1:0`, returned once it prints its ready line."""
    return start_meshd("join", *args, timeout=timeout)


def start_meshd(command: str, *args: str, timeout: float = 60.0, program: list[str] | None = None) -> Served:
    """Output goes to a log file, not a pipe: a pipe nobody reads would block a chatty daemon. At
    info level unless $MESHD_LOG says: tracker changes, placements, asks and fetches are what a
    failure's log must show (warnings alone left a placement stall unexplained). `program`: what runs in
    place of `meshd` (an attacker's wrapper of it, say), taking the same arguments."""
    return launch_meshd(command, *args, timeout=timeout, program=program).ready()


@dataclass
class Launched:
    """A `meshd` process started, not yet ready: `ready()` waits for its ready line (several started
    first, then waited for, start side by side)."""

    command: str
    proc: subprocess.Popen[str]
    log: Path
    deadline: float

    def ready(self) -> Served:
        lines: list[str] = []
        while time.monotonic() < self.deadline and self.proc.poll() is None:
            lines = self.log.read_text().splitlines()
            for line in lines:
                m = READY.match(line)
                if m:
                    worker = m.group(3)
                    return (Served(self.proc, m.group(1), int(worker), lines, log=self.log) if worker.isdigit()
                            else Served(self.proc, m.group(1), 0, lines, node_id=worker, log=self.log))
            time.sleep(0.05)
        stop_process(self.proc)
        lines = self.log.read_text().splitlines()
        raise RuntimeError(f"meshd {self.command} did not become ready:\n" + "\n".join(lines))


def launch_meshd(command: str, *args: str, timeout: float = 60.0, program: list[str] | None = None) -> Launched:
    """`start_meshd`'s process, started; its `ready()` is `start_meshd`'s answer."""
    env = os.environ | {"PYTHONUNBUFFERED": "1", "MESHD_LOG": os.environ.get("MESHD_LOG", "info")}
    log = tempfile.NamedTemporaryFile("w+", prefix=f"meshd-{command}-", suffix=".log", delete=False)
    argv = [*program, command, "--listen", "127.0.0.1:0", *args] if program is not None \
        else meshd_command(command, "--listen", "127.0.0.1:0", *args)
    proc = spawn(argv, stdout=log,
                 stderr=subprocess.STDOUT, text=True, env=env)
    return Launched(command, proc, Path(log.name), time.monotonic() + timeout)


def run_meshd(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(meshd_command(*args), capture_output=True, text=True, timeout=timeout,
                          env=os.environ | {"PYTHONUNBUFFERED": "1"})


def copy_with_other_digest(src: Path, dst: Path) -> Path:
    """The same model with one byte changed in the last tensor's data: loads alike, hashes differently."""
    data = bytearray(src.read_bytes())
    data[-7] ^= 0x01
    dst.write_bytes(bytes(data))
    return dst


def gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet: it runs no more."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


async def mesh_status(peers: Peers, node: Served) -> StatusReply:
    """The status reply of a member, asked over the mesh."""
    reply = await mesh_rpc(peers, node.address, StatusRequest(), timeout=20.0)
    assert isinstance(reply, StatusReply)
    return reply


def wait_covered(node: Served, timeout: float = 120.0) -> StatusReply:
    """Polls the member's status over the mesh, from this process, until it knows a model and every layer
    of each it knows is served (what `meshd status` shows as "30/30 layers covered"): a `meshd status`
    process per poll is most of a second of CPU."""
    async def poll() -> StatusReply:
        async with open_peers(NodeIdentity.generate()) as peers:
            with trio.fail_after(timeout):
                while True:
                    with contextlib.suppress(Exception):  # a member not yet answering is asked again
                        view = await mesh_status(peers, node)
                        if view.coverage and all(c.covered_layers == c.n_layers for c in view.coverage):
                            return view
                    await trio.sleep(0.5)

    try:
        return trio.run(poll)
    except trio.TooSlowError:
        raise AssertionError(f"{node.address} did not see its model covered within {timeout:g} s") from None
