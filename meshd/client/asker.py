"""One asker for every front: `meshd ask` and the HTTP front door ask through it (``member_asker``).

It puts together what an ask needs beyond one session: routes from a member (and, once that member
cannot be reached, from the members its routes named) with failover, output verification (a
``Verifier`` whose replicas come from routes around each stage), the proofs of lies it caught and
the work the stages served handed to the member, and the operator's policy on answers that could
not be checked (``require_verified``): such an answer is generated again on a route around the
ranges no replica checked, and refused if no route is left whose every range was checked. What
differs between the fronts is only how they reach their member (``Member``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from meshd.client.ask import STALL_TIMEOUT, AskRequest, AskResult, OnToken, RouteError, deliver
from meshd.client.failover import ask_with_failover
from meshd.client.route import RouteFinder, RouteSources, Stage, route_from_reply
from meshd.client.served import Served
from meshd.client.traffic import traffic_report
from meshd.client.verifier import Verifier
from meshd.client.verify import DEFAULT_VERIFY, CheckPlan
from meshd.net import rpc
from meshd.net.peers import Peers
from wire.credit import Voucher
from wire.errors import ErrorCode, ProtocolError
from wire.meshrpc import MESH_PROTOCOL, RouteReply, RouteRequest, TrafficReport
from wire.receipt import Proof

log = logging.getLogger(__name__)

# Routes an ask that must be verified tries before it refuses the answer: each goes around the
# nodes whose ranges the last one left unchecked, so a mesh with replicas finds a checked route in
# one or two (a range with no replica anywhere never will).
VERIFIED_ATTEMPTS = 3


class Unverified(Exception):
    """An ask that must be verified found no route whose every range a replica checked."""

    def __init__(self, result: AskResult, why: str) -> None:
        super().__init__(why)
        self.result = result
        self.why = why


def unverified_reason(request: AskRequest, verify_every: int) -> str | None:
    """Why an ask of ``request`` cannot be verified at all, or None if it can be."""
    if verify_every <= 0:
        return "spot checks are off (--verify 0)"
    if request.speculate == "model":
        # the draft model drafts on the daemons' path, whose receipts sign one step at a time, and a drafted
        # batch is several (prompt lookup drafts on the fast path, whose receipts sign spans of final rows)
        return "an ask speculating with a draft model is not verified"
    return None


@dataclass
class Asker:
    """Asks with failover and verification; ``other_route`` finds replicas (a route avoiding the nodes
    it is given), ``report_proof`` hands a caught lie's proof to the mesh."""

    peers: Peers
    find_route: RouteFinder
    other_route: RouteFinder
    report_proof: Callable[[Proof], Awaitable[None]]
    verify_every: int = DEFAULT_VERIFY
    require_verified: bool = False
    stall_timeout: float = STALL_TIMEOUT
    # hands what each stage served to the member this ask is made for, which countersigns it (wire.credit)
    report_work: Callable[[list[Served]], Awaitable[None]] | None = None
    # hands what the ask saw of its route's speed to that member, for the tracker (meshd.client.traffic)
    report_traffic: Callable[[TrafficReport], Awaitable[None]] | None = None
    # the member's voucher for the asker's identity, on whose credit the stages rank the ask (None: a newcomer's)
    payer: Callable[[str], Awaitable[Voucher | None]] | None = None

    async def ask(self, request: AskRequest, on_token: OnToken | None = None,
                  result: AskResult | None = None) -> AskResult:
        """The answer, verified as the policy asks; with ``require_verified`` its tokens reach
        ``on_token`` only once the answer is checked (an unchecked one is never shown)."""
        result = AskResult() if result is None else result
        if self.payer is not None:
            request.payer = await self.payer(self.peers.identity.node_id)
        if request.count_only:
            # the head's count of the prompt: nothing is generated, so there is nothing to check
            return await ask_with_failover(self.peers, self.find_route, request, stall_timeout=self.stall_timeout,
                                           result=result)
        why_not = unverified_reason(request, self.verify_every)
        if why_not is not None and self.require_verified:
            raise Unverified(result, f"the answer must be verified, but {why_not}")
        verifier = None if why_not is not None else \
            Verifier(self.peers, CheckPlan(every=self.verify_every), find_route=self.other_route)
        # what the last answer left unchecked, for the refusal when no route around it is left
        unchecked = ""
        try:
            for attempt in range(VERIFIED_ATTEMPTS):
                try:
                    await ask_with_failover(self.peers, self.find_route, request,
                                            None if self.require_verified else on_token,
                                            stall_timeout=self.stall_timeout, result=result, verifier=verifier)
                except (ProtocolError, RouteError) as exc:
                    if not attempt:
                        raise
                    raise Unverified(result, f"no route is left around the ranges left unchecked ({unchecked}): "
                                             f"{getattr(exc, 'message', exc)}") from None
                if not self.require_verified or result.verified:
                    break
                unchecked = "; ".join(map(str, result.unverified))
                avoid = sorted({n.node_id for n in result.unverified} - set(result.excluded))
                if not avoid or attempt == VERIFIED_ATTEMPTS - 1:
                    raise Unverified(result, f"no route was found whose every range a replica checked: {unchecked}")
                log.info("generating the answer again around node(s) %s, as it left a range unchecked: %s",
                         ", ".join(a[:16] for a in avoid), unchecked)
                result.excluded.extend(avoid)
                result.restart()
        finally:
            for proof in [] if verifier is None else verifier.proofs:
                await self.report_proof(proof)
            if verifier is not None and self.report_work is not None:
                await self.report_work(verifier.work())
        if self.require_verified:
            for token, piece in zip(result.tokens, result.pieces, strict=True):
                await deliver(on_token, token, piece)
        if self.report_traffic is not None and (seen := traffic_report(result)) is not None:
            await self.report_traffic(seen)
        return result


