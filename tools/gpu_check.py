#!/usr/bin/env python3
r"""Build libmeshengine with ggml's CUDA backend on a GPU machine and check split parity there.

A GPU machine lent for a few minutes has no network and none of the build's inputs, so
the work is in two halves:

    .venv/bin/python tools/gpu_check.py pack     # here: fills the ignored folder .gpu/
    python3 tools/gpu_check.py run --out DIR     # there (or here with --cpu): build, then parity

`pack` writes into .gpu/ (ignored: `/.gpu/` in .git/info/exclude) what the other machine
lacks: the patched llama.cpp tree of build/llama.cpp pruned to what the library's CMake
build reads (no other GPU backends, tools, tests or docs) as llama-src.tar.xz, the tiny
random-weight GGUFs of tests/gguf_*.py with the layer ranges their parity tests cut them
into (models/, models.json), and the wheels of cffi and pycparser for Python 3.12 (whl/).
`prebuilt LIB` adds a CUDA library built here by `run` (this machine has nvcc but no GPU)
as a fallback for a device whose own build does not finish in time.

`run` unpacks the tree, configures and builds only the `meshengine` target with ninja
(tools/build_native.py's options, CPU code for x86-64-v3, with CUDA on, sm_90 only, ggml's
FlashAttention kernels off: the engine never asks for them, NCCL off; cuBLAS from PyTorch's
nvidia/cu13 wheel where the toolkit has none), stops the build past --build-limit seconds,
installs the library with its header and sources.json in a folder of its own and points
MESHD_ENGINE_DIR at it. Then, for each tiny model in priority order (a dense llama and
MoE families first), in a worker process that is restarted past a crash:

  * the whole model with every layer offloaded (gpu layers -1) greedily decodes
    --steps tokens after each of three prompts (1, 10 and 43 random token ids), and the
    first seven models after a fourth of 250, whose answer crosses 256 KV cells;
  * each chain of layer ranges, every stage fully offloaded and chained as meshd
    chains them (f32 residual rows from one stage's context to the next), is fed
    the whole model's tokens: its own greedy picks must be the same tokens and its
    logits are compared with the whole model's at every step (max abs difference,
    how many steps were bit-identical);
  * batch invariance: the whole model, offloaded, takes each prompt and its answer as one
    batch, and every row's logits must be its decode step's bit for bit (a prefix cache, a
    speculative step and a failover's re-prefill take in a batch rows a decode took one by one):
    native/patches/0018's kernels (GGML_CUDA_BATCH_INVARIANT, which the engine sets unless
    MESHD_STOCK_KERNELS=1; compile-checked only until such a run) make every row count take one
    kernel, and each model's line and the verdict say which kernels ran;
  * failover: each chain, fresh, takes over each answer at half its steps as a failover's
    new route does (the prompt and the answer so far prefilled as one batch, then decoding
    on), and must give the undisturbed chain's tokens and logits;
  * the whole model with gpu layers 0 is compared with the offloaded one the same
    way (informative: kernels differ).

A worker that dies has its stderr's tail (Python's faulthandler trace) and a gdb backtrace
said; if the library built there crashes at once, the runs go on with the prebuilt one. It
prints a short summary and writes summary.txt, results.json and build.log under --out
(default $OUT). With --cpu the same runs on a CUDA-less build (here, to test the script);
--lib DIR skips the build and uses the library in DIR (e.g. build/native).

On the device tool: carry [".gpu"] and run

    set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site || exit; \
      PYTHONUNBUFFERED=1 python3 tools/gpu_check.py run --out $OUT 2>&1 | tee $OUT/gpu_check.log
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import build_native as bn

ROOT = Path(__file__).resolve().parent.parent
PACK = ROOT / ".gpu"
TARBALL = "llama-src.tar.xz"
MODELS = "models"
MANIFEST = "manifest.json"
PREBUILT = "prebuilt"
WHEELS = ["cffi", "pycparser"]

# What of the patched llama.cpp tree the library's CMake build reads (CMakeLists.txt at the
# checkout's root adds the tree with everything but llama and ggml off).
KEEP_TOP = ["CMakeLists.txt", "LICENSE", "cmake", "include", "src", "ggml", "vendor"]
# ggml backends the build adds: the CPU one, CUDA, and RPC (tools/build_native.py turns it on)
KEEP_BACKENDS = {"ggml-cpu", "ggml-cuda", "ggml-rpc"}
# vendor/CMakeLists.txt adds these whatever the options (cpp-httplib only with common)
DROP_VENDOR = {"cpp-httplib"}

CUDA_OPTIONS = [
    "-DCMAKE_CUDA_ARCHITECTURES=90",  # the H200 alone: one device code per kernel
    "-DGGML_CUDA_FA=OFF",  # meshengine disables flash attention (native/meshengine.cpp)
    "-DGGML_CUDA_NCCL=OFF",  # one GPU
    "-DGGML_CUDA_COMPRESSION_MODE=none",
]

# What the engine sets for ggml-cuda unless MESHD_STOCK_KERNELS=1 (native/meshengine.cpp, patch 0018)
INVARIANT_SWITCH = "GGML_CUDA_BATCH_INVARIANT"

# With the default 24 steps the batch check's batches are 25, 34 and 67 rows and the failover's
# re-prefills 13, 22 and 55: every remainder of patch 0018's groups of 4 columns (mmvq on sm_90) comes
# up, and six of its groups of 8 (mmvf), beside full groups (prompts of 1, 9 and 40 never made a launch of
# 2 or 3 columns).
PROMPT_LENGTHS = (1, 10, 43)
# the models every run must cover, first: a dense llama (f32 and f16) and MoE families
FIRST = ["llama-gqa-untied", "llama-gqa-tied", "qwen3moe", "mixtral", "deepseek2-mla", "gpt-oss", "qwen2moe-shexp"]
# These also answer a prompt of 250 tokens, whose answer crosses 256 cells: llama_kv_cache pads the
# attention's n_kv to a multiple of 256, so a batch of the whole answer attends over 512 cells where
# the decode steps before the crossing attend over 256, and a kernel that splits its sum by length
# (cuBLAS picks its split-k by shape) would sum a row of the batch unlike its decode step. A context of
# 512 cells lets n_kv be 256 at all (with 128, every step attended over the whole cache).
LONG_PROMPT = 250
N_CTX = 512
N_THREADS = 1

Chain = list[tuple[int, int]]


# ---------------------------------------------------------------------------------------- pack


def _keep(name: str) -> bool:
    """Whether a path of the llama.cpp tree (relative, '/'-separated) goes into the tarball."""
    parts = name.split("/")
    if parts[0] not in KEEP_TOP:
        return False
    if parts[0] == "ggml":
        if len(parts) > 1 and parts[1] not in ("CMakeLists.txt", "cmake", "include", "src"):
            return False
        if len(parts) > 2 and parts[1] == "src" and parts[2].startswith("ggml-") and "." not in parts[2]:
            return parts[2] in KEEP_BACKENDS
    if parts[0] == "vendor" and len(parts) > 1 and parts[1] in DROP_VENDOR:
        return False
    return True


def pack_source(dest: Path) -> str:
    lock = bn.read_lock()
    src = bn.BUILD / "llama.cpp"
    stamp = bn.BUILD / "llama.cpp.stamp"
    key = bn.key_of_sources(lock)
    if not src.is_dir() or not stamp.exists() or stamp.read_text() != key:
        raise SystemExit("gpu_check: build/llama.cpp is missing or not of this checkout's patches: "
                         "run tools/build_native.py first")

    def only(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        rel = info.name.partition("/")[2]
        return info if not rel or _keep(rel) else None

    tmp = dest.with_suffix(".tmp")
    with tarfile.open(tmp, "w:xz", preset=6) as tar:
        tar.add(src, arcname="llama.cpp", filter=only)
    tmp.rename(dest)
    return key


def tiny_models() -> Iterator[tuple[str, str, Any, list[Chain]]]:
    """(name, writer module, writer call, chains) of every tiny model the parity tests cut, FIRST first."""
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT))
    # the factories and the parity tests' chains (imported by name: tests/ is no package)
    m = {name: importlib.import_module(name) for name in (
        "gguf_dense", "gguf_dsa", "gguf_dsv4", "gguf_factory", "gguf_hybrid_b", "gguf_moe", "gguf_variants",
        "test_arch_dsa", "test_arch_dsv4", "test_arch_hybrid_a", "test_arch_moe", "test_arch_recurrent",
        "test_engine_arch_parity")}
    gguf_dense, gguf_dsa, gguf_dsv4, gguf_factory = m["gguf_dense"], m["gguf_dsa"], m["gguf_dsv4"], m["gguf_factory"]
    gguf_hybrid_b, gguf_moe, gguf_variants = m["gguf_hybrid_b"], m["gguf_moe"], m["gguf_variants"]
    test_arch_dsa, test_arch_dsv4, test_arch_hybrid_a = m["test_arch_dsa"], m["test_arch_dsv4"], m["test_arch_hybrid_a"]
    test_arch_moe, test_arch_recurrent = m["test_arch_moe"], m["test_arch_recurrent"]
    test_engine_arch_parity = m["test_engine_arch_parity"]

    found: list[tuple[str, str, Any, list[Chain]]] = []
    for name, tiny in gguf_factory.TINY_SPECS.items():
        found.append((name, "tiny", lambda p, s=tiny: gguf_factory.write_tiny_gguf(p, s),
                      list(test_engine_arch_parity.CHAINS.values())))
    for name, moe in gguf_moe.MOE_SPECS.items():
        found.append((name, "moe", lambda p, s=moe: gguf_moe.write_moe_gguf(p, s), test_arch_moe.CHAINS[name]))
    for name, dense in gguf_dense.DENSE_SPECS.items():
        found.append((name, "dense", lambda p, s=dense: gguf_dense.write_dense_gguf(p, s),
                      [[tuple(r) for r in dense.chain]]))
    for name, dsa in gguf_dsa.DSA_SPECS.items():
        found.append((name, "dsa", lambda p, s=dsa: gguf_dsa.write_dsa_gguf(p, s), test_arch_dsa.CHAINS[name]))
    found.append(("deepseek4", "dsv4", gguf_dsv4.write_dsv4_gguf, test_arch_dsv4.CHAINS))
    for name, writer in test_arch_hybrid_a.WRITERS.items():
        found.append((name, "hybrid-a", writer, test_arch_hybrid_a.CHAINS[name]))
    for name, hyb in gguf_hybrid_b.HYBRID_B_SPECS.items():
        found.append((name, "hybrid-b", lambda p, s=hyb: gguf_hybrid_b.write_hybrid_b_gguf(p, s),
                      [[tuple(r) for r in c] for c in hyb.chains]))
    for name, rec in test_arch_recurrent.WRITERS.items():
        found.append((name, "recurrent", lambda p, w=rec: w(p, test_arch_recurrent.N_LAYER),
                      list(test_arch_recurrent.CHAINS.values())))
    found.append(("qwen3next", "recurrent", lambda p: gguf_variants.write_qwen3next(p, n_layer=8),
                  list(test_arch_recurrent.HYBRID_CHAINS.values())))
    rank = {name: i for i, name in enumerate(FIRST)}
    found.sort(key=lambda f: rank.get(f[0], len(FIRST)))
    yield from found


def pack_models(dest: Path) -> list[dict[str, Any]]:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    entries = []
    for i, (name, family, write, chains) in enumerate(tiny_models()):
        path = dest / f"{name}.gguf"
        write(path)
        entries.append({"name": name, "family": family, "file": path.name, "seed": 1000 + i,
                        "chains": [[list(r) for r in c] for c in chains]})
    (dest / "models.json").write_text(json.dumps(entries, indent=1))
    return entries


def pack_wheels(dest: Path) -> list[str]:
    from importlib.metadata import version

    if dest.exists():
        shutil.rmtree(dest)
    pins = [f"{name}=={version(name)}" for name in WHEELS]
    platforms = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                 "manylinux2014_x86_64", "manylinux1_x86_64"]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", *(f"--platform={p}" for p in platforms),
           "-d", str(dest), *pins]
    subprocess.run(cmd, check=True)
    return sorted(p.name for p in dest.iterdir())


def pack(_: argparse.Namespace) -> int:
    PACK.mkdir(exist_ok=True)
    exclude = ROOT / ".git" / "info" / "exclude"
    if exclude.parent.is_dir() and "/.gpu/" not in (exclude.read_text().split() if exclude.exists() else []):
        with exclude.open("a") as f:
            f.write("/.gpu/\n")
    t0 = time.monotonic()
    key = pack_source(PACK / TARBALL)
    models = pack_models(PACK / MODELS)
    wheels = pack_wheels(PACK / "whl")
    manifest = {"sources_key": key, "llama_cpp_commit": bn.read_lock()["llama_cpp_commit"],
                "models": len(models), "wheels": wheels}
    (PACK / MANIFEST).write_text(json.dumps(manifest, indent=1))
    size = sum(p.stat().st_size for p in PACK.rglob("*") if p.is_file())
    print(f"gpu_check: packed {PACK} in {time.monotonic() - t0:.0f} s: {TARBALL} "
          f"{(PACK / TARBALL).stat().st_size / 2**20:.1f} MiB, {len(models)} models, wheels {', '.join(wheels)}; "
          f"{size / 2**20:.1f} MiB in all")
    return 0


def prebuilt(args: argparse.Namespace) -> int:
    """Adds a CUDA libmeshengine.so built here (`run` without --cpu, on a machine with nvcc) to .gpu/,
    for `run` to fall back on where the device's own build does not finish in time."""
    import lzma

    lib = Path(args.lib).resolve()
    cache = lib.parent / "CMakeCache.txt"
    options = [ln for ln in cache.read_text().splitlines()
               if ln.split(":", 1)[0] in ("GGML_CUDA", "CMAKE_CUDA_ARCHITECTURES", "GGML_CUDA_FA", "GGML_NATIVE",
                                          "GGML_CUDA_NO_VMM", "CMAKE_CUDA_COMPILER_VERSION", "CMAKE_BUILD_TYPE")
               ] if cache.exists() else []
    dest = PACK / PREBUILT
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with lib.open("rb") as f, lzma.open(dest / (bn.LIB_NAME + ".xz"), "wb", preset=6) as g:
        shutil.copyfileobj(f, g)
    info = {"sources": json.loads(bn.sources_record())["files"], "built_from": str(lib), "cmake": options,
            "nvcc": _device(False).rpartition("; ")[2]}
    (dest / "prebuilt.json").write_text(json.dumps(info, indent=1))
    print(f"gpu_check: {dest / (bn.LIB_NAME + '.xz')}: {(dest / (bn.LIB_NAME + '.xz')).stat().st_size / 2**20:.1f} MiB "
          f"(from {lib.stat().st_size / 2**20:.1f} MiB); {', '.join(options)}")
    return 0


