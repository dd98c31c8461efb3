#!/usr/bin/env python3
"""meshd's pipeline against llama.cpp, in one run: decode, prefill, first token, memory, concurrency.

Needs llama.cpp's own programs from the same pinned, patched source and the
same ggml options as meshd's engine: `tools/build_native.py --tools` puts
`llama-bench` and `ggml-rpc-server` in build/native-tools/bin/.

Setups, all on this machine over loopback, all with --threads compute threads
per process (default 1, because the box has 2 cores and a pipeline of 3 stages
already runs 3 engine processes; pass --threads 2 to compare at 2):

* llama.cpp, one process: `llama-bench` on the whole model.
* llama.cpp RPC backend: `llama-bench --rpc` driving 2 or 3 `ggml-rpc-server`
  processes, every layer offloaded (-ngl 99) and split by -ts so that server i
  holds exactly the layers meshd stage i holds ([0,15)+[15,30) and
  [0,10)+[10,20)+[20,30) for the 30-layer default model; the output head goes
  with the last range, the token embedding stays in the driving process as
  llama.cpp always does). The split is checked from llama.cpp's own log.
* meshd with 1, 2 and 3 `meshd serve` stages on loopback (even layer ranges),
  driven by this process through meshd.ask.run_session, as `meshd ask` does.

Figures (medians over --repeats rounds; in each round every setup runs once,
in rotating order, so drift on a shared machine hits all alike):

* decode tok/s: greedy generation of --decode tokens. llama.cpp: llama-bench
  `tg` (tokens / time of the single-token decode calls). meshd: (tokens - 1) /
  (time from the first streamed token to the last), as seen by the asker, i.e.
  the steady token interval of the ring, every hop and process boundary
  included. A raw-text prompt is used so that generation runs its full length.
* prefill tok/s: a --prefill-token prompt (512). llama.cpp: llama-bench `pp512`.
  meshd: 512 / time to first token of a session whose prompt is those 512
  token ids and which generates 1 token (open, chunked pipelined prefill across
  the stages, sampling, streaming back: everything the asker waits for).
* TTFT ms: time to first token of a short chat prompt (the chat template
  applied). meshd: measured at the asker, stream opens included. llama.cpp:
  estimated as the prompt's length / llama-bench's prefill rate for a prompt of
  that length (llama-bench does not stream), so it leaves out process start and
  model load, which meshd's figure also leaves out.
* RSS MiB: resident memory. meshd: per stage, daemon + engine worker VmRSS at
  the end of the run (peak VmHWM alongside in the JSON). llama.cpp single:
  peak RSS of the llama-bench process (its VmHWM, sampled every 50 ms). RPC:
  peak VmHWM of each rpc-server (they free their buffers when the client
  leaves), driving process aside.
* meshd's engine in one process: the same greedy decode through meshd's own
  engine binding, every range's context in this process, called one after the
  other: the compute of a split without IPC, wire or a second process, i.e.
  the floor under what the stages can reach.
* where a decoded token's time goes: CPU time of every stage daemon, engine
  worker and of the asker (this process) over each meshd decode session, per
  generated token, from /proc/PID/task/*/schedstat.
* aggregate tok/s: N concurrent greedy sessions of --agg-tokens tokens through
  the 3-stage pipeline; all tokens generated / wall time from the first open to
  the last token. The ratio column divides by single-process llama.cpp decode.

Ratios are against single-process llama.cpp from the same run. Goal from the
design: 3 stages decode at >= 0.85x single-process llama.cpp and faster than
the RPC backend on the same split.

Usage: .venv/bin/python tools/bench_pipeline.py [--threads 1] [--repeats 3] [--json bench-out/pipeline.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import trio  # noqa: E402
from bench_engine import decode_rate  # noqa: E402

from meshd.client.ask import AskRequest, AskResult, Stage, route_at, run_session  # noqa: E402
from meshd.engine.chain import LocalChain, even_ranges  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))  # the local-process helpers live with the tests
from localmesh import stop_process  # noqa: E402

from meshd.mesh.models import default_model_path  # noqa: E402
from meshd.net.peers import Peers, open_peers  # noqa: E402
from wire.identity import NodeIdentity  # noqa: E402
from wire.stage import STAGE_PROTOCOL, Metrics, MetricsRequest  # noqa: E402

TOOLS = ROOT / "build" / "native-tools" / "bin"
READY = re.compile(r"^ready (\S+) pid=(\d+) worker=(\d+)")
CHAT_PROMPT = "What is the capital of France?"
DECODE_TEXT = "The history of the city begins in the early middle ages, when"
AGG_TEXTS = [
    "The history of the city begins in the early middle ages, when",
    "In the first chapter of the book, the author describes",
    "The recipe calls for flour, sugar, eggs and butter. First,",
    "The old lighthouse keeper looked out over the sea and",
    "Photosynthesis is the process by which plants",
    "The train left the station at dawn, carrying",
    "Mathematics has long been described as the language of",
    "On the morning of the expedition, the team gathered",
]
# varied prose for the prefill prompt; cut to exactly --prefill tokens
PREFILL_TEXT = " ".join(
    f"Section {i}. The committee met on day {i * 7 % 31 + 1} to review the {w} report, noting that "
    f"{i * 13 % 97} of the {i * 29 % 211 + 100} items were complete and that the remaining work on the "
    f"{w} would continue through the following season."
    for i, w in enumerate(["harbour", "railway", "library", "orchard", "bridge", "market", "school",
                           "hospital", "canal", "museum", "garden", "factory"] * 4)
)


class BenchError(Exception):
    pass


# ----- processes


@dataclass
class Proc:
    proc: subprocess.Popen[bytes]
    log: Path
    pids: list[int]
    address: str = ""

    def stop(self) -> None:
        stop_process(self.proc)


def cpu_ns(pid: int) -> int:
    """CPU time of all threads of a live process so far, in ns (0 when it is gone)."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[0])
    except OSError:
        pass
    return total


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a live process, in KiB (0 when it is gone)."""
    out = {"VmRSS": 0, "VmHWM": 0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in out:
                out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def start_stage(model: Path, layers: tuple[int, int], threads: int, poll: int | None, logdir: Path,
                max_sessions: int, session_tokens: int, timeout: float = 120.0) -> Proc:
    log = logdir / f"serve-{layers[0]}-{layers[1]}.log"
    cmd = [sys.executable, "-m", "meshd.cli", "serve", "--model", str(model), "--layers", f"{layers[0]}:{layers[1]}",
           "--listen", "127.0.0.1:0", "--threads", str(threads), "--max-sessions", str(max_sessions),
           "--session-tokens", str(session_tokens)]
    if poll is not None:
        cmd += ["--poll", str(poll)]
    f = log.open("wb")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            m = READY.match(line)
            if m:
                return Proc(proc, log, [int(m.group(2)), int(m.group(3))], m.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise BenchError(f"meshd serve --layers {layers[0]}:{layers[1]} did not become ready: "
                     + log.read_text(errors="replace").strip()[-500:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rpc_server(threads: int, logdir: Path, i: int, timeout: float = 30.0) -> Proc:
    port = free_port()
    log = logdir / f"rpc-server-{i}.log"
    f = log.open("wb")
    proc = subprocess.Popen([str(TOOLS / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
                            stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                pass
            # a probe connection is a client to it; give it a moment to drop that one
            time.sleep(0.2)
            return Proc(proc, log, [proc.pid], f"127.0.0.1:{port}")
        except OSError:
            time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise BenchError(f"ggml-rpc-server did not start: {log.read_text(errors='replace').strip()[-300:]}")


# ----- llama.cpp


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


# ----- meshd


async def route_of(peers: Peers, stages: list[Proc]) -> list[Stage]:
    return route_at([s.address for s in stages])


async def meshd_decode(peers: Peers, route: list[Stage], n: int, fast: bool = True) -> dict[str, float]:
    """Decode tok/s of one session: on the fast path (rows worker to worker), or through the daemons."""
    result = AskResult()
    await run_session(peers, route, AskRequest(text=DECODE_TEXT, max_tokens=n, fast=fast), result)
    return {"rate": result.decode_rate, "tokens": float(len(result.tokens))}


async def meshd_decode_cpu(peers: Peers, route: list[Stage], stages: list[Proc], n: int) -> dict[str, Any]:
    """``meshd_decode``, and the CPU each stage's daemon and worker and this asker spent on it."""
    pids = [pid for s in stages for pid in s.pids]
    before = [cpu_ns(pid) for pid in pids]
    asker = time.process_time_ns()
    d = await meshd_decode(peers, route, n)
    asker = time.process_time_ns() - asker
    spent = [cpu_ns(pid) - b for pid, b in zip(pids, before, strict=False)]
    return d | {"cpu_ns": spent + [asker]}


