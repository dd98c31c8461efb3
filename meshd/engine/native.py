"""cffi ABI-mode binding of libmeshengine: the cdef is read from native/meshengine.h."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import cffi

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LIB_NAME = "libmeshengine.so"
# tools/build_native.py's record of the sources a library was built from (beside it)
SOURCES_NAME = "sources.json"


class EngineUnavailable(Exception):
    """The native library is missing or was built from another header."""


def checkout_dir() -> Path:
    """The checkout's build of tools/build_native.py: build/native, or with MESHD_VULKAN=1 the build
    with ggml's Vulkan backend (MESHD_VULKAN=1 tools/build_native.py), build/native-vulkan."""
    return ROOT / "build" / ("native-vulkan" if os.environ.get("MESHD_VULKAN") == "1" else "native")


def library_dirs() -> list[Path]:
    """Where the library is looked for, in order: beside the package (an installed wheel), then
    $MESHD_ENGINE_DIR, then the checkout's build (checkout_dir: tools/build_native.py, editable installs)."""
    override = os.environ.get("MESHD_ENGINE_DIR")
    return [HERE, *([Path(override)] if override else []), checkout_dir()]


def _library_dir() -> Path:
    """The first of library_dirs() that holds the library and its header."""
    places = library_dirs()
    for directory in places:
        if (directory / LIB_NAME).exists() and (directory / "meshengine.h").exists():
            return directory
    raise EngineUnavailable(f"{LIB_NAME} is in none of {', '.join(map(str, places))}: "
                            "build it with `python tools/build_native.py`, or install a meshd wheel")


def _cdef_from_header(text: str) -> str:
    try:
        body = text.split("/* cdef-begin */", 1)[1].split("/* cdef-end */", 1)[0]
    except IndexError as exc:
        raise EngineUnavailable("meshengine.h lacks its cdef markers") from exc
    return re.sub(r"\bME_API\s+", "", body)


@lru_cache(maxsize=1)
def load() -> tuple[cffi.FFI, Any]:
    """The ffi and the library, loaded once per process.

    The library is cffi's dlopen handle, typed Any: its attributes are the
    header's functions and constants, known only once the cdef is parsed.
    """
    directory = _library_dir()
    if directory == checkout_dir():
        _check_sources(directory)
    lib_path = directory / LIB_NAME
    # The header installed beside the library is the one it was built from.
    header = directory / "meshengine.h"
    ffi = cffi.FFI()
    ffi.cdef(_cdef_from_header(header.read_text()))
    lib = ffi.dlopen(str(lib_path))
    _check_abi(ffi, lib)
    return ffi, lib


@lru_cache(maxsize=1)
def build_fingerprint() -> str:
    """The numerics of this engine build on this machine: the library's own bytes (the llama.cpp pin,
    the patches, the build options, the instruction set it was built for) and the machine's
    architecture. Two stages with the same fingerprint compute the same bytes for the same input
    (the engine is batch-invariant); across fingerprints rows differ in their last bits."""
    lib_path = _library_dir() / LIB_NAME
    digest = hashlib.sha256(lib_path.read_bytes()).hexdigest()[:16]
    return f"{digest}/{platform.machine()}"


def _check_sources(directory: Path) -> None:
    """A checkout's library must be of the checkout's own native sources. The ABI and struct checks
    do not see a change inside the engine (a library from before a batch-invariance fix loaded
    without a word and gave other numbers)."""
    rebuild = "rebuild it with `python tools/build_native.py`"
    try:
        record = json.loads((directory / SOURCES_NAME).read_text())
        files: dict[str, str] = record["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise EngineUnavailable(f"{directory / LIB_NAME} has no record of the sources it was built from: "
                                f"{rebuild}") from None
    patches = {str(p.relative_to(ROOT)) for p in (ROOT / "native" / "patches").glob("*.patch")}
    recorded = {rel for rel in files if rel.startswith("native/patches/")}
    # a patch added since the build, or a recorded file changed or gone
    changed = sorted((patches - recorded) | {rel for rel, digest in files.items() if _sha256_of(ROOT / rel) != digest})
    if changed:
        raise EngineUnavailable(f"{directory / LIB_NAME} was built from other sources than this checkout's "
                                f"({', '.join(changed)}): {rebuild}")


def _sha256_of(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _check_abi(ffi: cffi.FFI, lib: Any) -> None:
    if lib.me_abi_version() != lib.ME_ABI_VERSION:
        raise EngineUnavailable(
            f"{LIB_NAME} speaks ABI {lib.me_abi_version()}, the header {lib.ME_ABI_VERSION}: rebuild it"
        )
    structs = {
        lib.ME_STRUCT_MODEL_INFO: "me_model_info",
        lib.ME_STRUCT_CONTEXT_PARAMS: "me_context_params",
        lib.ME_STRUCT_SAMPLER_PARAMS: "me_sampler_params",
        lib.ME_STRUCT_CHAT_MESSAGE: "me_chat_message",
        lib.ME_STRUCT_DEVICE_INFO: "me_device_info",
    }
    for which, name in structs.items():
        native, ours = lib.me_struct_size(which), ffi.sizeof(name)
        if native != ours:
            raise EngineUnavailable(f"struct {name} is {native} bytes in {LIB_NAME} but {ours} here: rebuild it")