# ---------------------------------------------------------------------------------------- run


class Report:
    """Lines of the summary, printed as they come and kept for summary.txt."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        try:
            print(f"gpu_check: {line}", flush=True)
        except OSError:  # a reader gone (tee killed): summary.txt still gets the line
            pass


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _device(cpu: bool) -> str:
    if cpu:
        return "none (--cpu)"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        out = f"nvidia-smi failed: {exc}"
    try:
        nvcc = subprocess.run([_nvcc() or "nvcc", "--version"], capture_output=True, text=True, timeout=30).stdout
        release = next((ln.split("release", 1)[1].strip() for ln in nvcc.splitlines() if "release" in ln), "?")
    except (OSError, subprocess.TimeoutExpired):
        release = "not found"
    return f"{out}; nvcc {release}"


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for cand in ("/usr/local/cuda/bin/nvcc", *sorted(map(str, Path("/usr/local").glob("cuda-*/bin/nvcc")))):
        if Path(cand).exists():
            return cand
    return None


def _toolkit_lib(names: Sequence[str], nvcc: str | None) -> Path | None:
    """The first of `names` in the CUDA toolkit's own library folders (where CMake looks first)."""
    roots = [Path(nvcc).resolve().parent.parent] if nvcc else []
    roots += [Path("/usr/local/cuda"), *sorted(Path("/usr/local").glob("cuda-*"))]
    for root in roots:
        for sub in ("lib64", "targets/x86_64-linux/lib", "lib", "lib64/stubs", "targets/x86_64-linux/lib/stubs"):
            for name in names:
                if (root / sub / name).exists():
                    return root / sub / name
    return None


