"""llama.cpp's own programs, the baseline a benchmark runs beside meshd: llama-bench (one process, or
layers split over ggml-rpc-servers) and llama-batched-bench (N sequences decoding in one batch). They are
built from the same patched tree by ``tools/build_native.py --tools``."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib.procs import TOOLS, BenchError, proc_status

BATCHED_BENCH = TOOLS / "llama-batched-bench"




def tensor_split(ranges: list[tuple[int, int]], n_layer: int) -> str:
    """-ts proportions that give RPC device i exactly layers ranges[i] (the output layer goes last).

    llama.cpp puts layer il (0..n_layer, n_layer being the output) on the first
    device whose cumulative split exceeds il / (n_layer + 1); cutting half a
    layer below each boundary keeps float rounding away from the edges.
    """
    props = []
    prev = 0.0
    for i, (_, end) in enumerate(ranges):
        cut = float(n_layer + 1) if i == len(ranges) - 1 else end - 0.5
        props.append(cut - prev)
        prev = cut
    return "/".join(f"{p:g}" for p in props)


def run_llama_bench(model: Path, threads: int, prompts: list[int], n_gen: int, reps: int, poll: int | None,
                    rpc: list[str] | None = None, ts: str | None = None, verbose: bool = False,
                    flash_attn: bool | None = None) -> dict[str, Any]:
    """llama-bench's figures; flash_attn None leaves llama.cpp's default (auto: on for the CPU)."""
    cmd = [str(TOOLS / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", ",".join(map(str, prompts)),
           "-n", str(n_gen), "-r", str(reps), "-o", "json"]
    if flash_attn is not None:
        cmd += ["-fa", str(int(flash_attn))]
    if poll is not None:
        cmd += ["--poll", str(poll)]
    if rpc:
        cmd += ["--rpc", ",".join(rpc), "-ngl", "99", "-sm", "layer", "-ts", ts or ""]
    else:
        cmd += ["-ngl", "0"]
    if verbose:
        cmd.append("-v")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        # Sampled from /proc, not wait4's ru_maxrss: that also counts this
        # (large) process's memory, which the child had before its exec.
        peak_kib = 0
        while proc.poll() is None:
            peak_kib = max(peak_kib, proc_status(proc.pid)["VmHWM"])
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise BenchError(f"llama-bench failed ({' '.join(cmd)}): {stderr.strip()[-500:]}")
    tests = json.loads(stdout)
    result: dict[str, Any] = {"cmd": cmd, "maxrss_kib": peak_kib, "tests": {}}
    for t in tests:
        key = f"pp{t['n_prompt']}" if t["n_gen"] == 0 else f"tg{t['n_gen']}"
        result["tests"][key] = {"avg_ts": t["avg_ts"], "samples_ts": t["samples_ts"]}
    if verbose:
        result["log"] = stderr
    return result


def rpc_layer_devices(log: str) -> dict[str, list[int]]:
    """Which layers llama.cpp put on which device, from its debug log ('layer N assigned to device D')."""
    devices: dict[str, list[int]] = {}
    for m in re.finditer(r"layer\s+(\d+) assigned to device (\S+?),", log):
        devices.setdefault(m.group(2), []).append(int(m.group(1)))
    return devices


def llama_batched(model: Path, threads: int, sessions: list[int], prompt_tokens: int, tokens: int) -> dict[str, Any]:
    """N sequences of ``prompt_tokens`` each decoding ``tokens`` in one batch, for each N in ``sessions``:
    one process's answer to N sessions at once (decode tok/s over all of them, prefill, time to first token)."""
    if not BATCHED_BENCH.exists():
        raise BenchError(f"{BATCHED_BENCH} is missing: run tools/build_native.py --tools first")
    n_ctx = max(sessions) * (prompt_tokens + tokens) + 64
    cmd = [str(BATCHED_BENCH), "-m", str(model), "-t", str(threads), "-tb", str(threads),
           "-c", str(n_ctx), "-b", "512", "-ub", "512", "-ngl", "0", "-npp", str(prompt_tokens),
           "-ntg", str(tokens), "-npl", ",".join(map(str, sessions)), "--output-format", "jsonl"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"llama-batched-bench failed ({' '.join(cmd)}): {proc.stderr.strip()[-500:]}")
    runs: dict[str, Any] = {}
    for line in proc.stdout.splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        runs[str(r["pl"])] = {"decode": r["speed_tg"], "end_to_end": r["speed"], "ttft_ms": r["t_pp"] * 1000,
                              "prefill": r["speed_pp"]}
    missing = [n for n in sessions if str(n) not in runs]
    if missing:
        raise BenchError(f"llama-batched-bench gave no result for {missing} sequences: {proc.stdout[-300:]}")
    return {"cmd": cmd, "runs": runs}
