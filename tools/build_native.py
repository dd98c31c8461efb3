#!/usr/bin/env python3
"""Fetch the pinned llama.cpp, apply our patch series and build libmeshengine.

The source is the llama-cpp-python source distribution named in
native/llama.lock (it vendors llama.cpp), fetched with pip and checked by
sha256. Builds are cached outside the checkout, keyed by the hash of the lock,
the patches, our C API and the build options, so a fresh clone reuses a build
and only a change to one of those rebuilds.

With --tools it also builds llama.cpp's own `llama-bench`, `ggml-rpc-server`
and `llama-batched-bench` from the same patched tree and the same ggml options (RPC on,
OpenMP off, static), in a build directory of their own (build/cmake-tools), so
the library's build is never invalidated. They are cached like the library,
keyed by the lock, the patches and the options, and found at
build/native-tools/bin/. tools/bench_pipeline.py, bench_network.py and
bench_throughput.py compare meshd against them.

With --rebase VERSION it builds nothing: it applies the series to the llama.cpp
that llama-cpp-python VERSION vendors and reports each patch and hunk that no
longer applies (patches apply with no fuzz, so a hunk lands where it says or
fails by name).

With MESHD_VULKAN=1 it builds the library with ggml's Vulkan backend as well, keyed apart
and linked at build/native-vulkan (meshd picks it with MESHD_VULKAN=1), beside the CPU one.

Prints one clear line and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "native"
BUILD = ROOT / "build"
LIB_NAME = "libmeshengine.so"
# llama.cpp's own programs, built from the same patched tree by --tools
TOOL_TARGETS = ["llama-bench", "ggml-rpc-server", "llama-batched-bench"]
# The built tree's architecture table and range-support list, kept beside the library: a
# fresh clone that finds its build cached has no unpacked tree, and tests read which
# architectures this build accepts from it.
ARCH_SOURCE = "llama-arch.cpp"
# What a cache entry holds; part of the key, so an entry from before a file was added is rebuilt.
CACHE_LAYOUT = 2
# Files whose content decides what the build produces.
KEYED_FILES = ["native/llama.lock", "native/meshengine.h", "native/meshengine.cpp", "CMakeLists.txt"]
# Beside the library: the sha256 of each file it was built from (meshd.engine.native checks a
# checkout's build/native against its own files, so a library left from other sources is refused).
SOURCES_NAME = "sources.json"


class BuildError(Exception):
    pass


def cache_root() -> Path:
    base = os.environ.get("MESHD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "meshd"
    )
    return Path(base)


def read_lock() -> dict[str, str]:
    try:
        lock = tomllib.loads((NATIVE / "llama.lock").read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BuildError(f"cannot read native/llama.lock: {exc}") from exc
    for key in ("package", "version", "sha256", "llama_cpp_commit"):
        if key not in lock:
            raise BuildError(f"native/llama.lock lacks '{key}'")
    return lock


def patches() -> list[Path]:
    return sorted((NATIVE / "patches").glob("*.patch"))


def cmake_options() -> list[str]:
    # llamafile's sgemm takes every matmul of two or more rows and leaves one row to ggml's
    # vec_dot, which sums in another order: a position's logits would then depend on how many
    # positions shared its batch, and a failover's one-batch re-prefill or a verified draft would
    # part from the tokens decoded one by one. Said outright, not left to llama.cpp's default:
    # build/cmake's cache would otherwise keep whatever an earlier configure set.
    opts = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_RPC=ON", "-DGGML_LLAMAFILE=OFF"]
    if os.environ.get("MESHD_CUDA") == "1":
        opts.append("-DGGML_CUDA=ON")
    if vulkan():
        opts.append("-DGGML_VULKAN=ON")
    if os.environ.get("MESHD_NATIVE_CPU") == "1":
        opts.append("-DGGML_NATIVE=ON")
    elif platform.machine() in ("x86_64", "AMD64"):
        # One instruction set on every x86-64 machine (x86-64-v3), not the build machine's own:
        # ggml's kernels sum in another order under AVX-512 than under AVX2, so a native build on
        # one volunteer computes other bytes than on the next (measured here: logits off by up to
        # 0.00038 and a greedy token changed against the goldens, made on an AVX2 machine). A
        # replica must compute a range's exact bytes for verification to tell a liar from a CPU.
        opts += ["-DGGML_NATIVE=OFF", *(f"-DGGML_{isa}=ON" for isa in ("AVX", "AVX2", "FMA", "F16C", "BMI2"))]
    else:
        opts.append("-DGGML_NATIVE=OFF" if os.environ.get("MESHD_NATIVE_CPU") == "0" else "-DGGML_NATIVE=ON")
    return opts


def vulkan() -> bool:
    """MESHD_VULKAN=1: ggml's Vulkan backend too (a GPU of any vendor, or Mesa's lavapipe on the CPU)."""
    return os.environ.get("MESHD_VULKAN") == "1"


def flavour() -> str:
    """The suffix of this build's directories: a Vulkan build keeps its own cmake tree and its own
    build/native-vulkan, so the CPU library and it coexist and neither rebuild invalidates the other
    (the Vulkan shader generation, about half of its build, is not cached by ccache)."""
    return "-vulkan" if vulkan() else ""


def build_key() -> str:
    h = hashlib.sha256()
    for rel in KEYED_FILES:
        h.update(rel.encode() + b"\0" + (ROOT / rel).read_bytes() + b"\0")
    for p in patches():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(" ".join(cmake_options()).encode())
    h.update(f"\0layout {CACHE_LAYOUT}".encode())
    return h.hexdigest()[:16]


def tools_cmake_options() -> list[str]:
    """The library's ggml options, with llama.cpp's tools on (what the top CMakeLists forces off)."""
    return [*cmake_options(), "-DBUILD_SHARED_LIBS=OFF", "-DGGML_OPENMP=OFF", "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF"]


def tools_key() -> str:
    h = hashlib.sha256(b"tools\0")
    h.update((ROOT / "native/llama.lock").read_bytes() + b"\0")
    for p in patches():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(" ".join(tools_cmake_options() + TOOL_TARGETS).encode())
    return h.hexdigest()[:16]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_sdist(package: str, version: str, dest: Path) -> Path:
    """``package==version``'s source distribution, downloaded by pip into ``dest``."""
    name = f"{package.replace('-', '_')}-{version}.tar.gz"
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", "-d", tmp,
               f"{package}=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / name
        if not got.exists():
            # pip may stop at metadata preparation after saving the file; only the file matters.
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise BuildError(f"pip could not download {package}=={version}: {tail[0]}")
        return got.rename(dest / name)