def _site_dirs() -> list[Path]:
    import site

    dirs = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    return [Path(d) for d in dict.fromkeys(dirs) if d and Path(d).is_dir()]


def cuda_library_options(say: Report) -> list[str]:
    """CMake options for cuBLAS and the driver where the toolkit lacks them.

    An image whose toolkit came as pip wheels (nvcc, cudart) keeps cuBLAS in PyTorch's
    nvidia/cu13 (headers and libcublas.so.13, no unversioned name), where FindCUDAToolkit does
    not look: its CUDA::cublas is then named outright. Without any libcuda to link, ggml's
    virtual-memory pool (the one user of the driver API) is turned off.
    """
    nvcc = _nvcc()
    options: list[str] = []
    if _toolkit_lib(["libcublas.so"], nvcc) is None:
        found = None
        for d in _site_dirs():
            for lib in sorted(d.glob("nvidia/*/lib/libcublas.so*")):
                inc = lib.parent.parent / "include"
                lts = sorted(lib.parent.glob("libcublasLt.so*"))
                if (inc / "cublas_v2.h").exists() and lts:
                    found = (lib, lts[0], inc)
                    break
            if found:
                break
        if found is None:
            say("cuBLAS: not in the toolkit nor in any nvidia/*/lib of this Python; configure will say so")
        else:
            lib, lt, inc = found
            options += [f"-DCUDA_cublas_LIBRARY={lib}", f"-DCUDA_cublasLt_LIBRARY={lt}", f"-DCMAKE_CUDA_FLAGS=-I{inc}"]
            say(f"cuBLAS: {lib} (headers {inc}), the toolkit has none")
    if _toolkit_lib(["libcuda.so"], nvcc) is None:
        driver = None
        for where in ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64"):
            hits = sorted(Path(where).glob("libcuda.so*"))
            if hits:
                driver = hits[0]
                break
        if driver is not None:
            options.append(f"-DCUDA_cuda_driver_LIBRARY={driver}")
            say(f"CUDA driver library: {driver}")
        else:
            options.append("-DGGML_CUDA_NO_VMM=ON")
            say("CUDA driver library: none to link; GGML_CUDA_NO_VMM=ON (ggml's legacy memory pool)")
    return options


