"""Network namespaces for the tests and tools/soak.py: "machines" on one bridge, each with its own HOME,
homes behind MASQUERADE NATs, and meshd run inside them (root only; tests/netns.py adds the tests' skip rule).

Every namespace is named ``meshd-p<pid>-<role>`` after the test process that
made it, so a later run can tell a stale one (its maker is gone) from one a
running test still uses, and remove only the stale. Traffic stays inside the
namespaces: the bridge lives in a namespace of its own, not on the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localmesh import READY, spawn, stop_process, terminate_together

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "meshd-"
# meshd-p<pid>-... (or meshd-<pid>-...): the PID of the test process that made it
_OURS = re.compile(r"^meshd-p?(\d+)-")
# A namespace of another naming (an older test) is stale once it holds no process for this long.
_LEGACY_STALE_AFTER = 600.0


def sh(*argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done


def name(tag: str, role: str) -> str:
    return f"{PREFIX}p{os.getpid()}-{tag}-{role}"


def unavailable() -> str | None:
    """Why this machine cannot build namespaces, or None. Tries it rather than guessing."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = name(secrets.token_hex(2), "probe")
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or 'ip netns add failed'}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Deletes the ``meshd-*`` namespaces a killed run left behind; returns their names.

    Ours are stale when the test process named in them is gone; others when
    they hold no process and are old enough that no test is still building them."""
    listed = sh("ip", "netns", "list", check=False).stdout.split("\n")
    removed = []
    for line in listed:
        name = line.split(" ", 1)[0].strip()
        if not name.startswith(PREFIX):
            continue
        ours = _OURS.match(name)
        if ours is not None:
            stale = not _alive(int(ours.group(1)))
        else:
            pids = sh("ip", "netns", "pids", name, check=False).stdout.split()
            try:
                age = time.time() - os.stat(f"/run/netns/{name}").st_mtime
            except OSError:
                age = 0.0
            stale = not pids and age > _LEGACY_STALE_AFTER
        if stale:
            for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


@dataclass
class Process:
    name: str
    proc: subprocess.Popen[str]
    log: Path
    address: str = ""
    node_id: str = ""

    def stop(self) -> None:
        stop_process(self.proc)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float) -> Process:
        """Returns once meshd's ready line is in the log (its address and node id taken from it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            for line in self.text().splitlines():
                m = READY.match(line)
                if m:
                    self.address, self.node_id = m.group(1), m.group(3)
                    return self
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not become ready:\n{self.text()}")


# The status probe's loop: one address a line in, `meshd status --json`'s document (or {} if it did not
# answer) a line out.
_PROBE = """
import argparse, json, sys, trio
from meshd import status_table
from meshd.cli.status import ask_status

async def ask(address):
    with trio.fail_after(60):
        return status_table.as_json(await ask_status(argparse.Namespace(seed=address, mesh_key=None, timeout=20.0,
                                                                        state_dir=None)))

for line in sys.stdin:
    try:
        doc = trio.run(ask, line.strip())
    except Exception:
        doc = {}
    print(json.dumps(doc), flush=True)
"""