async def meshd_prefill(peers: Peers, route: list[Stage], tokens: list[int],
                        stall_timeout: float = 30.0) -> dict[str, float]:
    # the prompt travels as token ids (the path a re-prefill after failover takes), so it is exactly len(tokens)
    result = AskResult(prompt_tokens=list(tokens))
    result.started = time.perf_counter()
    await run_session(peers, route, AskRequest(text="", max_tokens=1), result, stall_timeout=stall_timeout)
    assert result.ttft is not None
    return {"rate": len(tokens) / result.ttft, "ttft": result.ttft}


async def meshd_ttft(peers: Peers, route: list[Stage]) -> dict[str, float]:
    result = AskResult()
    await run_session(peers, route, AskRequest(messages=[{"role": "user", "content": CHAT_PROMPT}], max_tokens=1),
                      result)
    assert result.ttft is not None
    return {"ttft": result.ttft, "prompt_tokens": float(len(result.prompt_tokens))}


async def meshd_aggregate(peers: Peers, route: list[Stage], n_sessions: int, n_tokens: int) -> dict[str, float]:
    results = [AskResult() for _ in range(n_sessions)]
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        results[i].started = time.perf_counter()
        await run_session(peers, route, AskRequest(text=AGG_TEXTS[i % len(AGG_TEXTS)], max_tokens=n_tokens),
                          results[i])

    async with trio.open_nursery() as nursery:
        for i in range(n_sessions):
            nursery.start_soon(one, i)
    last = max(r.finished_at or t0 for r in results)
    total = sum(len(r.tokens) for r in results)
    return {"rate": total / (last - t0), "tokens": float(total),
            "per_session": statistics.median(r.decode_rate for r in results)}


