#!/usr/bin/env python3
"""Hub fetch figures (issue 29, parts 2 and 3): three capped volunteers fetch their ranges of a 3B-class model from a hub.

The model: tools/make_big_gguf.py's random-weight llama of Llama 3.2 3B's
dimensions, Q4_K_M, a 3-part gguf-split set (about 1.9 GB), published on
tools/fake_hub.py (a real HTTP server on loopback speaking the hub's paths,
with Range; its counters say which bytes each volunteer's token read).

1. Raw: a process of its own (as each volunteer is: a reader in this one would
   share the server's interpreter lock) reads every part from the server in
   16 MiB ranges, on one connection and on four, through the same client
   (huggingface_hub's session) and nothing else: no hashing, no disk. The
   server's raw rate.
2. Three volunteers: real ``meshd join --model hf:org/llama3b`` daemons whose
   ``--memory`` holds about a third each (none can hold the model). The first
   reads the whole set once to build the manifest (checked against each part's
   sha256); each then fetches its range (a chunk checked, written to its sparse
   file). Figures from their logs: the first one's whole read in MB/s, each
   range fetch's bytes and MB/s (against raw), the bytes each read from the
   server (its counters), and from the first join to the mesh covering the
   model, every volunteer serving.
3. The answer: a greedy ask of the mesh once it covers the model, timed from
   the first join to its first token, and its decode tok/s against the whole
   model's in this process (one thread, as each volunteer; after the daemons
   stop), the two answers compared token for token.

Usage: .venv/bin/python tools/bench_hub.py [--dir /tmp/bench-hub] [--memory 800M] [--json bench-out/hub.json]
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import re
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import trio
from benchlib.asks import decode_rate
from benchlib.result import parser, publish
from fake_hub import FakeHub
from localmesh import Served, mesh_status, start_join, stop_all
from make_big_gguf import NAME, SMALL, Dims, write

from meshd.client.ask import AskRequest, AskResult
from meshd.client.failover import ask_with_failover
from meshd.client.route import Stage, route_from_reply
from meshd.engine.chain import LocalChain
from meshd.fetch.hub import HubReader, parse_spec, resolve
from meshd.net.peers import open_peers
from meshd.net.rpc import mesh_rpc
from wire.identity import NodeIdentity
from wire.meshrpc import RouteReply, RouteRequest

REPO = "org/llama3b"
RAW_READ = 16 << 20
FETCHED = re.compile(r"^(\S+) INFO meshd\.daemon(?:\.\w+)?: fetched layers \[(\d+), (\d+)\): (\d+) bytes over the network, "
                     r"(\d+) already here, in ([\d.]+) s", re.MULTILINE)
HASHED = re.compile(r"read and checked (\d+) bytes of .* in ([\d.]+) s")
SESSIONS = ["--threads", "1", "--max-sessions", "2", "--session-tokens", "256"]
PROMPT = "What is the capital of France?"


def model_files(directory: Path, smoke: bool) -> list[Path]:
    parts = sorted(directory.glob(f"{NAME}-0000?-of-00003.gguf"))
    if len(parts) == 3 and not smoke:
        return parts
    return write(directory, 3, SMALL if smoke else Dims(), quiet=True)


def raw_rate(endpoint: str, connections: int) -> float:
    """Bytes a second the server sends of every part, read in 16 MiB ranges over `connections` at once (in a
    process of its own: ``raw_rates``)."""
    reader = HubReader(resolve(parse_spec(f"hf:{REPO}"), endpoint=endpoint))
    jobs = [(i, start, min(f.size, start + RAW_READ)) for i, f in enumerate(reader.model.files)
            for start in range(0, f.size, RAW_READ)]
    started = time.monotonic()
    with ThreadPoolExecutor(connections) as pool:
        total = sum(len(data) for data in pool.map(lambda job: reader.read(*job), jobs))
    return total / (time.monotonic() - started)


def raw_rates(endpoint: str) -> tuple[float, float]:
    """The server's raw rate on one connection and on four, MB/s (the median of 3 each), read by a process of its
    own, as each volunteer is."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        ones = [pool.apply(raw_rate, (endpoint, 1)) / 1e6 for _ in range(3)]
        fours = [pool.apply(raw_rate, (endpoint, 4)) / 1e6 for _ in range(3)]
    return statistics.median(ones), statistics.median(fours)


