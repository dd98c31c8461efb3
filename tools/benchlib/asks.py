"""What a benchmark asks of meshd and of a local chain: the texts, the decode, prefill, time-to-first-token
and many-session figures of a route, a stage's own metrics, and a chain's rates in one process."""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path
from typing import Any

import trio

from benchlib.procs import BenchError, Proc, cpu_ns
from meshd.client.ask import AskRequest, AskResult
from meshd.client.route import Stage, route_at
from meshd.client.session import run_session
from meshd.engine import Sampler
from meshd.engine.chain import LocalChain
from meshd.net.peers import Peers
from wire.stage import STAGE_PROTOCOL, Metrics, MetricsRequest

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
# about the tokens of each of AGG_TEXTS: llama.cpp's prompt for the same load (llama-batched-bench -npp)
AGG_PROMPT = 12
# varied prose for the prefill prompt; cut to exactly --prefill tokens
PREFILL_TEXT = " ".join(
    f"Section {i}. The committee met on day {i * 7 % 31 + 1} to review the {w} report, noting that "
    f"{i * 13 % 97} of the {i * 29 % 211 + 100} items were complete and that the remaining work on the "
    f"{w} would continue through the following season."
    for i, w in enumerate(["harbour", "railway", "library", "orchard", "bridge", "market", "school",
                           "hospital", "canal", "museum", "garden", "factory"] * 4)
)


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


def decode_rate(chain: LocalChain, prompt: list[int], steps: int, gap: float | None = None) -> float:
    """Greedy decode tok/s of the chain. With ``gap``, each range's call is followed by that many seconds
    asleep: the split's compute as it runs when each stage waits a link's delay for its input (caches and
    cores gone cold), with delays that cost no software (tools/bench_network.py's idle-gap floor)."""
    for c in chain.contexts:
        c.clear()
    sampler = Sampler(chain.head)
    logits = chain.forward(prompt, 0)
    pos = len(prompt)
    t0 = time.perf_counter()
    for _ in range(steps):
        token = sampler.sample(logits[-1])
        logits = chain.forward([token], pos, after_stage=None if gap is None else functools.partial(time.sleep, gap))
        pos += 1
    dt = time.perf_counter() - t0
    sampler.close()
    return steps / dt


def prefill_rate(chain: LocalChain, prompt: list[int]) -> float:
    for c in chain.contexts:
        c.clear()
    t0 = time.perf_counter()
    chain.forward(prompt, 0)
    return len(prompt) / (time.perf_counter() - t0)
