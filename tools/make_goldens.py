#!/usr/bin/env python3
"""Golden answers from STOCK llama.cpp, for tests/test_engine_golden.py.

Every other parity check compares meshd's patched engine with itself. This tool
unpacks the pinned llama.cpp (native/llama.lock) WITHOUT our patches, builds
tools/golden_stock.c against it with the same ggml options as libmeshengine,
and records:

* tests/golden/smollm2_greedy.json: greedy token ids of the default model for
  a few short prompts (chat template applied by stock llama.cpp);
* tests/golden/tiny_<spec>.json and .npy: for one tiny random-weight model of
  tools/gguf_factory.py, the prompt, greedy ids and every logits row (float32).

Run it again only when the pin changes:  .venv/bin/python tools/make_goldens.py
The build goes to --work (default /tmp/meshd-stock). Its tree mirrors the
library's (WORK/build/llama.cpp, WORK/build/cmake) and ccache's base dir is
WORK, so every file our patches leave alone is a cache hit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "tests")]

import build_native  # noqa: E402
from gguf_factory import TINY_SPECS, byte_level_vocab, write_tiny_gguf  # noqa: E402

# What the goldens were made with; tests/test_engine_golden.py runs meshd the same way.
N_CTX = 512
N_BATCH = 512
N_THREADS = 1
DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 10.",
]
DEFAULT_NEW = 24
TINY_SPEC = "llama-gqa-untied"
TINY_PROMPT = "the cat in a hat"
TINY_NEW = 16

WRAPPER = """\
cmake_minimum_required(VERSION 3.21)
project(golden_stock C CXX)
# the options of meshd's CMakeLists.txt, so ggml compiles to the same code
set(CMAKE_CXX_STANDARD 17)
set(CMAKE_POSITION_INDEPENDENT_CODE ON)
set(BUILD_SHARED_LIBS OFF CACHE BOOL "" FORCE)
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "" FORCE)
set(LLAMA_BUILD_TESTS OFF CACHE BOOL "" FORCE)
set(LLAMA_BUILD_TOOLS OFF CACHE BOOL "" FORCE)
set(LLAMA_BUILD_EXAMPLES OFF CACHE BOOL "" FORCE)
set(LLAMA_BUILD_SERVER OFF CACHE BOOL "" FORCE)
set(LLAMA_BUILD_APP OFF CACHE BOOL "" FORCE)
set(LLAMA_OPENSSL OFF CACHE BOOL "" FORCE)
set(GGML_OPENMP OFF CACHE BOOL "" FORCE)
add_subdirectory(${CMAKE_SOURCE_DIR}/build/llama.cpp llama EXCLUDE_FROM_ALL)
add_executable(golden_stock golden_stock.c)
target_link_libraries(golden_stock PRIVATE llama ggml)
"""


def stock_tree(work: Path) -> Path:
    """The pinned llama.cpp as the sdist vendors it, unpatched, at WORK/build/llama.cpp."""
    lock = build_native.read_lock()
    sdist = build_native.fetch_sdist(lock)
    src = work / "build" / "llama.cpp"
    stamp = work / "build" / "llama.cpp.stamp"
    if stamp.exists() and stamp.read_text() == lock["sha256"] and src.exists():
        return src
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    prefix = f"{lock['package'].replace('-', '_')}-{lock['version']}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and m.name != prefix.rstrip("/") and not m.name[len(prefix):].startswith(".git"):
                m.name = m.name[len(prefix):]
                members.append(m)
        tar.extractall(src, members=members, filter="data")
    stamp.write_text(lock["sha256"])
    return src


def build(work: Path, jobs: int) -> Path:
    stock_tree(work)
    (work / "CMakeLists.txt").write_text(WRAPPER)
    shutil.copy2(ROOT / "tools" / "golden_stock.c", work / "golden_stock.c")
    cmake_dir = work / "build" / "cmake"
    env, launcher, generator = build_native.build_env()
    env["CCACHE_BASEDIR"] = str(work)
    nice = ["nice", "-n", "10"]
    build_native.run(["cmake", "-S", str(work), "-B", str(cmake_dir), *generator, *build_native.cmake_options(),
                      *launcher], env, True, "cmake configure of stock llama.cpp failed")
    build_native.run([*nice, "cmake", "--build", str(cmake_dir), "--target", "golden_stock", "-j", str(jobs)],
                     env, True, "build of golden_stock failed")
    return cmake_dir / "golden_stock"


def run_stock(exe: Path, model: Path, n_new: int, all_rows: bool, logits: Path | None,
              text: str) -> tuple[list[int], list[int]]:
    cmd = [str(exe), str(model), str(N_CTX), str(N_BATCH), str(N_THREADS), str(n_new), str(int(all_rows)),
           str(logits) if logits else "-", "--text", text]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    prompt, generated = out.split("\t")
    return [int(t) for t in prompt.split(",")], [int(t) for t in generated.split(",")]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/meshd-stock"))
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--build-only", action="store_true")
    args = ap.parse_args()
    try:
        exe = build(args.work, args.jobs)
    except build_native.BuildError as exc:
        print(f"make_goldens: {exc}", file=sys.stderr)
        return 1
    if args.build_only:
        print(f"golden_stock: {exe}")
        return 0
    lock = build_native.read_lock()
    from meshd.mesh.models import default_model_path

    GOLDEN.mkdir(parents=True, exist_ok=True)
    model = default_model_path()
    runs = []
    for text in DEFAULT_PROMPTS:
        prompt, greedy = run_stock(exe, model, DEFAULT_NEW, False, None, text)
        runs.append({"text": text, "prompt": prompt, "greedy": greedy})
    (GOLDEN / "smollm2_greedy.json").write_text(json.dumps({
        "llama_cpp_commit": lock["llama_cpp_commit"], "model": model.name, "model_sha256": sha256_of(model),
        "n_ctx": N_CTX, "n_batch": N_BATCH, "n_threads": N_THREADS, "new_tokens": DEFAULT_NEW, "runs": runs,
    }, indent=1) + "\n")

    tiny = write_tiny_gguf(args.work / f"{TINY_SPEC}.gguf", TINY_SPECS[TINY_SPEC])
    npy = GOLDEN / f"tiny_{TINY_SPEC}.npy"
    raw = args.work / "tiny_logits.f32"
    prompt, greedy = run_stock(exe, tiny, TINY_NEW, True, raw, TINY_PROMPT)
    n_vocab = len(byte_level_vocab()[0])
    logits = np.fromfile(raw, dtype=np.float32).reshape(-1, n_vocab)
    np.save(npy, logits)
    (GOLDEN / f"tiny_{TINY_SPEC}.json").write_text(json.dumps({
        "llama_cpp_commit": lock["llama_cpp_commit"], "spec": TINY_SPEC, "model_sha256": sha256_of(tiny),
        "n_ctx": N_CTX, "n_batch": N_BATCH, "n_threads": N_THREADS, "new_tokens": TINY_NEW,
        "text": TINY_PROMPT, "prompt": prompt, "greedy": greedy, "logits_rows": int(logits.shape[0]),
    }, indent=1) + "\n")
    print(f"goldens written to {GOLDEN} ({len(runs)} default-model runs, tiny logits {logits.shape})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