async def stage_metrics(peers: Peers, address: str) -> dict[str, float]:
    stream = await peers.open_stream(address, STAGE_PROTOCOL)
    async with stream:
        await stream.send_message(MetricsRequest())
        reply = await stream.receive_message()
    return reply.values if isinstance(reply, Metrics) else {}


# ----- the run


def write_json(path: Path | None, out: dict[str, Any]) -> None:
    """Every figure a benchmark measured, as JSON (nothing where no path is given)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2))


def publish(out: dict[str, Any], text: str, path: Path | None) -> None:
    """A benchmark's table on stdout, and with every figure in the JSON."""
    print(text)
    out["table"] = text
    write_json(path, out)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def prompt_tokens(model: Path, n: int) -> tuple[list[int], int, int]:
    """Exactly n token ids of varied prose, the length of the chat prompt as the head builds it, n_layer."""
    from meshd.engine.engine import Model

    m = Model(model, (0, 1))
    try:
        tokens = m.tokenize(PREFILL_TEXT, add_special=True, parse_special=False)
        chat = m.tokenize(m.apply_chat([{"role": "user", "content": CHAT_PROMPT}], add_assistant=True),
                          add_special=False, parse_special=True)
        n_layer = m.report.n_layer
    finally:
        m.close()
    if len(tokens) < n:
        raise BenchError(f"the prefill text has only {len(tokens)} tokens, {n} wanted")
    return tokens[:n], len(chat), n_layer


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or default_model_path()
    for tool in ("llama-bench", "ggml-rpc-server"):
        if not (TOOLS / tool).exists():
            raise BenchError(f"{TOOLS / tool} is missing: run tools/build_native.py --tools first")
    prefill_ids, n_chat, n_layer = prompt_tokens(model, args.prefill)
    logdir = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    stage_counts = [int(x) for x in args.stages.split(",")]
    rpc_counts = [k for k in stage_counts if k > 1]
    sessions = [int(x) for x in args.sessions.split(",")]
    splits = {k: even_ranges(n_layer, k) for k in stage_counts}
    procs: list[Proc] = []
    chains: dict[int, LocalChain] = {}
    out: dict[str, Any] = {
        "model": str(model), "threads": args.threads, "poll": args.poll, "decode_tokens": args.decode,
        "prefill_tokens": args.prefill, "chat_prompt_tokens": n_chat, "repeats": args.repeats,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                 "loadavg_before": os.getloadavg()},
        "kv": {"max_sessions": max(sessions), "session_tokens": args.session_tokens},
        "llama_cpp_commit": (TOOLS.parent / "llama_cpp_commit").read_text().strip()
        if (TOOLS.parent / "llama_cpp_commit").exists() else None,
        "splits": {str(k): [list(r) for r in v] for k, v in splits.items()},
        "runs": {}, "rss": {}, "aggregate": {}, "decode_cpu": {},
    }
    runs: dict[str, dict[str, list[float]]] = out["runs"]
    try:
        stages: dict[int, list[Proc]] = {}
        for k in stage_counts:
            stages[k] = [start_stage(model, r, args.threads, args.poll, logdir, max(sessions), args.session_tokens)
                         for r in splits[k]]
            procs += stages[k]
        servers = [start_rpc_server(args.threads, logdir, i) for i in range(max(rpc_counts, default=0))]
        procs += servers
        print(f"started {sum(len(v) for v in stages.values())} meshd stages and {len(servers)} rpc-servers "
              f"(logs in {logdir})", file=sys.stderr)

        # the RPC split really is meshd's split: ask llama.cpp where it put each layer
        out["rpc_layout"] = {}
        for k in rpc_counts:
            ts = tensor_split(splits[k], n_layer)
            r = await trio.to_thread.run_sync(functools.partial(
                run_llama_bench, model, args.threads, [8], 0, 1, args.poll, [s.address for s in servers[:k]], ts,
                verbose=True))
            layout = rpc_layer_devices(r["log"])
            got = sorted((min(v), max(v) + 1) for d, v in layout.items() if d.startswith("RPC"))
            want = [(a, b) for a, b in splits[k]]
            want[-1] = (want[-1][0], n_layer + 1)  # the output layer goes with the last range
            out["rpc_layout"][str(k)] = {"ts": ts, "devices": layout}
            if got != want:
                raise BenchError(f"-ts {ts} put layers {got} on the RPC servers, not {want}")
            print(f"rpc split over {k} servers (-ts {ts}): {got} (index {n_layer} = output)", file=sys.stderr)

        chains = {k: LocalChain(model, splits[k], n_ctx=2048, n_threads=args.threads) for k in stage_counts}
        decode_ids = chains[stage_counts[0]].head.tokenize(DECODE_TEXT)
        for chain in chains.values():
            decode_rate(chain, decode_ids, 8)
        async with open_peers(NodeIdentity.generate()) as peers:
            routes = {k: await route_of(peers, stages[k]) for k in stage_counts}
            for k in stage_counts:  # warm links, KV and caches
                await meshd_decode(peers, routes[k], 8)

            items: list[tuple[str, int | None]] = [("llama.cpp", None)]
            items += [(f"rpc{k}", k) for k in rpc_counts]
            items += [(f"meshd{k}", k) for k in stage_counts]
            items += [(f"engine{k}", k) for k in stage_counts]
            for rep in range(args.repeats):
                order = items[rep % len(items):] + items[:rep % len(items)]
                for name, k in order:
                    runs.setdefault(name, {})
                    rec = runs[name]
                    if name == "llama.cpp" or name.startswith("rpc"):
                        rpc = [s.address for s in servers[:k]] if k else None
                        ts = tensor_split(splits[k], n_layer) if k else None
                        r = await trio.to_thread.run_sync(
                            run_llama_bench, model, args.threads, [args.prefill, n_chat], args.decode,
                            args.llama_reps, args.poll, rpc, ts)
                        rec.setdefault("decode", []).extend(r["tests"][f"tg{args.decode}"]["samples_ts"])
                        rec.setdefault("prefill", []).extend(r["tests"][f"pp{args.prefill}"]["samples_ts"])
                        rec.setdefault("ttft", []).extend(n_chat / x for x in r["tests"][f"pp{n_chat}"]["samples_ts"])
                        rec.setdefault("maxrss_kib", []).append(r["maxrss_kib"])
                    elif name.startswith("engine"):
                        chain = chains[k]
                        rate = await trio.to_thread.run_sync(decode_rate, chain, decode_ids, args.decode)
                        rec.setdefault("decode", []).append(rate)
                        print(f"round {rep + 1}/{args.repeats} {name}: decode {rate:.1f} tok/s", file=sys.stderr)
                        continue
                    else:
                        route = routes[k]
                        d = await meshd_decode_cpu(peers, route, stages[k], args.decode)
                        rec.setdefault("decode", []).append(d["rate"])
                        rec.setdefault("decode_tokens", []).append(d["tokens"])
                        out["decode_cpu"].setdefault(str(k), []).append(d["cpu_ns"])
                        p = await meshd_prefill(peers, route, prefill_ids)
                        rec.setdefault("prefill", []).append(p["rate"])
                        t = await meshd_ttft(peers, route)
                        rec.setdefault("ttft", []).append(t["ttft"])
                    print(f"round {rep + 1}/{args.repeats} {name}: decode {rec['decode'][-1]:.1f} tok/s, "
                          f"prefill {rec['prefill'][-1]:.1f} tok/s, ttft {rec['ttft'][-1] * 1000:.1f} ms",
                          file=sys.stderr)

            k_agg = max(stage_counts)
            for rep in range(args.repeats):
                for n in sessions:
                    a = await meshd_aggregate(peers, routes[k_agg], n, args.agg_tokens)
                    agg = out["aggregate"].setdefault(str(n), {"rate": [], "per_session": [], "tokens": []})
                    for key in agg:
                        agg[key].append(a[key])
                    print(f"round {rep + 1}/{args.repeats} aggregate {n} sessions on {k_agg} stages: "
                          f"{a['rate']:.1f} tok/s ({a['tokens']:.0f} tokens)", file=sys.stderr)
            out["stage_metrics"] = {str(k): [await stage_metrics(peers, s.address) for s in stages[k]]
                                    for k in stage_counts}

        for k in stage_counts:
            per = []
            for s in stages[k]:
                st = [proc_status(pid) for pid in s.pids]
                per.append({"layers": None, "rss_kib": sum(x["VmRSS"] for x in st),
                            "hwm_kib": sum(x["VmHWM"] for x in st),
                            "daemon_rss_kib": st[0]["VmRSS"], "worker_rss_kib": st[1]["VmRSS"]})
            for p, r in zip(per, splits[k], strict=False):
                p["layers"] = list(r)
            out["rss"][f"meshd{k}"] = per
        out["rss"]["rpc_servers"] = [{"hwm_kib": proc_status(s.pids[0])["VmHWM"],
                                      "rss_kib": proc_status(s.pids[0])["VmRSS"]} for s in servers]
    finally:
        for p in procs:
            p.stop()
        for chain in chains.values():
            chain.close()
    out["host"]["loadavg_after"] = os.getloadavg()
    out["median"] = {name: {key: median(v) for key, v in rec.items()} for name, rec in runs.items()}
    out["aggregate_median"] = {n: {key: median(v) for key, v in a.items()} for n, a in out["aggregate"].items()}
    return out


