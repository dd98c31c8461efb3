"""Puts libmeshengine.so (and the header it was built from) into the wheel, beside meshd/engine.

The metadata is in pyproject.toml; this file only adds the native library. It
comes from tools/build_native.py: its pinned, sha256-checked llama.cpp sdist,
our patches, and its cache (~/.cache/meshd/native/<key>), so a wheel built on a
machine that has built once takes seconds. An editable install (tools/dev's
`pip install -e`) copies nothing: the package finds build/native/ of the checkout.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sysconfig
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def native_library() -> Path:
    """libmeshengine.so of this tree's build key: from the cache, else built by tools/build_native.py."""
    spec = importlib.util.spec_from_file_location("build_native", ROOT / "tools" / "build_native.py")
    assert spec is not None and spec.loader is not None
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    cached = native.cache_root() / "native" / native.build_key() / native.LIB_NAME
    if cached.exists():
        return cached
    try:
        return native.build(os.cpu_count() or 2, verbose=False).resolve()
    except native.BuildError as exc:
        raise SystemExit(f"build_native: {exc}") from None


class BuildPyWithEngine(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        library = native_library()
        target = Path(self.build_lib) / "meshd" / "engine"
        target.mkdir(parents=True, exist_ok=True)
        for name in (library.name, "meshengine.h"):
            shutil.copy2(library.parent / name, target / name)


class WithNativeLibrary(Distribution):
    """A distribution that carries a platform's binary, so its wheel is a platform wheel."""

    def has_ext_modules(self) -> bool:
        return True


class PlatformWheel(bdist_wheel):
    """Tagged for this platform but any Python 3: the library is bound through cffi's ABI mode,
    so it depends on no CPython ABI, only on the machine it was built for."""

    def get_tag(self) -> tuple[str, str, str]:
        return "py3", "none", sysconfig.get_platform().replace("-", "_").replace(".", "_")


setup(distclass=WithNativeLibrary, cmdclass={"build_py": BuildPyWithEngine, "bdist_wheel": PlatformWheel})
