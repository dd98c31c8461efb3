#!/usr/bin/env python3
"""The prefix cache: time to first token cold vs cached, and an agent transcript's prefill with and without.

Three `meshd serve` stages of the default model (one thread each) on loopback, asked in process
(meshd.client.session.run_session), greedy:

* TTFT: a ~2,000-token system prompt and a ~20-token question, each question new. Cold: the ask
  takes no cached prefix (AskRequest.cache off), so every stage runs the whole prompt. Cached: the
  stages hold the system prompt from an earlier ask, so they run only the question. Rounds alternate
  cold and cached; the goal is cached <= 0.15 x cold.
* Agent transcript: 8 turns, each the whole conversation so far (system prompt, every question and
  answer) and a new question, as an agent loop sends them. Its prefill time is the sum of the turns'
  times to first token, once with the cache off and once on (its own system prompt, so its first
  turn is cold too). Both runs must give the same answers, turn by turn.

Usage: .venv/bin/python tools/bench_prefix_cache.py [--rounds 3] [--turns 8] [--json OUT]
"""

from __future__ import annotations

import random
import statistics
import sys

import trio
from benchlib.result import parser, publish
from localmesh import Served, start_serve, stop_all

from meshd.client.ask import AskRequest, AskResult
from meshd.client.route import Stage, route_at
from meshd.client.session import run_session
from meshd.net.peers import Peers, open_peers
from wire.identity import NodeIdentity

WORDS = ("the river mesh stage model token cache layer prompt answer agent tool north quiet garden copper "
         "seven window harbor lantern signal paper winter orbit").split()
RANGES = ["0:10", "10:20", "20:30"]
# a 2,000-token prefill on a busy machine: the first token may take a while
STALL = 300.0


def document(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return "Answer from this document.\n" + " ".join(rng.choice(WORDS) for _ in range(words))


def question(i: int) -> str:
    return f"Question {i}: which word of the document comes up most often near the word river? Say it briefly."


async def timed(peers: Peers, route: list[Stage], messages: list[dict[str, str]], cache: bool,
                max_tokens: int) -> AskResult:
    request = AskRequest(messages=messages, max_tokens=max_tokens, cache=cache)
    return await run_session(peers, route, request, AskResult(), stall_timeout=STALL)


async def ttft_rounds(peers: Peers, route: list[Stage], system: str, rounds: int) -> dict[str, object]:
    # the stages keep the system prompt from this ask on (the cold asks below keep nothing)
    primed = await timed(peers, route, [{"role": "system", "content": system},
                                        {"role": "user", "content": question(0)}], True, 1)
    cold, cached, hit = [], [], []
    for r in range(rounds):
        for cache, out in ((False, cold), (True, cached)):
            result = await timed(peers, route, [{"role": "system", "content": system},
                                                {"role": "user", "content": question(1 + 2 * r + cache)}], cache, 1)
            assert result.ttft is not None
            out.append(result.ttft * 1000)
            if cache:
                hit.append(result.cached_tokens)
    return {"prompt_tokens": len(primed.prompt_tokens), "cold_ms": cold, "cached_ms": cached, "cached_tokens": hit,
            "median": {"cold_ms": statistics.median(cold), "cached_ms": statistics.median(cached)},
            "ratio": statistics.median(cached) / statistics.median(cold)}


async def transcript(peers: Peers, route: list[Stage], system: str, turns: int, cache: bool,
                     answer_tokens: int) -> tuple[list[float], list[int], list[list[int]]]:
    """An agent's turns: each sends the whole conversation so far and a new question."""
    messages = [{"role": "system", "content": system}]
    ttfts, hits, answers = [], [], []
    for turn in range(turns):
        messages.append({"role": "user", "content": question(100 + turn)})
        result = await timed(peers, route, messages, cache, answer_tokens)
        assert result.ttft is not None
        ttfts.append(result.ttft * 1000)
        hits.append(result.cached_tokens)
        answers.append(result.tokens)
        messages.append({"role": "assistant", "content": result.text})
    return ttfts, hits, answers


async def run(route: list[Stage], words: int, rounds: int, turns: int, answer_tokens: int) -> dict[str, object]:
    async with open_peers(NodeIdentity.generate()) as peers:
        ttft = await ttft_rounds(peers, route, document(words, seed=1), rounds)
        agent_system = document(words // 2, seed=2)
        off = await transcript(peers, route, agent_system, turns, False, answer_tokens)
        on = await transcript(peers, route, agent_system, turns, True, answer_tokens)
    return {"ttft": ttft, "agent": {
        "turns": turns, "answer_tokens": answer_tokens,
        "off_ttft_ms": off[0], "on_ttft_ms": on[0], "on_cached_tokens": on[1],
        "off_prefill_ms": sum(off[0]), "on_prefill_ms": sum(on[0]), "ratio": sum(on[0]) / sum(off[0]),
        "same_answers": off[2] == on[2]}}


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3, help="cold and cached asks to time, each (default 3)")
    ap.add_argument("--turns", type=int, default=8, help="turns of the agent transcript (default 8)")
    ap.add_argument("--words", type=int, default=1980, help="words of the system prompt (default 1980: ~2,000 "
                    "tokens; the transcript's is half)")
    ap.add_argument("--answer-tokens", type=int, default=32, help="tokens of each transcript answer (default 32)")
    args = ap.parse_args()
    if args.smoke:  # the smallest run through every part
        args.rounds, args.turns, args.words, args.answer_tokens = 1, 2, 200, 4
    stages: list[Served] = []
    try:
        for r in RANGES:
            stages.append(start_serve("--layers", r, "--threads", "1", "--max-sessions", "3",
                                      "--session-tokens", "2560", "--cache-tokens", "8192"))
        figures = trio.run(run, route_at([s.address for s in stages]), args.words, args.rounds, args.turns,
                           args.answer_tokens)
    finally:
        stop_all(stages)
    t, a = figures["ttft"], figures["agent"]
    assert isinstance(t, dict) and isinstance(a, dict)
    table = (f"3 stages, a {t['prompt_tokens']}-token prompt (system prompt + a ~20-token question), greedy:\n"
             f"  time to first token, cold   (median of {args.rounds}): {t['median']['cold_ms']:.0f} ms "
             f"{[round(x) for x in t['cold_ms']]}\n"
             f"  time to first token, cached (median of {args.rounds}): {t['median']['cached_ms']:.0f} ms "
             f"{[round(x) for x in t['cached_ms']]} ({t['cached_tokens']} tokens from the cache)\n"
             f"  cached / cold: {t['ratio']:.3f} (goal <= 0.15)\n"
             f"agent transcript, {a['turns']} turns of {a['answer_tokens']}-token answers, prefill (sum of TTFTs):\n"
             f"  cache off: {a['off_prefill_ms']:.0f} ms {[round(x) for x in a['off_ttft_ms']]}\n"
             f"  cache on:  {a['on_prefill_ms']:.0f} ms {[round(x) for x in a['on_ttft_ms']]} "
             f"(cached tokens a turn {a['on_cached_tokens']})\n"
             f"  on / off: {a['ratio']:.3f}; the same answers with and without: {a['same_answers']}")
    publish("prefix_cache", args, figures, table)
    return 0 if a["same_answers"] else 1


if __name__ == "__main__":
    sys.exit(main())