def install_prebuilt(work: Path, src: Path | None, lib_dir: Path) -> str:
    """Installs .gpu/prebuilt's library in lib_dir; says what it is."""
    import lzma

    info = json.loads((PACK / PREBUILT / "prebuilt.json").read_text())
    with lzma.open(PACK / PREBUILT / (bn.LIB_NAME + ".xz")) as f, (work / bn.LIB_NAME).open("wb") as g:
        shutil.copyfileobj(f, g)
    install(work / bn.LIB_NAME, src, lib_dir)
    stale = "" if info["sources"] == json.loads(bn.sources_record())["files"] else " OF OTHER SOURCES"
    return f"the library prebuilt elsewhere{stale} ({info['nvcc']}; {', '.join(info['cmake'])})"


def runtime_library_dirs() -> list[str]:
    """Folders holding the CUDA runtime and cuBLAS the library links to (PyTorch's nvidia/*/lib where
    the toolkit has none), for LD_LIBRARY_PATH: a library built elsewhere has other RUNPATHs."""
    dirs: list[str] = []
    nvcc = _nvcc()
    for names in (["libcudart.so.13", "libcudart.so"], ["libcublas.so.13", "libcublas.so"]):
        hit = _toolkit_lib(names, nvcc)
        if hit is None:
            for d in _site_dirs():
                found = sorted(d.glob(f"nvidia/*/lib/{names[0]}*"))
                if found:
                    hit = found[0]
                    break
        if hit is not None and str(hit.parent) not in dirs:
            dirs.append(str(hit.parent))
    return dirs


