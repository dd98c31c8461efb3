"""The mesh as the front door of a `meshd join` daemon sees it: the daemon's view and routes,
and asks from a peer identity of the front door's own (as `meshd ask` makes them)."""

from __future__ import annotations

from meshd.client.ask import AskRequest, AskResult, OnToken, Stage, ask_with_failover, route_from_reply
from meshd.daemon import MeshDaemon
from meshd.net.peers import Peers
from wire.meshrpc import StatusReply

# Seconds a stage may stay silent before the asker gives up on it and fails over, as `meshd ask`'s default.
STALL_TIMEOUT = 30.0


class DaemonMesh:
    def __init__(self, daemon: MeshDaemon, peers: Peers, stall_timeout: float = STALL_TIMEOUT) -> None:
        self.daemon = daemon
        self.peers = peers
        self.stall_timeout = stall_timeout

    def status(self) -> StatusReply:
        return self.daemon.status()

    async def ask(self, model: str, request: AskRequest, on_token: OnToken | None, result: AskResult) -> AskResult:
        async def find_route(excluded: list[str]) -> list[Stage]:
            return route_from_reply(self.daemon.route(model, excluded))

        return await ask_with_failover(self.peers, find_route, request, on_token, stall_timeout=self.stall_timeout,
                                       result=result)