def fetch_sdist(lock: dict[str, str]) -> Path:
    dest = cache_root() / "sdist"
    dest.mkdir(parents=True, exist_ok=True)
    sdist = dest / f"{lock['package'].replace('-', '_')}-{lock['version']}.tar.gz"
    if not sdist.exists():
        download_sdist(lock["package"], lock["version"], dest)
    digest = sha256_of(sdist)
    if digest != lock["sha256"]:
        sdist.unlink()
        raise BuildError(
            f"sha256 mismatch for {sdist.name}: expected {lock['sha256']}, got {digest} (file removed)"
        )
    return sdist


def extract(tar: tarfile.TarFile, members: list[tarfile.TarInfo], into: Path) -> None:
    """``members`` of ``tar`` under ``into``, none of them able to write outside it. Python's "data"
    filter does that from 3.11.4; Debian 12's own python3.11 is 3.11.2, whose extractall takes no
    filter, so there the same rule is kept here: plain files and directories, relative, no "..",
    modes without set-id bits."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(into, members=members, filter="data")
        return
    for m in members:
        parts = Path(m.name).parts
        if not (m.isfile() or m.isdir()) or Path(m.name).is_absolute() or ".." in parts:
            raise BuildError(f"{m.name!r} in the sdist is not a plain file or directory inside its tree")
        m.mode &= 0o755
    tar.extractall(into, members=members)


def unpack(sdist: Path, package: str, version: str, into: Path) -> None:
    """The llama.cpp tree the sdist vendors, at ``into`` (which must not exist)."""
    prefix = f"{package.replace('-', '_')}-{version}/vendor/llama.cpp/"
    into.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(prefix) or m.name == prefix.rstrip("/"):
                continue
            m.name = m.name[len(prefix):]
            if m.name.startswith(".git"):
                continue
            members.append(m)
        if not members:
            raise BuildError(f"{sdist.name} holds no vendor/llama.cpp tree")
        extract(tar, members, into)


class Applied(NamedTuple):
    """What one patch did to a tree: the hunks that did not apply, and those that landed elsewhere
    than the patch says (by whole lines, never by fuzz), each as "file: hunk #n ...". (Not a
    dataclass: setup.py runs this file as a module no import registered, where a dataclass fails.)"""

    failed: list[str]
    moved: list[str]


def apply_patch(tree: Path, patch: Path) -> Applied:
    """Applies ``patch`` to ``tree`` with no fuzz: a hunk whose context lines are not all there fails,
    loudly, instead of landing off-target (GNU patch's default takes up to two lines of fuzz, and
    ``--silent`` said nothing of it). A failed hunk is dropped (no .rej), the rest apply."""
    proc = subprocess.run(["patch", "-p1", "--batch", "--forward", "--fuzz=0", "--no-backup-if-mismatch",
                           "--reject-file=-", "-d", str(tree), "-i", str(patch)], capture_output=True, text=True)
    failed: list[str] = []
    moved: list[str] = []
    current = "?"
    out = (proc.stdout + proc.stderr).strip()
    for line in out.splitlines():
        if line.startswith(("patching file ", "checking file ")):
            current = line.split(" ", 2)[2].strip("'")
        elif line.startswith("Hunk #") and "FAILED" in line:
            failed.append(f"{current}: {line.strip().rstrip('.')}")
        elif line.startswith("Hunk #") and "offset" in line:
            moved.append(f"{current}: {line.strip().rstrip('.')}")
        elif "can't find file" in line or "Skipping patch" in line or "Reversed" in line:
            failed.append(f"{current}: {line.strip()}")
    if proc.returncode != 0 and not failed:
        failed.append(out.splitlines()[-1] if out else f"patch exited with {proc.returncode}")
    return Applied(failed, moved)


def unpack_and_patch(sdist: Path, lock: dict[str, str], src: Path) -> None:
    if src.exists():
        shutil.rmtree(src)
    tmp = src.with_name(src.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    unpack(sdist, lock["package"], lock["version"], tmp)
    for p in patches():
        applied = apply_patch(tmp, p)
        if applied.failed:
            raise BuildError(f"patch {p.name} does not apply to llama.cpp {lock['llama_cpp_commit'][:7]}: "
                             + "; ".join(applied.failed))
    tmp.rename(src)


def rebase_report(version: str) -> int:
    """Applies the series to the llama.cpp that llama-cpp-python ``version`` vendors and says, patch by
    patch, which hunks no longer apply and which moved: where a move to that release starts."""
    lock = read_lock()
    with tempfile.TemporaryDirectory() as tmp:
        sdist = download_sdist(lock["package"], version, Path(tmp))
        tree = Path(tmp) / "llama.cpp"
        unpack(sdist, lock["package"], version, tree)
        print(f"{lock['package']} {version} (sha256 {sha256_of(sdist)}) against the series made for "
              f"{lock['version']}:")
        failing = 0
        for p in patches():
            applied = apply_patch(tree, p)
            failing += bool(applied.failed)
            state = f"{len(applied.failed)} hunk(s) fail" if applied.failed else "applies"
            print(f"  {p.name}: {state}" + (f", {len(applied.moved)} moved" if applied.moved else ""))
            for what in applied.failed:
                print(f"    FAILED {what}")
            for what in applied.moved:
                print(f"    moved  {what}")
    print(f"{failing} of {len(patches())} patches need work" if failing else "every patch applies as it is")
    return 1 if failing else 0


def patched_source(lock: dict[str, str]) -> Path:
    """The patched llama.cpp tree at build/llama.cpp, unpacked again only when the lock or a patch changed."""
    sdist = fetch_sdist(lock)
    src = BUILD / "llama.cpp"
    stamp = BUILD / "llama.cpp.stamp"
    want = key_of_sources(lock)
    if not (stamp.exists() and stamp.read_text() == want and src.exists()):
        BUILD.mkdir(exist_ok=True)
        unpack_and_patch(sdist, lock, src)
        stamp.write_text(want)
    return src


def build_env() -> tuple[dict[str, str], list[str], list[str]]:
    """Environment, compiler-launcher options and generator options shared by both builds."""
    env = dict(os.environ)
    launcher = []
    if shutil.which("ccache"):
        launcher = ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
        env.setdefault("CCACHE_BASEDIR", str(ROOT))
        env.setdefault("CCACHE_DIR", str(cache_root() / "ccache"))
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    return env, launcher, generator


def sources_record() -> str:
    """What SOURCES_NAME holds: the keyed files and patches, by path from the checkout's root."""
    files = [*KEYED_FILES, *(str(p.relative_to(ROOT)) for p in patches())]
    return json.dumps({"files": {rel: sha256_of(ROOT / rel) for rel in files}}, indent=1, sort_keys=True)


