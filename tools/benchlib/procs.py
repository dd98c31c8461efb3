"""The processes a benchmark starts (meshd stages, llama.cpp's RPC servers, emulated links), where they may
run (pinning), and what they spend. CPU time three ways, each for its own case: ``cpu_ns`` (the live
threads' schedstat, in ns: a stage's daemon or worker across one measured run), ``process_cpu_ns`` (/proc
stat, threads that ended included, in ticks: a whole process over a long run) and
``exited_children_cpu_ns`` (rusage: programs already waited for, llama-bench). Memory by /proc's status."""

from __future__ import annotations

import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from localmesh import stop_process

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "build" / "native-tools" / "bin"
STAGE_READY = re.compile(r"^ready (\S+) pid=(\d+) worker=(\d+)")
EMULATOR = ROOT / "tools" / "link_emulator.py"
LINK_READY = re.compile(r"^ready (\S+) ")
CLOSED = re.compile(r"^closed: (\d+) bytes up, (\d+) bytes down")


class BenchError(Exception):
    pass


@dataclass
class Proc:
    proc: subprocess.Popen[bytes]
    log: Path
    pids: list[int]
    address: str = ""

    def stop(self) -> None:
        stop_process(self.proc)


def cpu_ns(pid: int) -> int:
    """CPU time of all threads of a live process so far, in ns (0 when it is gone)."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[0])
    except OSError:
        pass
    return total


_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_ns(pid: int) -> int:
    """User and system CPU of a whole process so far, threads that ended included (kernel ticks: 10 ms steps),
    in ns; ``cpu_ns`` is finer but counts only the threads alive now."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // _TICK


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a live process, in KiB (0 when it is gone)."""
    out = {"VmRSS": 0, "VmHWM": 0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in out:
                out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def start_stage(model: Path, layers: tuple[int, int], threads: int, poll: int | None, logdir: Path,
                max_sessions: int, session_tokens: int, timeout: float = 120.0) -> Proc:
    log = logdir / f"serve-{layers[0]}-{layers[1]}.log"
    cmd = [sys.executable, "-m", "meshd.cli", "serve", "--model", str(model), "--layers", f"{layers[0]}:{layers[1]}",
           "--listen", "127.0.0.1:0", "--threads", str(threads), "--max-sessions", str(max_sessions),
           "--session-tokens", str(session_tokens)]
    if poll is not None:
        cmd += ["--poll", str(poll)]
    f = log.open("wb")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            m = STAGE_READY.match(line)
            if m:
                return Proc(proc, log, [int(m.group(2)), int(m.group(3))], m.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise BenchError(f"meshd serve --layers {layers[0]}:{layers[1]} did not become ready: "
                     + log.read_text(errors="replace").strip()[-500:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rpc_server(threads: int, logdir: Path, i: int, timeout: float = 30.0) -> Proc:
    port = free_port()
    log = logdir / f"rpc-server-{i}.log"
    f = log.open("wb")
    proc = subprocess.Popen([str(TOOLS / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
                            stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                pass
            # a probe connection is a client to it; give it a moment to drop that one
            time.sleep(0.2)
            return Proc(proc, log, [proc.pid], f"127.0.0.1:{port}")
        except OSError:
            time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise BenchError(f"ggml-rpc-server did not start: {log.read_text(errors='replace').strip()[-300:]}")


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of pid onto cores (threads started later inherit their creator's affinity)."""
    tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()] if Path(f"/proc/{pid}/task").exists() else [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


def affinity(pid: int) -> list[int]:
    """The cores the threads of pid may run on, all together."""
    out: set[int] = set()
    try:
        for t in Path(f"/proc/{pid}/task").iterdir():
            out |= os.sched_getaffinity(int(t.name))
    except OSError:
        pass
    return sorted(out)


def start_proxy(target: str, delay_ms: float, logdir: Path, name: str, timeout: float = 30.0) -> Proc:
    log = logdir / f"link-{name}-{delay_ms:g}ms.log"
    f = log.open("wb")
    proc = subprocess.Popen([sys.executable, str(EMULATOR), "--listen", "127.0.0.1:0", "--to", target,
                             "--delay-ms", f"{delay_ms:g}"], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = LINK_READY.match(log.read_text(errors="replace"))
        if m:
            return Proc(proc, log, [proc.pid], m.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise BenchError(f"link_emulator to {target} did not start: {log.read_text(errors='replace').strip()[-300:]}")


def carried(proxy: Proc) -> list[tuple[int, int]]:
    """(bytes up, bytes down) of each connection the (stopped) proxy carried."""
    return [(int(m.group(1)), int(m.group(2))) for m in
            (CLOSED.match(line) for line in proxy.log.read_text(errors="replace").splitlines()) if m]


def exited_children_cpu_ns() -> int:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return int((r.ru_utime + r.ru_stime) * 1e9)