async def covered_and_asked(node: Served, nodes: list[Served], timeout: float, tokens: int
                            ) -> tuple[float, AskResult]:
    """Until every volunteer serves and the model is covered (the monotonic time it was), then the mesh's greedy
    answer to PROMPT (its first token's time and decode rate)."""
    async with open_peers(NodeIdentity.generate()) as peers:
        with trio.fail_after(timeout):
            while True:
                assert not [n for n in nodes if n.proc.poll() is not None], "a daemon exited"
                view = await mesh_status(peers, node)
                serving = {m.node_id for m in view.members if m.state == "alive" and m.served}
                if view.coverage and view.coverage[0].covered_layers == view.coverage[0].n_layers and \
                        all(n.node_id in serving for n in nodes):
                    break
                await trio.sleep(0.5)
        at = time.monotonic()

        async def find(excluded: list[str]) -> list[Stage]:
            reply = await mesh_rpc(peers, node.address, RouteRequest(exclude=excluded), timeout=60.0)
            assert isinstance(reply, RouteReply)
            return route_from_reply(reply)

        with trio.fail_after(timeout):
            answer = await ask_with_failover(peers, find, AskRequest(
                messages=[{"role": "user", "content": PROMPT}], max_tokens=tokens),
                stall_timeout=120)
        return at, answer


