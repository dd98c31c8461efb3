"""Network namespaces for tests: tools/netns_lab.py (shared with tools/soak.py), and the tests' rule for a
machine that cannot make them."""

from __future__ import annotations

import os

import pytest
from netns_lab import (
    PREFIX,
    ROOT,
    Bridge,
    Machine,
    Process,
    StatusProbe,
    meshd_argv,
    name,
    remove_stale,
    sh,
    unavailable,
)

__all__ = ["PREFIX", "ROOT", "Bridge", "Machine", "Process", "StatusProbe", "meshd_argv", "name", "remove_stale",
           "require", "sh", "unavailable"]


def require() -> None:
    """Skips the test where namespaces cannot be made, or fails it where CI says they must be
    (MESHD_REQUIRE_NETNS=1, set by .ci/run)."""
    reason = unavailable()
    if reason is None:
        return
    if os.environ.get("MESHD_REQUIRE_NETNS") == "1":
        pytest.fail(f"network namespaces are required here (MESHD_REQUIRE_NETNS=1) but unavailable: {reason}")
    pytest.skip(f"network namespaces unavailable: {reason}")
