"""The mesh as the front door of a `meshd join` daemon sees it: the daemon's view and routes,
and asks from a peer identity of the front door's own (as `meshd ask` makes them), through the
one asker (meshd.client.asker) with the daemon as its member."""

from __future__ import annotations

from typing import Protocol

from meshd.client.ask import STALL_TIMEOUT, AskRequest, AskResult, OnToken
from meshd.client.asker import member_asker
from meshd.client.served import Served
from meshd.client.verify import DEFAULT_VERIFY
from meshd.front.door import KEY_USED
from meshd.net.peers import Peers
from wire.credit import Voucher
from wire.meshrpc import RouteReply, StatusReply, TrafficReport, TrafficTaken
from wire.receipt import Proof, ProofAccepted


class Daemon(Protocol):
    """What of a `MeshDaemon` the front door uses."""

    def status(self) -> StatusReply: ...

    def route(self, model: str | None, exclude: list[str]) -> RouteReply: ...

    async def planned_route(self, model: str | None, exclude: list[str]) -> RouteReply: ...

    def take_proof(self, proof: Proof) -> ProofAccepted: ...

    def countersign(self, served: list[Served], key: str = "") -> int: ...

    def voucher(self, opener: str, key: str = "", keys: int = 0) -> Voucher: ...

    def report_traffic(self, report: TrafficReport) -> TrafficTaken: ...


class DaemonMember:
    """The daemon as the asker's member (meshd.client.asker.Member): in this process, never out of reach.
    ``key`` is the API key an ask came with, of the front door's ``keys``: its asks rank with its share
    of the member's priority, and their work counts against it."""

    remote = False

    def __init__(self, daemon: Daemon, key: str = "", keys: int = 0) -> None:
        self.daemon = daemon
        self.key = key
        self.keys = keys

    async def route(self, model: str | None, excluded: list[str]) -> RouteReply:
        return await self.daemon.planned_route(model, excluded)

    async def take_proof(self, proof: Proof) -> None:
        self.daemon.take_proof(proof)

    async def countersign(self, served: list[Served]) -> None:
        # the front door's asks are its member's: the member countersigns what each stage served, and
        # counts it against the key that asked
        self.daemon.countersign(served, self.key)

    async def voucher(self, opener: str) -> Voucher:
        # the stages rank the front door's asks by its member's credit (it dials from an identity of its own),
        # each API key's by its share of it
        return self.daemon.voucher(opener, self.key, self.keys)

    async def report_traffic(self, report: TrafficReport) -> None:
        # what the front door's asks saw of their routes: its member's report to the tracker
        self.daemon.report_traffic(report)


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

    async def ask(self, model: str, request: AskRequest, on_token: OnToken | None, result: AskResult) -> AskResult:
        # verified at the default rate (not while speculating with a draft model: meshd.client.asker)
        member = DaemonMember(self.daemon, KEY_USED.get(), self.keys)
        asker = member_asker(self.peers, member, model, verify_every=self.verify_every,
                             require_verified=self.require_verified, stall_timeout=self.stall_timeout)
        return await asker.ask(request, on_token, result)