def _ldd_missing(lib: Path) -> list[str]:
    try:
        out = subprocess.run(["ldd", str(lib)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln.strip() for ln in out.splitlines() if "not found" in ln]


def unpack_source(work: Path) -> Path:
    manifest = json.loads((PACK / MANIFEST).read_text())
    want = bn.key_of_sources(bn.read_lock())
    if manifest["sources_key"] != want:
        raise SystemExit(f"gpu_check: {PACK / TARBALL} is of other patches than this checkout's "
                         "(run `tools/gpu_check.py pack` again)")
    src = work / "llama.cpp"
    if src.exists():
        shutil.rmtree(src)
    with tarfile.open(PACK / TARBALL) as tar:
        tar.extractall(work, filter="data")
    return src


def build(src: Path, work: Path, cpu: bool, jobs: int, limit: float, log: Path, say: Report) -> Path | None:
    """Configures and builds the meshengine target; the library's path, or None (said why)."""
    os.environ["MESHD_CUDA"] = "0" if cpu else "1"
    options = bn.cmake_options()
    env = dict(os.environ)
    nvcc = None if cpu else _nvcc()
    if not cpu:
        options += CUDA_OPTIONS + cuda_library_options(say)
    if nvcc:
        env["CUDACXX"] = nvcc
    cmake_dir = work / "cmake"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["cmake", "-S", str(ROOT), "-B", str(cmake_dir), *generator, f"-DLLAMA_SOURCE_DIR={src}", *options]
    say(f"cmake options: {' '.join(options)}")
    t0 = time.monotonic()
    with log.open("w") as f:
        for what, cmd in (("configure", configure),
                          ("build", ["cmake", "--build", str(cmake_dir), "--target", "meshengine", "-j", str(jobs)])):
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=max(1.0, limit - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                say(f"BUILD STOPPED: {what} still running after {time.monotonic() - t0:.0f} s (limit {limit:.0f} s)")
                _progress(log, say)
                return None
            if rc != 0:
                say(f"BUILD FAILED: {what} exited {rc} after {time.monotonic() - t0:.0f} s; log tail:")
                for line in _tail(log).splitlines():
                    say(f"  | {line}")
                return None
            say(f"{what} done at {time.monotonic() - t0:.0f} s")
    lib = cmake_dir / bn.LIB_NAME
    say(f"built {bn.LIB_NAME} in {time.monotonic() - t0:.0f} s ({lib.stat().st_size / 2**20:.1f} MiB, "
        f"{'CPU only' if cpu else 'CUDA sm_90'}, -j{jobs})")
    return lib


def _progress(log: Path, say: Report) -> None:
    """The last ninja progress line ([n/m]) of a stopped build."""
    steps = [ln for ln in _tail(log, 400).splitlines() if ln.startswith("[")]
    if steps:
        say(f"  last step: {steps[-1][:160]}")


def install(lib: Path, src: Path | None, dest: Path) -> None:
    """The library, its header and sources.json, as tools/build_native.py lays out build/native."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    shutil.copy2(lib, dest / bn.LIB_NAME)
    shutil.copy2(bn.NATIVE / "meshengine.h", dest / "meshengine.h")
    if src is not None:
        shutil.copy2(src / "src" / bn.ARCH_SOURCE, dest / bn.ARCH_SOURCE)
    (dest / bn.SOURCES_NAME).write_text(bn.sources_record())


def parity(engine_dir: Path, steps: int, limit: float, only: list[str] | None, say: Report,
           expect_gpu: bool = True) -> list[dict[str, Any]]:
    """Runs the worker over every model, past crashes; its results in model order.

    The first worker logs at llama.cpp's info level (the CUDA devices ggml found, where the
    weights went); a worker that dies has its stderr's tail said. Two workers in a row that die
    before any result end the runs with this library: it crashes whatever the model."""
    entries = json.loads((PACK / MODELS / "models.json").read_text())
    names = [e["name"] for e in entries if only is None or e["name"] in only]
    env = {**os.environ, "MESHD_ENGINE_DIR": str(engine_dir), "PYTHONFAULTHANDLER": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    results: list[dict[str, Any]] = []
    t0 = time.monotonic()
    starts = 0
    dead_at_start = 0
    debugged = False
    while len(results) < len(names):
        left = names[len(results):]
        cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--steps", str(steps), *left]
        err_path = engine_dir.parent / f"worker-{starts}.err"
        level = "info" if starts == 0 else os.environ.get("MESHD_LLAMA_LOG", "warn")
        starts += 1
        had = len(results)
        with err_path.open("w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                    env={**env, "MESHD_LLAMA_LOG": level}, start_new_session=True)
        assert proc.stdout is not None
        timed_out = False
        while True:
            remaining = limit - (time.monotonic() - t0)
            if remaining <= 0:
                timed_out = True
                break
            line = _readline(proc, remaining)
            if line is None:
                timed_out = True
                break
            if not line:
                break
            if line.startswith("{"):
                result = json.loads(line)
                results.append(result)
                say(_result_line(result, expect_gpu))
                for row in _detail_lines(result):
                    print(row, flush=True)
        if timed_out:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            say(f"PARITY STOPPED after {time.monotonic() - t0:.0f} s (limit {limit:.0f} s); "
                f"not run: {', '.join(names[len(results):])}")
            break
        rc = proc.wait()
        if starts == 1:
            for row in _interesting(err_path):
                say(f"  llama.cpp: {row}")
        if len(results) < len(names):
            crashed = names[len(results)]
            result = {"name": crashed, "error": f"worker died (exit {rc}) on this model"}
            results.append(result)
            say(_result_line(result, expect_gpu))
            for row in _tail(err_path, 30).splitlines():
                say(f"  | {row[:300]}")
            dead_at_start = dead_at_start + 1 if len(results) == had + 1 else 0
            if dead_at_start == 1 and not debugged:
                debugged = True
                for row in _backtrace(cmd[:5] + [crashed], {**env, "MESHD_LLAMA_LOG": "warn"}):
                    say(f"  gdb| {row[:300]}")
            if dead_at_start >= 2:
                say(f"two workers in a row died before any result: no more runs with {engine_dir / bn.LIB_NAME}")
                break
    return results


def _backtrace(cmd: list[str], env: dict[str, str]) -> list[str]:
    """The native backtrace of a worker that crashes, from cuda-gdb (or gdb) in batch mode."""
    gdb = shutil.which("cuda-gdb") or shutil.which("gdb")
    if gdb is None:
        return ["no cuda-gdb or gdb here"]
    try:
        proc = subprocess.run([gdb, "-q", "-batch", "-ex", "set pagination off", "-ex", "run", "-ex", "bt 25",
                               "--args", *cmd], capture_output=True, text=True, timeout=90, env=env)
    except subprocess.TimeoutExpired:
        return [f"{gdb} took more than 90 s"]
    except OSError as exc:
        return [f"{gdb}: {exc}"]
    rows = (proc.stdout + proc.stderr).splitlines()
    at = next((i for i, ln in enumerate(rows) if "received signal" in ln or "SIGSEGV" in ln), max(0, len(rows) - 30))
    return rows[at:at + 32]


def _interesting(err: Path) -> list[str]:
    """What llama.cpp's info log says of the devices and the offload (the first worker's, first model's)."""
    keys = ("ggml_cuda_init", "Device 0", "CUDA", "offload", "VMM", "error", "failed")
    try:
        lines = err.read_text(errors="replace").splitlines()
    except OSError:
        return []
    rows = [ln.strip() for ln in lines if any(k in ln for k in keys)]
    return list(dict.fromkeys(rows))[:12]


def compiler_libstdcxx(cmake_dir: Path, lib: Path, say: Report) -> str | None:
    """The folder of the libstdc++ the build's C++ compiler ships, where the library would load another.

    On the H200 image the build's g++ is /opt/gcc's GCC 13.3 and the library it built crashed in
    its first std::regex (the BPE vocabulary's), while the same sources built with Debian's GCC 12.2
    ran there: a library of newer headers than the libstdc++ it loads is the suspect."""
    try:
        cache = (cmake_dir / "CMakeCache.txt").read_text()
        cxx = next(ln.split("=", 1)[1] for ln in cache.splitlines() if ln.startswith("CMAKE_CXX_COMPILER:"))
        own = subprocess.run([cxx, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True,
                             timeout=30).stdout.strip()
        ldd = subprocess.run(["ldd", str(lib)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, StopIteration, subprocess.TimeoutExpired):
        return None
    loads = next((ln.split("=>", 1)[1].split("(")[0].strip() for ln in ldd.splitlines() if "libstdc++" in ln), "?")
    if not os.path.isabs(own) or not Path(own).exists() or Path(own).resolve() == Path(loads).resolve():
        say(f"libstdc++: {loads} (the compiler {cxx} ships {own})")
        return None
    say(f"libstdc++: the library would load {loads}, its compiler {cxx} ships {own}: "
        f"{Path(own).parent} goes first in LD_LIBRARY_PATH")
    return str(Path(own).parent)


def _readline(proc: subprocess.Popen[str], timeout: float) -> str | None:
    """One line of the worker's stdout, '' at its end, None past the timeout."""
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return None
    return proc.stdout.readline()


def _fmt(x: float | None) -> str:
    return "-" if x is None else ("0" if x == 0 else f"{x:.3g}")


def _result_line(r: dict[str, Any], expect_gpu: bool = True) -> str:
    """One summary line of a model: the chains together, then the CPU against the GPU."""
    if "error" in r:
        return f"{r['name']:<19} ERROR {r['error']}"
    chains = r["chains"]
    failed = [c for c in chains if "error" in c]
    done = [c for c in chains if "error" not in c]
    tokens = "identical" if done and all(c["tokens_identical"] for c in done) else "DIFFER"
    diff = max((c["max_abs_diff"] for c in done), default=None)
    same = sum(c["bit_identical"] for c in done)
    compared = sum(c["compared"] for c in done)
    line = (f"{r['name']:<19} {r['arch']:<14} {len(chains)} split(s): tokens {tokens}, max|dlogit| {_fmt(diff)}, "
            f"bit-identical {same}/{compared} steps")
    if failed:
        line += f", {len(failed)} split(s) FAILED ({failed[0]['error']})"
    b = r.get("batch")
    if b:
        line += (f" | batch rows vs decode steps ({r.get('kernels', '?')} kernels): "
                 f"bit-identical {b['bit_identical']}/{b['compared']}")
    over = [c["failover"] for c in done if c.get("failover")]
    if over:
        line += (f" | failover: tokens {'identical' if all(f['tokens_identical'] for f in over) else 'DIFFER'}, "
                 f"bit-identical {sum(f['bit_identical'] for f in over)}/{sum(f['compared'] for f in over)} steps")
    cg = r.get("cpu_vs_gpu", {})
    if "error" in cg:
        line += f" | cpu-vs-gpu ERROR {cg['error']}"
    elif cg:
        line += (f" | cpu-vs-gpu: tokens {'identical' if cg['tokens_identical'] else 'differ'}, "
                 f"max|dlogit| {_fmt(cg['max_abs_diff'])}")
    if expect_gpu and not r["n_bytes_gpu"]:
        line += " | NOTHING ON THE GPU"
    return line


def _detail_lines(r: dict[str, Any]) -> list[str]:
    """Each chain of a model, for the log."""
    rows = [f"    offload of the whole model: {r['offload']}; {r['seconds']:.1f} s; "
            f"distinct greedy tokens {r['distinct_tokens']}"] if "offload" in r else []
    for c in r.get("chains", []):
        if "error" in c:
            rows.append(f"    split {c['ranges']}: ERROR {c['error']}")
            continue
        rows.append(f"    split {c['ranges']:<22} vs whole: tokens {'identical' if c['tokens_identical'] else 'DIFFER'}"
                    f" ({c['decode_steps']} decode steps x {c['prompts']} prompts), max|dlogit| {_fmt(c['max_abs_diff'])},"
                    f" bit-identical {c['bit_identical']}/{c['compared']} steps"
                    + (f", first token divergence {c['first_divergence']}" if c["first_divergence"] else "")
                    + (f", {c['nonfinite_rows']} non-finite rows" if c["nonfinite_rows"] else ""))
        f = c.get("failover")
        if f:
            rows.append(f"    split {c['ranges']:<22} taken over at step {f['at']} (a fresh chain prefills the answer so far):"
                        f" tokens {'identical' if f['tokens_identical'] else 'DIFFER'}, max|dlogit| {_fmt(f['max_abs_diff'])},"
                        f" bit-identical {f['bit_identical']}/{f['compared']} steps")
    b = r.get("batch")
    if b:
        rows.append(f"    whole, the prompt and answer as one batch vs decode steps: max|dlogit| {_fmt(b['max_abs_diff'])},"
                    f" bit-identical {b['bit_identical']}/{b['compared']} rows")
    cg = r.get("cpu_vs_gpu", {})
    if cg and "error" not in cg:
        rows.append(f"    whole, gpu layers 0 vs -1: tokens {'identical' if cg['tokens_identical'] else 'differ'},"
                    f" max|dlogit| {_fmt(cg['max_abs_diff'])}, bit-identical {cg['bit_identical']}/{cg['compared']} steps"
                    + (f", first token divergence {cg['first_divergence']}" if cg["first_divergence"] else ""))
    return rows


def run(args: argparse.Namespace) -> int:
    out = Path(args.out or os.environ.get("OUT") or PACK / "out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    say = Report()
    t0 = time.monotonic()
    say(f"device: {_device(args.cpu)}; {os.cpu_count()} cores; python {sys.version.split()[0]}")
    lib_dir = work / "native"
    src: Path | None = None
    built = False
    library = ""  # which library the parity runs use
    if args.lib:
        install(Path(args.lib) / bn.LIB_NAME, None, lib_dir)
        library = f"the library in {args.lib} (no build)"
    else:
        src = unpack_source(work)
        say(f"unpacked llama.cpp {json.loads((PACK / MANIFEST).read_text())['llama_cpp_commit'][:7]} "
            f"at {time.monotonic() - t0:.0f} s")
        limit = min(args.build_limit, args.deadline - (time.monotonic() - t0) - 30)
        lib = build(src, work, args.cpu, args.jobs, limit, out / "build.log", say)
        if lib is not None:
            built = True
            install(lib, src, lib_dir)
            library = "the library just built on this machine"
            own = compiler_libstdcxx(work / "cmake", lib, say)
            if own:
                os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([own, *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])
        elif not args.cpu and (PACK / PREBUILT / "prebuilt.json").exists():
            library = "FALLBACK: " + install_prebuilt(work, src, lib_dir) + ", since this machine's build did not finish"
    if not args.cpu and library:
        dirs = runtime_library_dirs()
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([*dirs, *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])
        missing = _ldd_missing(lib_dir / bn.LIB_NAME)
        say(f"runtime libraries from {', '.join(dirs) or 'the system'}"
            + (f"; ldd MISSING: {'; '.join(missing)}" if missing else "; ldd finds every dependency"))
    results: list[dict[str, Any]] = []
    if library:
        say(f"library: {library}")
        limit = min(args.parity_limit, args.deadline - (time.monotonic() - t0) - 5)
        say(f"parity: whole model vs chains of ranges, every layer offloaded (gpu layers -1), "
            f"prompts of {'/'.join(map(str, PROMPT_LENGTHS))} tokens ({LONG_PROMPT} too for the first "
            f"{len(FIRST)} models) then {args.steps} greedy steps each; "
            f"{limit:.0f} s at most")
        results = parity(lib_dir, args.steps, limit, args.models or None, say, not args.cpu)
        crashed = bool(results) and all("error" in r for r in results)
        if crashed and built and not args.cpu and (PACK / PREBUILT / "prebuilt.json").exists():
            lib_dir = work / "native-prebuilt"
            library = "FALLBACK: " + install_prebuilt(work, src, lib_dir) + ", since this machine's build crashed"
            say(f"library: {library}")
            limit = min(args.parity_limit, args.deadline - (time.monotonic() - t0) - 5)
            results = parity(lib_dir, args.steps, limit, args.models or None, say, not args.cpu)
    chains = [c for r in results for c in r.get("chains", [])]
    ok = bool(results) and all("error" not in r for r in results) and all(
        "error" not in c and c["tokens_identical"] for c in chains)
    exact = ok and all(c["max_abs_diff"] == 0 for c in chains)
    loaded = [r for r in results if "error" not in r]
    batched = [r["batch"] for r in loaded if r.get("batch")]
    over = [c["failover"] for c in chains if c.get("failover")]
    invariant = bool(batched) and all(b["bit_identical"] == b["compared"] for b in batched)
    resumed = bool(over) and all(f["tokens_identical"] for f in over)
    resumed_exact = resumed and all(f["bit_identical"] == f["compared"] for f in over)
    failover_words = ("tokens NOT all identical" if not resumed else
                      "tokens identical, logits " + ("bit for bit" if resumed_exact else "NOT all bit for bit"))
    on_gpu = args.cpu or bool(loaded) and all(r.get("n_bytes_gpu") for r in loaded)
    modes = sorted({str(r.get("kernels")) for r in loaded})
    say(f"verdict: {'build ok' if built or args.lib else 'BUILD NOT DONE'}; "
        f"{'FALLBACK library; ' if library.startswith('FALLBACK') else ''}{len(results)} models, {len(chains)} splits; "
        f"split tokens {'all identical' if ok else 'NOT all identical (or errors)'}; "
        f"split logits {'bit-identical everywhere' if exact else 'NOT bit-identical everywhere'}; "
        f"batch rows {'= decode steps bit for bit in every model' if invariant else 'NOT all = decode steps'} "
        f"({' and '.join(modes) or 'no'} kernels); "
        f"failover {failover_words}; "
        f"{'CPU build' if args.cpu else 'every model had weights on the GPU' if on_gpu else 'SOME MODEL NOT ON THE GPU'}; "
        f"{time.monotonic() - t0:.0f} s in all")
    (out / "summary.txt").write_text("\n".join(say.lines) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0 if ok and invariant and resumed and on_gpu and (built or args.lib) else 1


# ---------------------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> int:
    """Parity of the named models, one JSON line each on stdout (run by `run`, MESHD_ENGINE_DIR set)."""
    import numpy as np

    from meshd.engine import Context, EngineError, Model
    from meshd.engine import native as nat

    engine_dir = Path(os.environ["MESHD_ENGINE_DIR"])

    def kernel_mode() -> str:
        """Which kernels ggml-cuda was told to take, read from this process's environment as the engine
        left it once loaded (a variable the engine sets is not in os.environ)."""
        libc = ctypes.CDLL(None)
        libc.getenv.restype = ctypes.c_char_p
        return "batch-invariant" if libc.getenv(INVARIANT_SWITCH.encode()) else "stock"

    got = nat._library_dir()
    if got.resolve() != engine_dir.resolve():
        raise SystemExit(f"gpu_check: the engine would load {got}, not {engine_dir}")
    entries = {e["name"]: e for e in json.loads((PACK / MODELS / "models.json").read_text())}
    gpu = -1

    class Stages:
        """Models and contexts of a chain (None: the whole model), each with n_gpu_layers."""

        def __init__(self, path: Path, ranges: Sequence[Sequence[int]] | None, n_gpu: int) -> None:
            specs = [(r[0], r[1]) for r in ranges] if ranges else [None]
            self.models: list[Model] = []
            self.contexts: list[Context] = []
            try:
                for spec in specs:
                    self.models.append(Model(path, spec, n_gpu_layers=n_gpu))
                    self.contexts.append(Context(self.models[-1], n_ctx=N_CTX, n_threads=N_THREADS))
            except BaseException:
                self.close()
                raise

        def close(self) -> None:
            for c in self.contexts:
                c.close()
            for m in self.models:
                m.close()

        def forward(self, tokens: Sequence[int], start: int, every_row: bool = False) -> np.ndarray:
            """The last row's logits, or with `every_row` every row's (one batch through each stage)."""
            n = len(tokens)
            pos = np.arange(start, start + n, dtype=np.int32)
            seq = np.zeros(n, dtype=np.int32)
            want = np.ones(n, dtype=bool) if every_row else None
            hidden: np.ndarray | None = None
            for i, ctx in enumerate(self.contexts):
                last_stage = i == len(self.contexts) - 1
                if i == 0:
                    hidden = ctx.forward(seq, pos, tokens=tokens, want_output=want if last_stage else None)
                else:
                    ids = tokens if ctx.model.report.needs_tokens else None
                    hidden = ctx.forward(seq, pos, tokens=ids, hidden=hidden, want_output=want if last_stage else None)
            assert hidden is not None
            out: np.ndarray = hidden.copy() if every_row else hidden[-1].copy()
            return out

        def greedy(self, prompt: list[int], forced: list[int] | None) -> tuple[list[int], list[np.ndarray]]:
            """Own greedy picks and the logits after prefill and each step; fed `forced` when given."""
            for c in self.contexts:
                c.clear()
            logits = self.forward(prompt, 0)
            picks, seen = [], [logits]
            for step in range(args.steps):
                pick = int(np.argmax(logits))
                picks.append(pick)
                logits = self.forward([forced[step] if forced is not None else pick], len(prompt) + step)
                seen.append(logits)
            return picks, seen

        def batched(self, prompt: list[int], forced: list[int]) -> list[np.ndarray]:
            """The logits `greedy` sees fed `forced`, from one batch of the prompt and the whole answer:
            batch rows must equal decode steps (a prefix cache, a speculative step and a failover's
            re-prefill all take rows in a batch that a decode took one by one)."""
            for c in self.contexts:
                c.clear()
            rows = self.forward(prompt + forced, 0, every_row=True)
            return [rows[i] for i in range(len(prompt) - 1, len(prompt) + len(forced))]

        def resumed(self, prompt: list[int], forced: list[int], at: int) -> list[np.ndarray]:
            """The logits from step `at` on of an answer taken over there, as a failover's new route
            takes it: fresh contexts prefill the prompt and the answer so far as one batch, then decode
            the rest one step at a time."""
            for c in self.contexts:
                c.clear()
            seen = [self.forward(prompt + forced[:at], 0)]
            for step in range(at, len(forced)):
                seen.append(self.forward([forced[step]], len(prompt) + step))
            return seen

    Also = Callable[[Stages, list[list[int]], list[list[int]], list[list[np.ndarray]]], None]

    def runs(path: Path, ranges: Sequence[Sequence[int]] | None, n_gpu: int, prompts: list[list[int]],
             forced: list[list[int]] | None,
             also: Also | None = None,
             ) -> tuple[list[list[int]], list[list[np.ndarray]], Any]:
        """Greedy runs of every prompt on one chain (fed `forced` where given); `also` runs more on the
        same contexts, given the picks and logits."""
        stages = Stages(path, ranges, n_gpu)
        try:
            got = [stages.greedy(p, None if forced is None else forced[i]) for i, p in enumerate(prompts)]
            picks, logits = [g[0] for g in got], [g[1] for g in got]
            if also is not None:
                also(stages, prompts, picks, logits)
            return picks, logits, stages.models[0].report
        finally:
            stages.close()

    def same_rows(ref: Sequence[Sequence[np.ndarray]], got: Sequence[Sequence[np.ndarray]]) -> dict[str, Any]:
        """How far two runs' logits lie apart, row by row: the greatest difference and how many are
        bit-identical, and whether every row's likeliest token is the same."""
        diff, same, compared, picks = 0.0, 0, 0, True
        for la, lb in zip(ref, got, strict=True):
            for a, b in zip(la, lb, strict=True):
                d = float(np.max(np.abs(a - b)))
                diff = d if np.isnan(d) else max(diff, d)
                same += int(np.array_equal(a, b))
                picks &= int(np.argmax(a)) == int(np.argmax(b))
                compared += 1
        return {"max_abs_diff": diff, "bit_identical": same, "compared": compared, "tokens_identical": picks}

    def batch_check(out: dict[str, Any]) -> Also:
        """Batch rows against the decode steps of the greedy run just made (its own picks fed)."""
        def check(stages: Stages, prompts: list[list[int]], picks: list[list[int]],
                  logits: list[list[np.ndarray]]) -> None:
            out.update(same_rows(logits, [stages.batched(p, picks[i]) for i, p in enumerate(prompts)]))
        return check

    def failover_check(out: dict[str, Any], forced: list[list[int]]) -> Also:
        """A take-over at half the answer against the chain's undisturbed run (fed `forced`)."""
        at = args.steps // 2

        def check(stages: Stages, prompts: list[list[int]], _: list[list[int]],
                  logits: list[list[np.ndarray]]) -> None:
            out.update(same_rows([seen[at:] for seen in logits],
                                 [stages.resumed(p, forced[i], at) for i, p in enumerate(prompts)]), at=at)
        return check

    def compare(ref: tuple[list[list[int]], list[list[np.ndarray]]],
                got: tuple[list[list[int]], list[list[np.ndarray]]]) -> dict[str, Any]:
        diff, same, compared, first = 0.0, 0, 0, None
        nonfinite = 0
        for p, (la, lb) in enumerate(zip(ref[1], got[1], strict=True)):
            for a, b in zip(la, lb, strict=True):
                nonfinite += int(not np.isfinite(a).all()) + int(not np.isfinite(b).all())
                d = float(np.max(np.abs(a - b)))
                diff = d if np.isnan(d) else max(diff, d)
                same += int(np.array_equal(a, b))
                compared += 1
            for step, (ta, tb) in enumerate(zip(ref[0][p], got[0][p], strict=True)):
                if ta != tb and first is None:
                    first = f"prompt {p} step {step}"
        return {"tokens_identical": ref[0] == got[0], "max_abs_diff": diff, "bit_identical": same,
                "compared": compared, "first_divergence": first, "nonfinite_rows": nonfinite,
                "decode_steps": args.steps, "prompts": len(ref[0])}

    for name in args.names:
        e = entries[name]
        t0 = time.monotonic()
        path = PACK / MODELS / e["file"]
        result: dict[str, Any] = {"name": name, "family": e["family"]}
        try:
            with Model(path, None) as probe:
                n_vocab = probe.report.n_vocab
            result["kernels"] = kernel_mode()
            rng = np.random.default_rng(e["seed"])
            lengths = (*PROMPT_LENGTHS, LONG_PROMPT) if name in FIRST else PROMPT_LENGTHS
            prompts = [rng.integers(0, n_vocab, size=n).tolist() for n in lengths]
            batch: dict[str, Any] = {}
            whole_tokens, whole_logits, report = runs(path, None, gpu, prompts, None, batch_check(batch))
            whole = (whole_tokens, whole_logits)
            result["batch"] = batch
            result["arch"] = report.arch
            result["offload"] = (f"layers {list(report.gpu_layers)} of {report.n_layer}, head {report.gpu_output}, "
                                 f"{report.n_bytes_gpu}/{report.n_bytes} bytes on GPU")
            result["n_bytes_gpu"] = report.n_bytes_gpu
            result["distinct_tokens"] = max(len(set(t)) for t in whole_tokens)
            result["chains"] = []
            for ranges in e["chains"]:
                label = ",".join(f"{a}:{b}" for a, b in ranges)
                try:
                    failover: dict[str, Any] = {}
                    tokens, logits, _ = runs(path, ranges, gpu, prompts, whole_tokens,
                                             failover_check(failover, whole_tokens))
                    result["chains"].append({"ranges": label, **compare(whole, (tokens, logits)),
                                             "failover": failover})
                except EngineError as exc:
                    result["chains"].append({"ranges": label, "error": f"{type(exc).__name__}: {exc}"})
            try:
                tokens, logits, _ = runs(path, None, 0, prompts, whole_tokens)
                result["cpu_vs_gpu"] = compare(whole, (tokens, logits))
            except EngineError as exc:
                result["cpu_vs_gpu"] = {"error": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # the engine's own errors, and a library that does not load
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["seconds"] = time.monotonic() - t0
        print(json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("pack", help="fill .gpu/ (here)").set_defaults(func=pack)
    pb = sub.add_parser("prebuilt", help="add a CUDA library built here to .gpu/ as the fallback of `run`")
    pb.add_argument("lib", help="the libmeshengine.so (its CMakeCache.txt beside it says how it was built)")
    pb.set_defaults(func=prebuilt)
    r = sub.add_parser("run", help="build, then check parity (on the GPU machine; --cpu here)")
    r.add_argument("--cpu", action="store_true", help="build without CUDA (to test this script)")
    r.add_argument("--lib", help="use the libmeshengine.so in this folder instead of building")
    r.add_argument("--out", help="where summary.txt, results.json and build.log go (default $OUT, else .gpu/out)")
    r.add_argument("--work", default="/tmp/meshd-gpu", help="build folder (default /tmp/meshd-gpu)")
    r.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    r.add_argument("--build-limit", type=float, default=420.0, help="seconds before the build is stopped")
    r.add_argument("--parity-limit", type=float, default=240.0, help="seconds for all parity runs")
    r.add_argument("--deadline", type=float, default=540.0, help="seconds for the whole run (build and parity)")
    r.add_argument("--steps", type=int, default=24, help="greedy decode steps after each prompt")
    r.add_argument("--models", nargs="*", help="only these models (default: all in .gpu/models)")
    r.set_defaults(func=run)
    w = sub.add_parser("worker", help=argparse.SUPPRESS)
    w.add_argument("--steps", type=int, default=24)
    w.add_argument("names", nargs="+")
    w.set_defaults(func=worker)
    args = parser.parse_args(argv)
    if getattr(args, "steps", 0) >= N_CTX - LONG_PROMPT:
        parser.error(f"--steps: at most {N_CTX - LONG_PROMPT - 1} (the {LONG_PROMPT}-token prompt and its answer "
                     f"fill a context of {N_CTX})")
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
