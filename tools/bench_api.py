#!/usr/bin/env python3
"""The HTTP API against `meshd ask` on the same mesh: decode tok/s and time to first token, and 8 streams at once.

One mesh of four `meshd join` daemons on loopback: a member without a model serving
`--api`, and three volunteers that split the default model. Rounds alternate, so
load on the machine falls on every contestant alike:

* `meshd ask --seed` (a fresh process each time; its own figures: first token from
  the start of its session, and decode tokens/s), and
* a streamed request through each dialect (OpenAI chat completions, Anthropic
  messages) with the official clients, timed at the client: first token from the
  request, decode tokens/s from the first content event to the last.

`meshd ask` dials every stage anew (Noise handshakes included in its first token), as a
user's command does; the front door keeps its links from one request to the next, so
its first token pays HTTP and the prompt, not the links. Ratios are API ÷ `meshd ask`
for tokens/s and `meshd ask` ÷ API for the first token (both ≥ 1 when the API is the
faster; the goal is ≥ 0.97). Then 8 concurrent API streams: their tokens in all over
the wall time, against one stream alone.

Usage: .venv/bin/python tools/bench_api.py [--rounds 5] [--tokens 64] [--json bench-out/api.json]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import httpx2
import openai
import trio
from benchlib.result import parser, publish
from localmesh import Served, run_meshd, start_join, stop_all

VOLUNTEER = ["--memory", "64M", "--threads", "1", "--max-sessions", "8", "--session-tokens", "256"]
PROMPT = "Write a long story about a lighthouse keeper and a storm."
FIGURES = re.compile(r"(\d+) new tokens?, first token (\d+) ms, ([\d.]+) tokens/s")


class Timing:
    """One streamed answer as its client saw it."""

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.events = 0
        self.tokens = 0

    def content(self) -> None:
        now = time.perf_counter()
        self.first = self.first or now
        self.last = now
        self.events += 1

    def figures(self) -> dict[str, float]:
        assert self.first is not None and self.last is not None and self.tokens > 1, "no tokens came"
        # tokens after the first over the time after the first, as `meshd ask` counts its rate
        return {"ttft_ms": (self.first - self.sent) * 1000, "tok_s": (self.tokens - 1) / (self.last - self.first),
                "tokens": self.tokens}


async def openai_stream(url: str, tokens: int, prompt: str = PROMPT) -> Timing:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    timing = Timing()
    chunks = await client.chat.completions.create(
        model="", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=tokens, stream=True,
        stream_options={"include_usage": True})
    async for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            timing.content()
        if chunk.usage is not None:
            timing.tokens = chunk.usage.completion_tokens
    return timing


async def anthropic_stream(url: str, tokens: int, prompt: str = PROMPT) -> Timing:
    client = anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0, timeout=300)
    timing = Timing()
    async with client.messages.stream(model="", messages=[{"role": "user", "content": prompt}], max_tokens=tokens,
                                      extra_body={"temperature": 0.0}) as events:
        async for _ in events.text_stream:
            timing.content()
        timing.tokens = (await events.get_final_message()).usage.output_tokens
    return timing


async def meshd_ask(seed: str, tokens: int) -> dict[str, float]:
    done = await trio.to_thread.run_sync(lambda: run_meshd("ask", "--seed", seed, "--max-tokens", str(tokens), PROMPT))
    m = FIGURES.search(done.stderr)
    if done.returncode != 0 or m is None:
        raise SystemExit(f"bench_api: meshd ask failed (rc {done.returncode}): {done.stderr.strip()}")
    return {"ttft_ms": float(m.group(2)), "tok_s": float(m.group(3)), "tokens": int(m.group(1))}


def wait_covered(url: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    with httpx2.Client(base_url=url) as client:
        while time.monotonic() < deadline:
            models = client.get("/v1/models").json()["data"]
            if models and models[0]["coverage"]["covered"]:
                return
            time.sleep(0.5)
    raise SystemExit("bench_api: the mesh did not cover the model in time")


def medians(samples: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in samples) for k in ("ttft_ms", "tok_s")}


async def bench(seed: Served, url: str, args: argparse.Namespace) -> dict[str, Any]:
    contestants: dict[str, Callable[[], Awaitable[dict[str, float]]]] = {
        "meshd ask": lambda: meshd_ask(seed.address, args.tokens),
        "openai": lambda: figures(openai_stream(url, args.tokens)),
        "anthropic": lambda: figures(anthropic_stream(url, args.tokens)),
    }
    # warm every path once (links, the workers' caches); a smoke run's figures are no measurement, and its one
    # round goes through every path as the warm-up would
    for run in () if args.smoke else contestants.values():
        await run()
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in contestants}
    for _ in range(args.rounds):
        for name, run in contestants.items():
            samples[name].append(await run())
    summary = {name: medians(s) for name, s in samples.items()}
    base = summary["meshd ask"]
    ratios = {name: {"tok_s": summary[name]["tok_s"] / base["tok_s"], "ttft": base["ttft_ms"] / summary[name]["ttft_ms"]}
              for name in ("openai", "anthropic")}

    prompts = [f"{PROMPT} Chapter {i + 1}." for i in range(args.concurrent)]
    solo = (await openai_stream(url, args.tokens, prompts[0])).figures()
    together: list[Timing] = []

    async def one(prompt: str) -> None:
        together.append(await openai_stream(url, args.tokens, prompt))

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(one, prompt)
    wall = time.perf_counter() - t0
    total = sum(t.tokens for t in together)
    concurrent = {"streams": args.concurrent, "tokens": total, "wall_s": wall, "aggregate_tok_s": total / wall,
                  "solo_tok_s": solo["tok_s"], "speedup": total / wall / solo["tok_s"]}
    return {"rounds": args.rounds, "tokens": args.tokens, "samples": samples, "medians": summary, "ratios": ratios,
            "concurrent": concurrent}


async def figures(timing: Awaitable[Timing]) -> dict[str, float]:
    return (await timing).figures()


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['rounds']} rounds of {result['tokens']} new tokens, medians (greedy, 3 stages on loopback)",
             f"{'path':<12}{'first token':>14}{'decode':>14}{'tok/s ratio':>14}{'TTFT ratio':>13}"]
    for name, m in result["medians"].items():
        r = result["ratios"].get(name)
        lines.append(f"{name:<12}{m['ttft_ms']:>11.0f} ms{m['tok_s']:>8.1f} tok/s"
                     + (f"{r['tok_s']:>13.2f}x{r['ttft']:>12.2f}x" if r else f"{'(baseline)':>14}"))
    c = result["concurrent"]
    lines.append(f"{c['streams']} concurrent OpenAI streams: {c['tokens']} tokens in {c['wall_s']:.1f} s, "
                 f"aggregate {c['aggregate_tok_s']:.1f} tok/s ({c['speedup']:.2f}x one stream's "
                 f"{c['solo_tok_s']:.1f} tok/s)")
    return "\n".join(lines)


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each contestant; medians are reported")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per answer (default 64)")
    ap.add_argument("--concurrent", type=int, default=8, help="API streams at once (default 8)")
    args = ap.parse_args()
    if args.smoke:  # the smallest run through every part: one round of two streams of a few tokens
        args.rounds, args.tokens, args.concurrent = 1, 4, 2
    nodes: list[Served] = []
    with tempfile.TemporaryDirectory(prefix="meshd-bench-api-") as state:
        try:
            nodes.append(start_join("--no-model", "--state-dir", f"{state}/seed", "--api", "0"))
            url = next(line.split()[4] for line in nodes[0].lines if line.startswith("meshd: HTTP API on "))
            for i in range(3):
                nodes.append(start_join("--seed", nodes[0].address, "--state-dir", f"{state}/v{i}", *VOLUNTEER))
            wait_covered(url)
            result = trio.run(bench, nodes[0], url, args)
        finally:
            stop_all(reversed(nodes))
    publish("api", args, result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
