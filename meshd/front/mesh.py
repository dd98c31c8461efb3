"""The mesh as the front door of a `meshd join` daemon sees it: the daemon's view and routes,
and asks from a peer identity of the front door's own (as `meshd ask` makes them)."""

from __future__ import annotations

import logging
from typing import Protocol

from meshd.client.ask import AskRequest, AskResult, OnToken
from meshd.client.asker import Asker
from meshd.client.route import Stage, route_from_reply
from meshd.client.served import Served
from meshd.client.verify import DEFAULT_VERIFY
from meshd.front.door import KEY_USED
from meshd.net.peers import Peers
from wire.credit import Voucher
from wire.errors import ErrorCode, ProtocolError
from wire.meshrpc import RouteReply, StatusReply, TrafficReport, TrafficTaken
from wire.receipt import Proof, ProofAccepted

log = logging.getLogger(__name__)

# Seconds a stage may stay silent before the asker gives up on it and fails over, as `meshd ask`'s default.
STALL_TIMEOUT = 30.0


class Daemon(Protocol):
    """What of a `MeshDaemon` the front door uses."""

    def status(self) -> StatusReply: ...

    def route(self, model: str | None, exclude: list[str]) -> RouteReply: ...

    async def planned_route(self, model: str | None, exclude: list[str]) -> RouteReply: ...

    def take_proof(self, proof: Proof) -> ProofAccepted: ...

    def countersign(self, served: list[Served], key: str = "") -> int: ...

    def voucher(self, opener: str, key: str = "", keys: int = 0) -> Voucher: ...

    def report_traffic(self, report: TrafficReport) -> TrafficTaken: ...


class DaemonMesh:
    def __init__(self, daemon: Daemon, peers: Peers, stall_timeout: float = STALL_TIMEOUT,
                 require_verified: bool = False, verify_every: int = DEFAULT_VERIFY, keys: int = 0) -> None:
        self.daemon = daemon
        # how many API keys the front door takes: each key's asks rank with its share of the member's priority
        self.keys = keys
        self.peers = peers
        self.stall_timeout = stall_timeout
        # the operator's policy (join --require-verified): an answer no replica checked whole is refused
        self.require_verified = require_verified
        # 1 in how many steps a replica runs again (join --verify; 0: off)
        self.verify_every = verify_every

    def status(self) -> StatusReply:
        return self.daemon.status()

    async def find_route(self, model: str, excluded: list[str]) -> list[Stage]:
        # the tracker's plan, not this node's records: a member's self-report cannot win the route
        try:
            return route_from_reply(await self.daemon.planned_route(model, excluded))
        except ProtocolError as exc:
            if not excluded or exc.code is not ErrorCode.NOT_FOUND:
                raise
            # the model is covered: the stages that failed this answer are what is missing, not coverage
            raise ProtocolError(ErrorCode.UNREACHABLE, f"no route is left around the {len(excluded)} "
                                                       f"stage(s) that failed this answer: {exc.message}") from None

    async def ask(self, model: str, request: AskRequest, on_token: OnToken | None, result: AskResult) -> AskResult:
        async def find_route(excluded: list[str]) -> list[Stage]:
            return await self.find_route(model, excluded)

        async def other_route(excluded: list[str]) -> list[Stage]:
            return route_from_reply(await self.daemon.planned_route(model, excluded))

        async def report_proof(proof: Proof) -> None:
            try:
                self.daemon.take_proof(proof)
            except ProtocolError as exc:
                log.warning("the daemon did not take a proof: %s", exc)

        key = KEY_USED.get()

        async def report_work(served: list[Served]) -> None:
            # the front door's asks are its member's: the member countersigns what each stage served, and
            # counts it against the key that asked
            self.daemon.countersign(served, key)

        async def report_traffic(report: TrafficReport) -> None:
            # what the front door's asks saw of their routes: its member's report to the tracker
            self.daemon.report_traffic(report)

        # the stages rank the front door's asks by its member's credit (it dials from an identity of its own),
        # each API key's by its share of it
        request.payer = self.daemon.voucher(self.peers.identity.node_id, key, self.keys)
        # verified at the default rate (not while speculating with a draft model: meshd.client.asker)
        asker = Asker(self.peers, find_route, other_route, report_proof, require_verified=self.require_verified,
                      verify_every=self.verify_every,
                      stall_timeout=self.stall_timeout, report_work=report_work, report_traffic=report_traffic)
        return await asker.ask(request, on_token, result)
