"""Network namespaces for tests: whether they can be made, and the leftovers of killed runs.

Every namespace a test makes is named ``meshd-<pid>-<tag>-<role>``, <pid> being the
test process that made it, so a later run can tell a leftover (its maker is dead)
from the live topology of a run going on beside it.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import time

import pytest

PREFIX = "meshd-"
# meshd-<pid>-...: a maker's PID; older names (meshd-<hex>-<role>, meshd-probe-<hex>) have none
_OWNED = re.compile(r"^meshd-(\d+)-")
# longer than any run of the netns tests: an unnamed maker's namespace older than this is a leftover
LEGACY_MAX_AGE = 3600.0


def name(tag: str, role: str) -> str:
    return f"{PREFIX}{os.getpid()}-{tag}-{role}"


def unavailable() -> str | None:
    """Why this machine cannot make network namespaces, or None. Tries it rather than guessing."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = name(secrets.token_hex(3), "probe")
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or 'ip netns add failed'}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def require() -> None:
    """Skips the test where namespaces cannot be made, or fails it where CI says they must be
    (MESHD_REQUIRE_NETNS=1, set by .ci/run)."""
    reason = unavailable()
    if reason is None:
        return
    if os.environ.get("MESHD_REQUIRE_NETNS") == "1":
        pytest.fail(f"network namespaces are required here (MESHD_REQUIRE_NETNS=1) but unavailable: {reason}")
    pytest.skip(f"network namespaces unavailable: {reason}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _older_than(ns: str, seconds: float) -> bool:
    try:
        made = os.stat(f"/run/netns/{ns}").st_mtime
    except OSError:
        return False
    return time.time() - made > seconds


def stale() -> list[str]:
    """meshd-* namespaces left by killed runs: their maker is dead, or (older names, no maker
    recorded) they are older than any run lasts. An older name without processes is no sign:
    a router namespace never holds one."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    found = []
    for line in listed.stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if not ns.startswith(PREFIX):
            continue
        owned = _OWNED.match(ns)
        if (not _alive(int(owned.group(1)))) if owned else _older_than(ns, LEGACY_MAX_AGE):
            found.append(ns)
    return found


def remove_stale() -> list[str]:
    """Deletes stale meshd-* namespaces (their veths go with them); returns their names."""
    gone = stale()
    for ns in gone:
        # what still runs inside a dead run's namespace is that run's too
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    return gone