def mib(kib: float) -> str:
    return f"{kib / 1024:.0f}"


def table(out: dict[str, Any]) -> str:
    med = out["median"]
    base = med["llama.cpp"]
    lines = [
        f"model {Path(out['model']).name}, {out['threads']} thread(s) per process, "
        f"poll {out['poll'] if out['poll'] is not None else 'default (llama-bench 50, meshd 0)'}, "
        f"{out['host']['cpus']} CPUs, "
        f"median of {out['repeats']} rounds; decode {out['decode_tokens']} tokens, prefill {out['prefill_tokens']} "
        f"tokens, TTFT for a {out['chat_prompt_tokens']}-token chat prompt",
        "",
        "| setup | decode tok/s (range) | × llama.cpp | prefill tok/s | × llama.cpp | TTFT ms | RSS MiB per stage |",
        "|---|---|---|---|---|---|---|",
    ]

    def row(label: str, name: str, rss: str, ttft_note: str = "") -> None:
        m = med.get(name)
        if not m:
            return
        d = out["runs"][name]["decode"]
        lines.append(f"| {label} | {m['decode']:.1f} ({min(d):.0f}–{max(d):.0f}) | {m['decode'] / base['decode']:.2f} | "
                     f"{m['prefill']:.1f} | "
                     f"{m['prefill'] / base['prefill']:.2f} | {m['ttft'] * 1000:.1f}{ttft_note} | {rss} |")

    row("llama.cpp, 1 process", "llama.cpp", f"{mib(base['maxrss_kib'])} (peak)", " (est.)")
    servers = out["rss"].get("rpc_servers", [])
    for k in sorted(int(n[3:]) for n in med if n.startswith("rpc")):
        rss = " / ".join(mib(s["hwm_kib"]) for s in servers[:k]) + " (peak) + driver " + \
            mib(med[f"rpc{k}"]["maxrss_kib"])
        splits = "+".join(f"[{a},{b})" for a, b in out["splits"][str(k)])
        row(f"llama.cpp RPC, {k} servers {splits}", f"rpc{k}", rss, " (est.)")
    for k in sorted(int(n[5:]) for n in med if n.startswith("meshd")):
        rss = " / ".join(mib(s["rss_kib"]) for s in out["rss"][f"meshd{k}"])
        splits = "+".join(f"[{a},{b})" for a, b in out["splits"][str(k)])
        row(f"meshd, {k} stage{'s' if k > 1 else ''} {splits}", f"meshd{k}", rss)
    for k in sorted(int(n[6:]) for n in med if n.startswith("engine")):
        m = med[f"engine{k}"]
        d = out["runs"][f"engine{k}"]["decode"]
        lines.append(f"| meshd's engine, {k} range{'s' if k > 1 else ''} in one process (no IPC, no wire) | "
                     f"{m['decode']:.1f} ({min(d):.0f}–{max(d):.0f}) | {m['decode'] / base['decode']:.2f} | – | – | – | – |")
    lines += ["", "Where a decoded token's time goes: CPU ms of each meshd process (all threads) over a whole decode "
                  "session (open, prompt, tokens) per generated token, median over rounds; wall: ms between "
                  "streamed tokens",
              "", "| stages | " + "stage daemon / engine worker, head first | asker | all | wall |", "|---|---|---|---|---|"]
    for k, samples in sorted(out["decode_cpu"].items(), key=lambda kv: int(kv[0])):
        tokens = out["runs"][f"meshd{k}"]["decode_tokens"]
        per = [median([s[i] / 1e6 / max(1.0, t) for s, t in zip(samples, tokens, strict=False)]) for i in range(len(samples[0]))]
        pairs = " · ".join(f"{per[2 * i]:.2f} / {per[2 * i + 1]:.2f}" for i in range(int(k)))
        lines.append(f"| {k} | {pairs} | {per[-1]:.2f} | {sum(per):.2f} | {1000 / med[f'meshd{k}']['decode']:.2f} |")
    lines += ["", f"| concurrent sessions ({max(int(k) for k in out['splits'])} stages) | aggregate tok/s | "
                  f"× llama.cpp decode | median per-session tok/s |", "|---|---|---|---|"]
    for n, a in sorted(out["aggregate_median"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {n} | {a['rate']:.1f} | {a['rate'] / base['decode']:.2f} | {a['per_session']:.1f} |")
    lines += ["", f"meshd stages hold KV for {out['kv']['max_sessions']} sessions x {out['kv']['session_tokens']} tokens "
                  f"(daemon + engine worker); llama-bench sizes its KV for one prompt. Load average "
                  f"{out['host']['loadavg_before'][0]:.1f} before, {out['host']['loadavg_after'][0]:.1f} after."]
    k = max(int(k) for k in out["splits"])
    m3 = med.get(f"meshd{k}")
    r3 = med.get(f"rpc{k}")
    if m3:
        goal = f"\n{k}-stage decode: {m3['decode'] / base['decode']:.2f}× single-process llama.cpp (goal ≥ 0.85)"
        if r3:
            goal += f", {m3['decode'] / r3['decode']:.2f}× llama.cpp RPC over {k} servers (goal > 1)"
        lines.append(goal)
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads of every process (default 1)")
    ap.add_argument("--poll", type=int, default=None,
                    help="ggml threadpool busy-poll level 0..100 for every process (default: ggml's, 50)")
    ap.add_argument("--stages", default="1,2,3", help="meshd pipeline lengths (RPC runs for those > 1)")
    ap.add_argument("--decode", type=int, default=128, help="tokens generated for the decode figure")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens for the prefill figure")
    ap.add_argument("--sessions", default="1,4,8", help="concurrent sessions for the aggregate figure")
    ap.add_argument("--agg-tokens", type=int, default=64, help="tokens per session in the aggregate figure")
    ap.add_argument("--session-tokens", type=int, default=1024, help="KV tokens per session on each stage")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported")
    ap.add_argument("--llama-reps", type=int, default=2, help="llama-bench -r within each round")
    ap.add_argument("--json", type=Path, help="write every sample and the medians here")
    args = ap.parse_args()
    try:
        out = trio.run(bench, args)
    except BenchError as exc:
        print(f"bench_pipeline: {exc}", file=sys.stderr)
        return 1
    publish(out, table(out), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
