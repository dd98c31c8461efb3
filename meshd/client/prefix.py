"""The asker's side of the prefix cache: look the prompt's prefix up on every stage, start past it.

With ``Prompt.cache`` the head tokenizes the prompt, sends its ids back and runs
nothing yet. The asker hands the ids to the tail (its penalty history, as
always), sends every stage the prompt's prefix keys (``wire.stage.prefix_keys``),
and each stage copies the longest prefix it keeps of this asker's earlier
sessions into the session's sequence and says how many positions that is. The
rows begin at the least of those, and never past the prompt's last position
(the tail samples after it); the head hears where, runs the rest, and every
stage after it learns the start from its upstream's ``Hop``.

One round trip to all stages at once, before the first row: a 2,000-token
prefill costs seconds on a CPU stage, a round trip milliseconds.

Routes keep their stages (the tracker's hysteresis, ``meshd.mesh.routing.plan_route``'s
``keep``), so an agent's next turn finds its prefix where its last one left it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import trio

from meshd.net import rpc
from meshd.net.stream import Stream
from wire.stage import PREFIX_BLOCK, CacheFound, CacheLookup, CacheUse, Grammar, PromptTokens, prefix_keys


def cache_start(found: Sequence[int], prompt_len: int) -> int:
    """Where the rows begin: the least any stage found, before the prompt's last position."""
    return max(0, min([*found, prompt_len - 1]))


# runs a stage's part, its errors told as that stage's (``meshd.client.session._from_stage``)
FromStage = Callable[[int, Awaitable[None]], Awaitable[None]]


async def look_up(streams: Sequence[Stream], session: str, epoch: int, timeout: float,
                  from_stage: FromStage, grammar: Grammar | None = None, generated: int = 0) -> tuple[list[int], int]:
    """Runs the lookup on a route's control streams (head first); returns the prompt's ids and the
    position its rows begin at, which the head has been told. The tail's ids carry the session's
    ``grammar`` (and how many of them were generated before), as without the cache."""
    head, tail = streams[0], streams[-1]
    got: list[PromptTokens] = []

    async def prompt_ids() -> None:
        got.append(await rpc.receive(head, PromptTokens, "the head's tokens of the prompt", timeout))

    await from_stage(0, prompt_ids())
    ids = got[0]
    if len(streams) > 1:
        told = ids if grammar is None else PromptTokens(session=ids.session, epoch=ids.epoch, tokens=ids.tokens,
                                                        grammar=grammar, generated=generated)
        await from_stage(len(streams) - 1, tail.send_message(told))
    tokens = list(ids.tokens)
    # a key per whole block of the prompt, but never its last position: that row always runs
    keys = prefix_keys(tokens[:max(0, len(tokens) - 1)])
    found = [0] * len(streams)

    async def one(i: int, stream: Stream) -> None:
        await stream.send_message(CacheLookup(session=session, epoch=epoch, keys=keys))
        reply = await rpc.receive(stream, CacheFound, "a stage's cached prefix", timeout)
        found[i] = min(reply.tokens, len(keys) * PREFIX_BLOCK)

    if keys:
        async with trio.open_nursery() as nursery:
            for i, stream in enumerate(streams):
                nursery.start_soon(from_stage, i, one(i, stream))
    start = cache_start(found, len(tokens))
    await from_stage(0, head.send_message(CacheUse(session=session, epoch=epoch, tokens=start)))
    return tokens, start
