"""The line `meshd ask` says after the answer: tokens, speed, drafts, failovers and what went unchecked."""

from __future__ import annotations

import sys

from meshd.cli.text import plural
from meshd.client.ask import AskResult


def print_figures(result: AskResult) -> None:
    print(figures_line(result), file=sys.stderr, flush=True)


def figures_line(result: AskResult) -> str:
    """What `meshd ask` says after the answer: tokens, speed, drafts, what failing over cost, and
    the ranges spot checks could not check to the end."""
    prompt = plural(len(result.prompt_tokens), "prompt token")
    ttft = result.ttft
    rate = result.acceptance
    drafts = "" if rate is None else f", {result.accepted}/{result.drafted} drafts accepted ({rate:.0%})"
    failover = "" if not result.failovers else \
        f", failed over {plural(result.failovers, 'time')} ({plural(len(result.excluded), 'stage')} " \
        f"routed around, {result.failover_seconds:.1f} s lost)"
    # output verification: what no replica checked (a lie there would go unseen); the ranges no
    # other member serves are said once, together (a mesh of single servers has every range so)
    alone = [n.layers for n in result.unverified if n.alone]
    if result.checked is False or (result.checked is None and result.route):
        failover += ", unverified (no spot checks)"
    if alone:
        failover += f", unchecked (no replica): layers {', '.join(alone)}"
    failover += "".join(f", {note}" for note in result.unverified if not note.alone)
    if result.crossed_numerics_at:
        # another build or backend gives other last bits: the same answer is not promised across them
        failover += (f", continued on other numerics after {plural(result.crossed_numerics_at[0], 'token')} "
                     f"(one engine build and backend throughout may answer otherwise)")
    # the stage's own words where its session budget ended the answer
    stopped = f"a stage's session budget ({result.budget})" if result.reason == "budget" else result.reason
    if ttft is None:
        return f"[{prompt}, no new tokens{failover}, stopped by {stopped}]"
    return (f"[{prompt}, {plural(len(result.tokens), 'new token')}, first token {ttft * 1000:.0f} ms, "
            f"{result.decode_rate:.1f} tokens/s{drafts}{failover}, stopped by {stopped or 'error'}]")