def relink(link: Path, target: Path) -> None:
    BUILD.mkdir(exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def build(jobs: int, verbose: bool) -> Path:
    # one build at a time per checkout: two (`tools/dev setup` twice at once) unpacked into one tree,
    # and one failed renaming it ("Directory not empty")
    BUILD.mkdir(parents=True, exist_ok=True)
    with open(BUILD / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        return _build(jobs, verbose)


def _build(jobs: int, verbose: bool) -> Path:
    lock = read_lock()
    key = build_key()
    out = cache_root() / "native" / key
    link = BUILD / f"native{flavour()}"
    if not (out / LIB_NAME).exists():
        src = patched_source(lock)
        cmake_dir = BUILD / f"cmake{flavour()}"
        env, launcher, generator = build_env()
        configure = ["cmake", "-S", str(ROOT), "-B", str(cmake_dir), *generator,
                     f"-DLLAMA_SOURCE_DIR={src}", *cmake_options(), *launcher]
        run(configure, env, verbose, "cmake configure failed")
        run(["cmake", "--build", str(cmake_dir), "--target", "meshengine", "-j", str(jobs)],
            env, verbose, "native build failed")
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(cmake_dir / LIB_NAME, out / (LIB_NAME + ".tmp"))
        shutil.copy2(NATIVE / "meshengine.h", out / "meshengine.h")
        shutil.copy2(src / "src" / ARCH_SOURCE, out / ARCH_SOURCE)
        (out / (LIB_NAME + ".tmp")).rename(out / LIB_NAME)
    # an entry cached before the record existed gets it now: its key says it is of these sources
    if not (out / SOURCES_NAME).exists():
        (out / (SOURCES_NAME + ".tmp")).write_text(sources_record())
        (out / (SOURCES_NAME + ".tmp")).rename(out / SOURCES_NAME)
    relink(link, out)
    return link / LIB_NAME


def build_tools(jobs: int, verbose: bool) -> Path:
    """llama.cpp's TOOL_TARGETS of the pinned, patched tree; returns build/native-tools/bin."""
    lock = read_lock()
    out = cache_root() / "native-tools" / tools_key()
    link = BUILD / "native-tools"
    if not all((out / "bin" / t).exists() for t in TOOL_TARGETS):
        src = patched_source(lock)
        cmake_dir = BUILD / "cmake-tools"
        env, launcher, generator = build_env()
        configure = ["cmake", "-S", str(src), "-B", str(cmake_dir), *generator, *tools_cmake_options(), *launcher]
        run(configure, env, verbose, "cmake configure of llama.cpp's tools failed")
        run(["cmake", "--build", str(cmake_dir), "--target", *TOOL_TARGETS, "-j", str(jobs)],
            env, verbose, "build of llama.cpp's tools failed")
        tmp = out.with_name(out.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "bin").mkdir(parents=True)
        for t in TOOL_TARGETS:
            shutil.copy2(cmake_dir / "bin" / t, tmp / "bin" / t)
        (tmp / "llama_cpp_commit").write_text(lock["llama_cpp_commit"] + "\n")
        (tmp / "cmake_options").write_text(" ".join(tools_cmake_options()) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    relink(link, out)
    return link / "bin"


def key_of_sources(lock: dict[str, str]) -> str:
    h = hashlib.sha256(lock["sha256"].encode())
    for p in patches():
        h.update(p.read_bytes())
    return h.hexdigest()


def run(cmd: list[str], env: dict[str, str], verbose: bool, what: str) -> None:
    if verbose:
        proc = subprocess.run(cmd, env=env)
        output = ""
    else:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        log = BUILD / "native-build.log"
        log.write_text(output)
        errors = [ln for ln in output.splitlines() if "error" in ln.lower()]
        first = errors[0].strip() if errors else f"exit status {proc.returncode}"
        raise BuildError(f"{what}: {first} (full log: {log})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--print-key", action="store_true", help="print the build key and exit")
    parser.add_argument("--rebase", metavar="VERSION",
                        help="report which patches (and hunks) no longer apply to the llama.cpp that "
                             "llama-cpp-python VERSION vendors, and build nothing")
    parser.add_argument("--tools", action="store_true",
                        help="also build llama.cpp's llama-bench, ggml-rpc-server and llama-batched-bench "
                             "(for the tools/bench_*.py that compare against llama.cpp)")
    args = parser.parse_args()
    try:
        if args.print_key:
            print(build_key())
            return 0
        if args.rebase:
            return rebase_report(args.rebase)
        lib = build(args.jobs, args.verbose)
        tools = build_tools(args.jobs, args.verbose) if args.tools else None
    except BuildError as exc:
        print(f"build_native: {exc}", file=sys.stderr)
        return 1
    print(f"meshengine: {lib.resolve()}")
    if tools is not None:
        print(f"llama.cpp tools: {tools.resolve()} ({', '.join(TOOL_TARGETS)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
