"""Local `meshd` processes (tests, demo, benchmarks): started, awaited until ready, always stopped."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

READY = re.compile(r"^ready (\S+) pid=(\d+) (?:worker|node)=(\w+)")


@dataclass
class Served:
    proc: subprocess.Popen[str]
    address: str
    worker_pid: int
    lines: list[str] = field(default_factory=list)
    node_id: str = ""
    log: Path | None = None

    def stop(self) -> None:
        stop_process(self.proc)
        if self.log is not None:
            self.log.unlink(missing_ok=True)


def stop_process(proc: subprocess.Popen[str] | subprocess.Popen[bytes]) -> None:
    """SIGTERM (a daemon leaves gracefully), then SIGKILL if it takes too long."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def meshd_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshd.cli", *args]


def start_serve(*args: str, timeout: float = 60.0) -> Served:
    """`meshd serve ARGS --listen 127.0.0.1:0`, returned once it prints its ready line."""
    return start_meshd("serve", *args, timeout=timeout)


def start_join(*args: str, timeout: float = 60.0) -> Served:
    """`meshd join ARGS --listen 127.0.0.1:0`, returned once it prints its ready line."""
    return start_meshd("join", *args, timeout=timeout)


def start_meshd(command: str, *args: str, timeout: float = 60.0) -> Served:
    """Output goes to a log file, not a pipe: a pipe nobody reads would block a chatty daemon."""
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    log = tempfile.NamedTemporaryFile("w+", prefix=f"meshd-{command}-", suffix=".log", delete=False)
    proc = subprocess.Popen(meshd_command(command, "--listen", "127.0.0.1:0", *args), stdout=log,
                            stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    while time.monotonic() < deadline and proc.poll() is None:
        lines = Path(log.name).read_text().splitlines()
        for line in lines:
            m = READY.match(line)
            if m:
                worker = m.group(3)
                return (Served(proc, m.group(1), int(worker), lines, log=Path(log.name)) if worker.isdigit()
                        else Served(proc, m.group(1), 0, lines, node_id=worker, log=Path(log.name)))
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    lines = Path(log.name).read_text().splitlines()
    raise RuntimeError(f"meshd {command} did not become ready:\n" + "\n".join(lines))


def run_meshd(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(meshd_command(*args), capture_output=True, text=True, timeout=timeout,
                          env=os.environ | {"PYTHONUNBUFFERED": "1"})


def copy_with_other_digest(src: Path, dst: Path) -> Path:
    """The same model with one byte changed in the last tensor's data: loads alike, hashes differently."""
    data = bytearray(src.read_bytes())
    data[-7] ^= 0x01
    dst.write_bytes(bytes(data))
    return dst
