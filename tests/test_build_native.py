"""The native build refuses a tampered source or a patch that does not apply, in one clear line."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import build_native  # noqa: E402


@pytest.fixture
def cached_sdist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache holding a copy of the pinned sdist, so nothing here touches the real one."""
    lock = build_native.read_lock()
    name = f"{lock['package'].replace('-', '_')}-{lock['version']}.tar.gz"
    real = build_native.cache_root() / "sdist" / name
    if not real.exists():
        pytest.skip("the pinned sdist is not cached yet (tools/dev setup downloads it)")
    monkeypatch.setenv("MESHD_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "sdist").mkdir(parents=True)
    return Path(shutil.copy2(real, tmp_path / "cache" / "sdist" / name))


def test_wrong_sha256_stops_the_build_and_drops_the_file(cached_sdist: Path) -> None:
    lock = build_native.read_lock() | {"sha256": "0" * 64}
    with pytest.raises(build_native.BuildError, match="sha256 mismatch .* expected 0{64}, got [0-9a-f]{64}"):
        build_native.fetch_sdist(lock)
    assert not cached_sdist.exists()


def test_patch_that_does_not_apply_is_named(cached_sdist: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "0001-bad.patch"
    bad.write_text("--- a/src/llama.cpp\n+++ b/src/llama.cpp\n@@ -1,3 +1,3 @@\n-no such line\n+nor this\n context\n")
    monkeypatch.setattr(build_native, "patches", lambda: [bad])
    with pytest.raises(build_native.BuildError, match="patch 0001-bad.patch does not apply to llama.cpp 0c1e570"):
        build_native.unpack_and_patch(cached_sdist, build_native.read_lock(), tmp_path / "src")


def test_unreachable_source_is_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    env = {"MESHD_CACHE": str(tmp_path / "empty"), "PATH": "/usr/bin:/bin", "PIP_NO_INDEX": "1",
           "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "build_native.py")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("build_native: pip could not download llama-cpp-python==0.3.36")