class StatusProbe:
    """What `meshd status --json --seed ADDRESS` prints, asked from one lasting process in a namespace: a
    test polling a mesh each second by a new `meshd status` paid a Python start-up (about a second of CPU)
    per poll."""

    def __init__(self, namespace: str) -> None:
        self.proc = spawn(["ip", "netns", "exec", namespace, sys.executable, "-c", _PROBE], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def status(self, address: str) -> dict[str, Any]:
        """The member at ``address``'s status document ({} while it does not answer)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(address + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the status probe ended (exit {self.proc.poll()})")
        doc: dict[str, Any] = json.loads(line)
        return doc

    def stop(self) -> None:
        stop_process(self.proc)


@dataclass
class Machine:
    """A namespace with one address on the bridge and a HOME of its own."""

    role: str
    namespace: str
    ip: str
    home: Path
    # the far end of its link (namespace, device): set down, its packets are dropped, nothing is closed
    port: tuple[str, str] = ("", "")

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
        # The worktree's packages, whatever the cwd of the command.
        path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        return env | {"HOME": str(self.home), "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


@dataclass
class Bridge:
    """Machines ``10.77.0.1``, ``.2``, ... on one bridge (in a namespace of its own)."""

    base: Path
    subnet: str = "10.77.0"
    tag: str = field(default_factory=lambda: f"p{os.getpid()}")
    machines: dict[str, Machine] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)
    processes: list[Process] = field(default_factory=list)
    probes: dict[str, StatusProbe] = field(default_factory=dict)
    _ports: int = 0

    @property
    def hub(self) -> str:
        return f"{PREFIX}{self.tag}-br"

    def build(self, roles: list[str]) -> None:
        self._add_namespace(self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for role in roles:
            self.add(role)

    def add(self, role: str) -> Machine:
        """One more machine on the bridge, at the next address."""
        index = self._ports + 1
        self._ports = index
        namespace = f"{PREFIX}{self.tag}-{role}"
        self._add_namespace(namespace)
        ip = f"{self.subnet}.{index}"
        # Both ends are made inside the namespaces: nothing appears on the host, even for a moment.
        sh("ip", "-n", self.hub, "link", "add", f"p{index}", "type", "veth", "peer", "name", "eth0",
           "netns", namespace)
        sh("ip", "-n", self.hub, "link", "set", f"p{index}", "master", "br0", "up")
        sh("ip", "-n", namespace, "addr", "add", f"{ip}/24", "dev", "eth0")
        sh("ip", "-n", namespace, "link", "set", "eth0", "up")
        home = self.base / role
        home.mkdir(parents=True, exist_ok=True)
        self.machines[role] = Machine(role, namespace, ip, home, (self.hub, f"p{index}"))
        return self.machines[role]

    def add_behind_nat(self, role: str, lan: int) -> Machine:
        """A home machine ``10.<lan>.0.2`` behind a router on the bridge (``<role>-nat``) that MASQUERADEs
        its traffic and drops new inbound connections, as a home router does; its port is the router's
        inner end."""
        router = self.add(f"{role}-nat")
        namespace = f"{PREFIX}{self.tag}-{role}"
        self._add_namespace(namespace)
        sh("ip", "-n", router.namespace, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0",
           "netns", namespace)
        sh("ip", "-n", router.namespace, "addr", "add", f"10.{lan}.0.1/24", "dev", "lan0")
        sh("ip", "-n", router.namespace, "link", "set", "lan0", "up")
        sh("ip", "-n", namespace, "addr", "add", f"10.{lan}.0.2/24", "dev", "eth0")
        sh("ip", "-n", namespace, "link", "set", "eth0", "up")
        sh("ip", "-n", namespace, "route", "add", "default", "via", f"10.{lan}.0.1")
        # /proc rather than sysctl(8), which minimal images lack; the setting is per namespace.
        sh("ip", "netns", "exec", router.namespace, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        ipt = ["ip", "netns", "exec", router.namespace, "iptables"]
        sh(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE")
        sh(*ipt, "-A", "FORWARD", "-i", "eth0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        sh(*ipt, "-A", "FORWARD", "-i", "eth0", "-j", "DROP")
        home = self.base / role
        home.mkdir(parents=True, exist_ok=True)
        self.machines[role] = Machine(role, namespace, f"10.{lan}.0.2", home, (router.namespace, "lan0"))
        return self.machines[role]

    def link(self, role: str, up: bool) -> None:
        """Takes `role`'s link down (its packets dropped) or brings it back up."""
        namespace, dev = self.machines[role].port
        sh("ip", "-n", namespace, "link", "set", dev, "up" if up else "down")

    def _add_namespace(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")

    def run(self, role: str, argv: list[str], timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
        machine = self.machines[role]
        return subprocess.run(["ip", "netns", "exec", machine.namespace, *argv], capture_output=True, text=True,
                              timeout=timeout, env=machine.env(), cwd=machine.home)

    def start(self, name: str, role: str, argv: list[str], *, timeout: float = 90.0,
              env: dict[str, str] | None = None) -> Process:
        """Starts `argv` in `role`'s namespace; returns once it prints meshd's ready line."""
        return self.launch(name, role, argv, env=env).wait_ready(timeout)

    def launch(self, name: str, role: str, argv: list[str], *, env: dict[str, str] | None = None) -> Process:
        """Starts `argv` in `role`'s namespace, its output in ``<base>/<name>.log``, and returns at once."""
        machine = self.machines[role]
        log = self.base / f"{name}.log"
        with log.open("w") as out:
            # `ip netns exec` execs the command: the PID is the daemon's own. spawn: its own process group,
            # and SIGKILLed if this process dies before it could stop it.
            proc = spawn(["ip", "netns", "exec", machine.namespace, *argv], stdout=out, stderr=subprocess.STDOUT,
                         text=True, env=machine.env() | (env or {}), cwd=machine.home)
        process = Process(name, proc, log)
        self.processes.append(process)
        return process

    def probe(self, role: str) -> StatusProbe:
        """The lasting status asker in ``role``'s namespace."""
        if role not in self.probes:
            self.probes[role] = StatusProbe(self.machines[role].namespace)
        return self.probes[role]

    def logs(self, tail: int = 4000) -> str:
        return "\n".join(f"----- {p.name}\n{p.text()[-tail:]}" for p in self.processes)

    def tear_down(self) -> list[str]:
        """Stops every process by PID, then deletes every namespace; goes on past any error."""
        errors: list[str] = []
        try:
            terminate_together([*(p.proc for p in self.processes), *(p.proc for p in self.probes.values())])
        except Exception as exc:  # teardown reports and goes on
            errors.append(f"stopping every process: {exc!r}")
        for process in [*self.processes, *self.probes.values()]:
            try:
                process.stop()
            except Exception as exc:  # teardown reports and goes on
                errors.append(f"stopping {process.name}: {exc!r}")
        for namespace in reversed(self.namespaces):
            try:
                sh("ip", "netns", "del", namespace)
            except Exception as exc:
                errors.append(f"deleting {namespace}: {exc!r}")
        return errors


def meshd_argv(words: list[str]) -> list[str]:
    """A `meshd ...` command line as this checkout's interpreter runs it."""
    assert words[0] == "meshd", words
    return [sys.executable, "-m", "meshd.cli", *words[1:]]
