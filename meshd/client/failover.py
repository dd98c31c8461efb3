"""An answer that survives its stages: when an epoch fails, the stages found dead, stalled or lying
are routed around and the session opens again at a higher epoch, within a failover budget.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import replace

import trio

from meshd.client.ask import (
    STALL_TIMEOUT,
    AskRequest,
    AskResult,
    CacheDoubted,
    OnToken,
    StageError,
    give,
    hand_over,
    over_budget,
    withdraw_past_end,
)
from meshd.client.route import RouteFinder, Stage
from meshd.client.session import Verifier, run_session
from meshd.net import rpc
from meshd.net.fastpunch import RELAYED_HOP
from meshd.net.peers import Peers
from relay.protocol import CIRCUIT_MARK
from wire.errors import ErrorCode, ProtocolError
from wire.stage import (
    STAGE_PROTOCOL,
    Metrics,
    MetricsRequest,
    new_session_id,
)

log = logging.getLogger(__name__)


# The failover budget of one answer: at most this many epochs (routes tried), and no new one begun
# later than this many seconds past the stall timeout after the answer last made progress (a stall
# itself costs the stall timeout before it is noticed). Several stages dying at once cost one epoch
# when the probes find them all; each later failure found costs one more.
FAILOVER_ATTEMPTS = 8
FAILOVER_SECONDS = 60.0
# How long a probe of one stage may take: a partitioned stage costs this once (all are probed at once).
PROBE_TIMEOUT = 1.5


async def ask_with_failover(peers: Peers, find_route: RouteFinder, request: AskRequest,
                            on_token: OnToken | None = None, attempts: int = FAILOVER_ATTEMPTS,
                            stall_timeout: float = STALL_TIMEOUT, result: AskResult | None = None,
                            budget_seconds: float = FAILOVER_SECONDS,
                            verifier: Verifier | None = None) -> AskResult:
    """Runs a session; when stages fail it, routes around every one found dead or lying and
    re-prefills at a new epoch, within the failover budget.

    Greedy answers come out as if nothing had failed: the new route gets the
    prompt and every token generated so far, and continues from there. A caller
    that passes `result` sees it fill as the session runs (the prompt's tokens, each new one).
    """
    result = AskResult() if result is None else result
    session = new_session_id()
    # when the answer last made progress, and (while recovering from a failure) since when it stalls
    last_progress = trio.current_time()
    stalled_since: float | None = None
    deadline: float | None = None
    # the live stages of the last route that stalled: a stage that stalls but answers probes is among them
    suspects: set[str] = set()
    # stages that said they were busy for a moment: how often each was waited for (up to BUSY_TRIES) before
    # being routed around
    waited: collections.Counter[str] = collections.Counter()

    def progressed() -> None:
        nonlocal last_progress, stalled_since
        last_progress = trio.current_time()
        if stalled_since is not None:
            result.failover_seconds += last_progress - stalled_since
            stalled_since = None

    async def on_progress(token: int, piece: bytes) -> None:
        progressed()
        if on_token is not None:
            await give(result, on_token, token, piece)

    for epoch in range(attempts):
        if result.tokens and len(result.tokens) >= request.max_tokens:
            # every token asked for came before the route failed, only the tail's Done did not: a new
            # route would generate one more (a session asks at least one)
            result.reason, result.finished_at = "max_tokens", time.perf_counter()
            progressed()
            await hand_over(result, on_progress, len(result.tokens))
            await withdraw_past_end(result, on_token)
            return result
        route = await find_route(list(result.excluded))
        log.debug("epoch %d of session %s: route %s", epoch, session[:12], route_text(route, None))
        carried, before = len(result.tokens), result.numerics
        try:
            await run_session(peers, route, request, result, on_progress, session, epoch, stall_timeout,
                              verifier)
        except CacheDoubted as exc:
            if not request.cache:
                raise
            log.info("epoch %d: %s; the answer starts again without the prefix cache", epoch, exc.message)
            request = replace(request, cache=False)
            result.failovers += 1
            result.restart()
        except (StageError, trio.TooSlowError) as exc:
            _crossed(result, before, carried)
            if isinstance(exc, StageError) and exc.code is ErrorCode.BAD_REQUEST and exc.message.startswith(RELAYED_HOP):
                # a hop of this route goes through a relay's circuit (no punched link, or no connection
                # punched over it): the daemons' path carries its rows, and nobody failed
                log.info("epoch %d: %s; asking on the daemons' path", epoch, exc.message)
                request = replace(request, fast=False)
                continue
            if isinstance(exc, StageError) and exc.culprit is None and over_budget(exc):
                # A stage's session budget is its own (--session-tokens): no route is roomier for being
                # another, and failing over found "no route" half a minute later. An answer that reached
                # it ends there, saying so; a prompt over it is refused at once.
                if not result.tokens:
                    raise
                result.reason, result.finished_at = "budget", time.perf_counter()
                result.budget = exc.message
                progressed()
                await hand_over(result, on_progress, len(result.tokens))
                await withdraw_past_end(result, on_token)
                return result
            if stalled_since is None:
                stalled_since = last_progress
            if deadline is None:
                deadline = last_progress + stall_timeout + budget_seconds
            busy = busy_for(exc, route)
            if busy is not None and waited[busy[0]] < BUSY_TRIES and epoch < attempts - 1 \
                    and trio.current_time() < deadline:
                # All its slots were taken for a moment (another asker's session, the tracker's probe of a
                # stage it just placed): wait as it says, doubling, a few times, rather than route around it
                # for good (with one slot a stage, that left "no route" where the stage was free a second later).
                wait = busy[1] * 2 ** waited[busy[0]]
                waited[busy[0]] += 1
                log.info("epoch %d: stage %s is busy (%s); asking again in %.1f s", epoch, busy[0][:12], exc, wait)
                await trio.sleep(wait)
                continue
            # a proven liar is routed around whatever its error says; any other error, if it may pass
            if isinstance(exc, StageError) and exc.culprit is None and not exc.retryable:
                raise
            if epoch == attempts - 1 or trio.current_time() > deadline:
                log.warning("giving up after %d failover(s) in %.1f s: %s", result.failovers,
                            trio.current_time() - stalled_since, exc)
                raise
            culprits = [c for c in await _culprits(peers, route, exc, suspects) if c not in result.excluded]
            retry = False
            if isinstance(exc, trio.TooSlowError) or exc.code is ErrorCode.DEADLINE_EXCEEDED:
                # Nobody is dead, so who stalled is unknown: the reporter is blamed first, and the
                # stages this route shares with the next one that stalls are blamed then.
                retry = not suspects
                suspects = {s.node_id for s in route if s.node_id is not None} - set(culprits) - set(result.excluded)
            if not culprits and not (retry and suspects):
                if request.fast and any(CIRCUIT_MARK in s.address for s in route):
                    # nobody failed, but a hop to a stage behind a NAT did not open on the fast path (its
                    # punched connection did not): the daemons' path carries the rows over the links that did
                    log.info("epoch %d failed (%s); asking on the daemons' path", epoch, exc)
                    request = replace(request, fast=False)
                    continue
                raise
            # the route with the failure: a stall's reporter is often not who stalled (the stages' logs say which)
            log.info("epoch %d failed on route %s (%s); routing around %s", epoch, route_text(route), exc,
                     ", ".join(c[:12] for c in culprits))
            result.excluded.extend(culprits)
            result.failovers += 1
            if isinstance(exc, StageError) and exc.untrusted_from is not None:
                # A check proved a lie: generate the answer again from the prompt, not from the lie (a
                # prompt re-prefilled with tokens is not bit for bit the rows their decode steps made,
                # and a near tie can then pick another token).
                result.restart()
        else:
            _crossed(result, before, carried)
            progressed()
            if result.failovers:
                # the front door's log says what `meshd ask`'s figures line does
                log.info("answered after %d failover(s) around %d stage(s), %.1f s lost", result.failovers,
                         len(result.excluded), result.failover_seconds)
            await withdraw_past_end(result, on_token)
            return result
    raise AssertionError("unreachable")


def route_text(route: Sequence[Stage], id_chars: int | None = 12) -> str:
    """A route as its logs name it: each stage's node id (or address) and its layers."""
    return " ".join(f"{(s.node_id or s.address)[:id_chars]}{list(s.layers or ())}" for s in route)


def _crossed(result: AskResult, before: frozenset[str], carried: int) -> None:
    """Notes where an epoch that took over ``carried`` tokens ran on other numerics than the one before."""
    if carried and before and result.numerics and result.numerics != before and \
            carried not in result.crossed_numerics_at:
        result.crossed_numerics_at.append(carried)


def busy_for(exc: BaseException, route: Sequence[Stage]) -> tuple[str, float] | None:
    """The node and how long (s, at most BUSY_WAIT) to leave it alone, where a stage of ``route`` refused
    the session as busy for a moment (OVERLOADED with a retry hint) or gave its slot to another
    (CACHE_MISS: evicted, or its rows no longer held); else None."""
    if not isinstance(exc, StageError) or exc.culprit is not None:
        return None
    if exc.code is ErrorCode.OVERLOADED and exc.retry_after_ms is not None:
        wait = min(BUSY_WAIT, exc.retry_after_ms / 1000)
    elif exc.code is ErrorCode.CACHE_MISS:
        # the stage is alive and serving: with no replica of its range, routing around it left no
        # route (the soak: an API ask evicted by a newcomer because its own spot check held a second slot)
        wait = EVICTED_WAIT
    else:
        return None
    if not 0 <= exc.index < len(route) or route[exc.index].node_id is None:
        return None
    node = route[exc.index].node_id
    assert node is not None
    return node, wait


# The longest an asker waits on a busy stage's word before it asks again (a peer's number, bounded here),
# and how many times it waits on one stage before it routes around it.
BUSY_WAIT = 2.0
BUSY_TRIES = 3
# How long an asker whose session a stage evicted waits before it opens one there again.
EVICTED_WAIT = 0.5


async def _culprits(peers: Peers, route: Sequence[Stage], exc: BaseException,
                    suspects: Collection[str] = ()) -> list[str]:
    """The node ids to route around after `exc` failed `route`: the proven culprit if the error names
    one; else as `blamed` says, from a probe of every stage."""
    if isinstance(exc, StageError) and exc.culprit is not None:
        return [exc.culprit] + ([exc.also] if exc.also is not None else [])
    alive = await _probe(peers, route)
    return blamed(route, alive, exc.index if isinstance(exc, StageError) else None, suspects)


def blamed(route: Sequence[Stage], alive: Sequence[bool], reporter: int | None,
           suspects: Collection[str] = ()) -> list[str]:
    """Every stage found dead. None dead: the stages the route shares with the last one that stalled
    (`suspects`), else the reporter (None where no stage reported: a stall at opening). Stages the
    route names without a node id cannot be excluded (a route given by addresses)."""
    dead = [s.node_id for s, up in zip(route, alive, strict=True) if not up and s.node_id is not None]
    if dead:
        return dead
    shared = [s.node_id for s in route if s.node_id is not None and s.node_id in suspects]
    if shared:
        return shared
    reported = None if reporter is None else route[reporter].node_id
    return [] if reported is None else [reported]


async def _probe(peers: Peers, route: Sequence[Stage]) -> list[bool]:
    """Which stages of `route` are up: the handshake proves the node, its metrics that its engine is."""
    alive = [False] * len(route)

    async def probe(i: int) -> None:
        try:
            reply = await rpc.call(peers, route[i].address, STAGE_PROTOCOL, MetricsRequest(), Metrics,
                                   node_id=route[i].node_id, timeout=PROBE_TIMEOUT)
        except ProtocolError:
            return
        alive[i] = reply.values.get("worker_up") == 1.0

    async with trio.open_nursery() as nursery:
        for i in range(len(route)):
            nursery.start_soon(probe, i)
    return alive