class Member(Protocol):
    """The member an asker works through: it plans the routes, takes the proofs of the lies the asker
    caught, countersigns what the stages served and vouches for the asker's identity."""

    @property
    def remote(self) -> bool:
        """Reached over a link that may go down: then the members its routes named are asked for routes."""
        ...

    async def route(self, model: str | None, excluded: list[str]) -> RouteReply:
        """The tracker's plan for ``model`` around ``excluded``; NOT_FOUND where the mesh does not cover it."""
        ...

    async def take_proof(self, proof: Proof) -> None:
        """Hands on a proof that a stage lied; a ProtocolError where it is refused or cannot be."""
        ...

    async def countersign(self, served: list[Served]) -> None:
        """Countersigns what the stages served this ask; a ProtocolError where it cannot."""
        ...

    async def voucher(self, opener: str) -> Voucher | None:
        """The member's voucher for ``opener`` (the asker's identity), if it gives one."""
        ...

    async def report_traffic(self, report: TrafficReport) -> None:
        """Hands on what an ask saw of its route's speed, for the tracker (a figure lost is nobody's failure)."""
        ...


def member_routes(peers: Peers, member: Member, model: str | None, timeout: float) -> tuple[RouteFinder, RouteFinder]:
    """The route finder of an answer and the one its replicas come from, both through ``member``.

    The answer's finder survives a remote member that cannot be reached (``RouteSources``), and says
    that a route missing mid-failover is no gap in coverage: the stages that failed the answer were
    what was left of their ranges. The replicas' finder asks the member alone (a replica is optional)."""

    async def planned(excluded: list[str]) -> list[Stage]:
        # the tracker's plan, not the member's own records: a member's self-report cannot win the route
        return route_from_reply(await member.route(model, excluded))

    async def ask_member(stage: Stage, excluded: list[str]) -> list[Stage]:
        return route_from_reply(await rpc.call(peers, stage.address, MESH_PROTOCOL,
                                               RouteRequest(model=model, exclude=excluded), RouteReply,
                                               node_id=stage.node_id, timeout=timeout))

    source: RouteFinder = RouteSources(planned, ask_member) if member.remote else planned

    async def find_route(excluded: list[str]) -> list[Stage]:
        try:
            return await source(excluded)
        except ProtocolError as exc:
            if not excluded or exc.code is not ErrorCode.NOT_FOUND:
                raise
            raise ProtocolError(ErrorCode.UNREACHABLE, f"no route is left around the {len(excluded)} "
                                                       f"stage(s) that failed this answer: {exc.message}") from None

    return find_route, planned


def member_asker(peers: Peers, member: Member, model: str | None, *, verify_every: int = DEFAULT_VERIFY,
                 require_verified: bool = False, stall_timeout: float = STALL_TIMEOUT) -> Asker:
    """The asker of ``model`` through ``member``, on whose credit it asks and to whom it hands what it found."""
    find_route, other_route = member_routes(peers, member, model, stall_timeout)

    async def report_proof(proof: Proof) -> None:
        # the member checks the proof, keeps its culprit out of routes and placements and passes it on
        try:
            await member.take_proof(proof)
        except ProtocolError as exc:
            log.warning("a proof that node %s lied was not taken: %s", proof.culprit.node_id[:16], exc)

    async def report_work(served: list[Served]) -> None:
        try:
            await member.countersign(served)
        except ProtocolError as exc:
            log.warning("the stages' work was not countersigned: %s", exc)

    return Asker(peers, find_route, other_route, report_proof, verify_every=verify_every,
                 require_verified=require_verified, stall_timeout=stall_timeout, report_work=report_work,
                 payer=member.voucher, report_traffic=member.report_traffic)
