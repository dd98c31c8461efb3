"""The native build refuses a tampered source or a patch that does not apply, in one clear line."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import build_native
import pytest

ROOT = Path(__file__).resolve().parent.parent


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


def tiny_sdist(path: Path, files: dict[str, str], version: str | None = None) -> Path:
    """An sdist of the pinned package's layout (of `version`, else the pinned one) holding only `files`
    of its llama.cpp tree: unpacking the real one (some 10 s) shows nothing more about a patch."""
    lock = build_native.read_lock()
    prefix = f"{lock['package'].replace('-', '_')}-{version or lock['version']}/vendor/llama.cpp/"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            member = tarfile.TarInfo(prefix + name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return path


@pytest.mark.slow
def test_patch_that_does_not_apply_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sdist = tiny_sdist(tmp_path / "sdist.tar.gz", {"src/llama.cpp": "one\ntwo\ncontext\n"})
    good = tmp_path / "0001-good.patch"
    good.write_text("--- a/src/llama.cpp\n+++ b/src/llama.cpp\n@@ -1,3 +1,3 @@\n-one\n+ONE\n two\n context\n")
    bad = tmp_path / "0002-bad.patch"
    bad.write_text("--- a/src/llama.cpp\n+++ b/src/llama.cpp\n@@ -1,3 +1,3 @@\n-no such line\n+nor this\n context\n")
    monkeypatch.setattr(build_native, "patches", lambda: [good, bad])
    with pytest.raises(build_native.BuildError, match="patch 0002-bad.patch does not apply to llama.cpp 0c1e570"):
        build_native.unpack_and_patch(sdist, build_native.read_lock(), tmp_path / "src")
    assert not (tmp_path / "src").exists()  # no half-patched tree is left where a build would take it
    monkeypatch.setattr(build_native, "patches", lambda: [good])
    build_native.unpack_and_patch(sdist, build_native.read_lock(), tmp_path / "src")
    assert (tmp_path / "src" / "src" / "llama.cpp").read_text() == "ONE\ntwo\ncontext\n"


def test_a_hunk_whose_context_is_off_by_a_line_fails_by_name_instead_of_landing_by_fuzz(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # GNU patch's default fuzz of 2 would apply this hunk with its first context line ignored
    sdist = tiny_sdist(tmp_path / "sdist.tar.gz", {"src/llama.cpp": "one\ntwo\nthree\nfour\nfive\n"})
    fuzzy = tmp_path / "0001-fuzzy.patch"
    fuzzy.write_text("--- a/src/llama.cpp\n+++ b/src/llama.cpp\n@@ -1,5 +1,5 @@\n ONE\n two\n-three\n+THREE\n"
                     " four\n five\n")
    monkeypatch.setattr(build_native, "patches", lambda: [fuzzy])
    with pytest.raises(build_native.BuildError, match=r"0001-fuzzy.patch does not apply .*: src/llama.cpp: Hunk #1 "
                                                      r"FAILED at 1"):
        build_native.unpack_and_patch(sdist, build_native.read_lock(), tmp_path / "src")


def test_a_rebase_reports_each_patch_and_hunk_against_another_release(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # (the other release's tree: a line more at the top, and "two" rewritten)
    files = {"src/llama.cpp": "new first line\na\none\nTWO\ncontext\n"}
    monkeypatch.setattr(build_native, "download_sdist",
                        lambda package, version, dest: tiny_sdist(dest / "other.tar.gz", files, version))
    moved = tmp_path / "0001-moved.patch"
    moved.write_text("--- a/src/llama.cpp\n+++ b/src/llama.cpp\n@@ -1,3 +1,3 @@\n a\n-one\n+ONE\n TWO\n")
    gone = tmp_path / "0002-gone.patch"
    gone.write_text("--- a/src/llama.cpp\n+++ b/src/llama.cpp\n@@ -3,2 +3,2 @@\n-two\n+2\n context\n")
    monkeypatch.setattr(build_native, "patches", lambda: [moved, gone])
    assert build_native.rebase_report("9.9.9") == 1
    out = capsys.readouterr().out
    assert "llama-cpp-python 9.9.9 (sha256 " in out
    assert "0001-moved.patch: applies, 1 moved" in out and "moved  src/llama.cpp: Hunk #1 succeeded at 2" in out
    assert "0002-gone.patch: 1 hunk(s) fail" in out and "FAILED src/llama.cpp: Hunk #1 FAILED at 3" in out
    assert out.strip().endswith("1 of 2 patches need work")


@pytest.mark.slow
def test_unreachable_source_is_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    env = {"MESHD_CACHE": str(tmp_path / "empty"), "PATH": "/usr/bin:/bin", "PIP_NO_INDEX": "1",
           "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "build_native.py")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("build_native: pip could not download llama-cpp-python==0.3.36")


def test_unpacking_works_and_stays_inside_on_a_python_without_tar_filters(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Debian 12's own python3.11 is 3.11.2: its tarfile has no data filter and extractall takes no
    # filter argument (the first command on a stock system ended in a TypeError traceback)
    real = tarfile.TarFile.extractall

    def extractall_of_3_11_2(self: tarfile.TarFile, path: str | Path = ".", members: object = None, *,
                             numeric_owner: bool = False) -> None:
        real(self, path, members, numeric_owner=numeric_owner, filter="fully_trusted")  # type: ignore[arg-type]

    monkeypatch.delattr(tarfile, "data_filter")
    monkeypatch.setattr(tarfile.TarFile, "extractall", extractall_of_3_11_2)
    monkeypatch.setattr(build_native, "patches", lambda: [])
    sdist = tiny_sdist(tmp_path / "sdist.tar.gz", {"src/llama.cpp": "one\n", "ggml/x.h": "two\n"})
    build_native.unpack_and_patch(sdist, build_native.read_lock(), tmp_path / "src")
    assert (tmp_path / "src" / "src" / "llama.cpp").read_text() == "one\n"
    # a member that would land outside the tree is refused, and nothing is written there
    evil = tiny_sdist(tmp_path / "evil.tar.gz", {"src/llama.cpp": "one\n", "../../escaped": "x\n"})
    with pytest.raises(build_native.BuildError, match="not a plain file or directory inside its tree"):
        build_native.unpack_and_patch(evil, build_native.read_lock(), tmp_path / "src2" / "src")
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "src2" / "escaped").exists()