def whole_decode(first_part: Path, tokens: int) -> tuple[float, list[int]]:
    """The whole model in this process, one thread as each volunteer: its greedy decode tok/s, and its answer."""
    chain = LocalChain(first_part, None, n_ctx=1024, n_threads=1)
    try:
        prompt = chain.head.tokenize(chain.head.apply_chat([{"role": "user", "content": PROMPT}]), add_special=False)
        answer = [t for t in chain.generate(prompt, tokens) if not chain.head.is_eog(t)]
        return decode_rate(chain, prompt, tokens), answer
    finally:
        chain.close()


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "bench-hub",
                    help="where the model is written, or found from an earlier run (default: %(default)s)")
    ap.add_argument("--memory", default="800M", help="each volunteer's --memory (default: %(default)s)")
    args = ap.parse_args()
    # a smoke run's few-MB model is written afresh where no other run writes
    parts = model_files(Path(tempfile.mkdtemp(prefix="bench-hub-smoke-")) if args.smoke else args.dir / "model",
                        args.smoke)
    memory = "24M" if args.smoke else args.memory
    tokens = 4 if args.smoke else 16
    total = sum(p.stat().st_size for p in parts)
    figures: dict[str, Any] = {"model_bytes": total}
    with FakeHub() as hub:
        hub.publish(REPO, {p.name: p for p in parts})
        figures["load_before"] = os.getloadavg()[0]
        figures["raw_MBps_1"], figures["raw_MBps_4"] = raw_rates(hub.endpoint)
        env = {"HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}
        old = {k: os.environ.get(k) for k in (*env, "HF_TOKEN")}
        os.environ.update(env)
        nodes: list[Served] = []
        state = Path(tempfile.mkdtemp(prefix="bench-hub-"))
        started = time.monotonic()
        try:
            for i in range(3):
                os.environ["HF_TOKEN"] = f"volunteer{i}"
                seed = ["--seed", nodes[0].address] if nodes else []
                nodes.append(start_join(*seed, "--state-dir", str(state / f"v{i}"), "--model", f"hf:{REPO}",
                                        "--memory", memory, *SESSIONS, timeout=120))
                if i == 0:
                    # the first holder's whole read comes first: the others take its manifest
                    deadline = time.monotonic() + 600
                    first = nodes[0].log
                    while first and not HASHED.search(first.read_text()) and time.monotonic() < deadline:
                        time.sleep(0.5)
            at, answer = trio.run(covered_and_asked, nodes[0], nodes, 900.0, tokens)
            figures["load_covered"] = os.getloadavg()[0]
            figures["join_to_covered_s"] = at - started
            assert answer.first_token_at is not None
            figures["join_to_first_token_s"] = at - started + answer.first_token_at - answer.started
            figures["mesh_decode_tps"] = answer.decode_rate
            # the logs go with the daemons
            logs = [node.log.read_text() if node.log else "" for node in nodes]
        finally:
            stop_all(nodes)
            # the volunteers' sparse files: the model's size in all
            shutil.rmtree(state, ignore_errors=True)
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        # the whole model in this process, once the volunteers are gone (their cores are free again)
        try:
            figures["whole_decode_tps"], whole_answer = whole_decode(parts[0], tokens)
        finally:
            if args.smoke:
                shutil.rmtree(parts[0].parent, ignore_errors=True)
        figures["answers_equal"] = whole_answer == answer.tokens
        rows = []
        # (start, end) of every range fetch, in the logs' clock: the three volunteers fetch at once
        spans: list[tuple[float, float, int]] = []
        hashed = HASHED.search(logs[0])
        if hashed:
            figures["first_holder_whole_read_MBps"] = int(hashed[1]) / float(hashed[2]) / 1e6
        for i, log in enumerate(logs):
            fetches = [(int(m[2]), int(m[3]), int(m[4]), float(m[6])) for m in FETCHED.finditer(log)]
            for m in FETCHED.finditer(log):
                end = datetime.datetime.fromisoformat(m[1].replace("Z", "+00:00")).timestamp()
                spans.append((end - float(m[6]), end, int(m[4])))
            got = sum(f[2] for f in fetches)
            seconds = sum(f[3] for f in fetches)
            read = hub.bytes_read(f"volunteer{i}")
            rate = got / seconds / 1e6 if seconds else float("nan")
            figures[f"v{i}"] = {"ranges": [f[:2] for f in fetches], "fetched_bytes": got, "fetch_s": seconds,
                                "fetch_MBps": rate, "hub_bytes_read": read}
            rows.append(f"  volunteer {i}: layers {', '.join(f'[{a}, {b})' for a, b, *_ in fetches)}: {got / 1e6:.0f} MB "
                        f"fetched in {seconds:.1f} s = {rate:.0f} MB/s ({rate / figures['raw_MBps_4']:.2f} of raw x4, "
                        f"{rate / figures['raw_MBps_1']:.2f} of raw x1); {read / 1e6:.0f} MB read from the hub")
    if spans:
        window = max(e for _, e, _ in spans) - min(s for s, _, _ in spans)
        figures["all_fetch_MBps"] = sum(n for _, _, n in spans) / window / 1e6
        rows.append(f"  all three together: {sum(n for _, _, n in spans) / 1e6:.0f} MB in {window:.1f} s = "
                    f"{figures['all_fetch_MBps']:.0f} MB/s ({figures['all_fetch_MBps'] / figures['raw_MBps_4']:.2f} "
                    "of raw x4)")
    table = "\n".join([
        f"hub fetch, {total / 1e9:.2f} GB 3-part Q4_K_M set, 3 volunteers at --memory {memory}, on "
        f"{os.cpu_count()} CPUs, load {figures['load_before']:.1f} before, {figures['load_covered']:.1f} once covered",
        f"  server raw rate: {figures['raw_MBps_1']:.0f} MB/s on one connection, {figures['raw_MBps_4']:.0f} MB/s on four",
        f"  first holder's whole read (hashing each part against its sha256): "
        f"{figures.get('first_holder_whole_read_MBps', float('nan')):.0f} MB/s",
        *rows,
        f"  first join to every volunteer serving and the model covered: {figures['join_to_covered_s']:.0f} s; "
        f"to the first token of an answer: {figures['join_to_first_token_s']:.0f} s",
        f"  decode: the mesh {figures['mesh_decode_tps']:.2f} tok/s, the whole model in one process "
        f"{figures['whole_decode_tps']:.2f} tok/s ({figures['mesh_decode_tps'] / figures['whole_decode_tps']:.2f}x), "
        f"one thread each; answers equal: {figures['answers_equal']}"])
    publish("bench_hub", args, figures, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
