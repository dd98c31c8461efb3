"""Routes as the asker holds them: the stages to dial and what each should serve, checked against
what they say when opened, and where routes come from (a member, and the members it named once it is gone).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from meshd.client.ask import RouteError
from wire.errors import ErrorCode, ProtocolError
from wire.meshrpc import RouteReply, RouteStage
from wire.stage import (
    StageInfo,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stage:
    """One stop of a route: where to dial, and what the asker expects there (None: whatever it serves).

    The stage's own account (``StageInfo``) comes back in its ``Opened``.
    """

    address: str
    node_id: str | None = None
    model_digest: str | None = None
    layers: tuple[int, int] | None = None
    # other members serving exactly these layers, as the route's planner named them for spot checks
    # (None: it did not say, and the verifier asks for routes around the stage to find some)
    replicas: tuple[Stage, ...] | None = None
    # its numerics fingerprint as the planner named it ("": not named, or the same as the stage it replicates)
    numerics: str = ""


def route_at(addresses: Sequence[str]) -> list[Stage]:
    """A route given by the user as addresses: each stage says what it serves when it opens."""
    return [Stage(address) for address in addresses]


def route_from_reply(reply: RouteReply) -> list[Stage]:
    """The route a member planned: it already says who serves which layers of which model, and
    (a planner of this release) which other members serve each stage's layers."""
    def replicas(s: RouteStage) -> tuple[Stage, ...] | None:
        if reply.replicas is None:
            return None
        return tuple(Stage(r.address, r.node_id, reply.model, (r.start, r.end), numerics=r.numerics) for r in reply.replicas
                     if (r.start, r.end) == (s.start, s.end) and r.node_id != s.node_id)

    return [Stage(s.address, s.node_id, reply.model, (s.start, s.end), replicas(s)) for s in reply.stages]


def check_opened(stage: Stage, info: StageInfo) -> None:
    """The stage serves what the route said it does."""
    if stage.node_id is not None and info.node_id != stage.node_id:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{stage.address} says it is node {info.node_id[:16]}, "
                                                   f"the route has {stage.node_id[:16]}")
    if stage.model_digest is not None and info.model_digest != stage.model_digest:
        raise ProtocolError(ErrorCode.MODEL_MISMATCH, f"{stage.address} serves model {info.model_digest[:12]}, "
                                                      f"the route has {stage.model_digest[:12]}")
    if stage.layers is not None and (info.layer_begin, info.layer_end) != stage.layers:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{stage.address} serves layers [{info.layer_begin}, "
                                                   f"{info.layer_end}), the route has [{stage.layers[0]}, "
                                                   f"{stage.layers[1]})")


def check_route(route: Sequence[Stage], infos: Sequence[StageInfo]) -> None:
    """Every layer covered exactly once, in order, by stages of one model."""
    if not infos:
        raise RouteError("the route is empty")
    digests = {info.model_digest for info in infos}
    if len(digests) > 1:
        names = ", ".join(f"{s.address} has {i.model_digest[:12]}" for s, i in zip(route, infos, strict=True))
        raise RouteError(f"stages serve different model files ({names})")
    n_layer = infos[0].n_layer
    expected = 0
    for s, info in zip(route, infos, strict=True):
        begin, end = info.layer_begin, info.layer_end
        if begin > expected:
            raise RouteError(f"the route leaves layers [{expected}, {begin}) uncovered (before {s.address})")
        if begin < expected:
            raise RouteError(f"layers [{begin}, {min(expected, end)}) are covered twice ({s.address} overlaps)")
        expected = end
    if expected != n_layer:
        raise RouteError(f"the route leaves layers [{expected}, {n_layer}) uncovered (after the last stage)")


RouteFinder = Callable[[list[str]], Awaitable[list[Stage]]]


# Members the asker keeps as other places to ask for a route, learned from the routes it was given.
MAX_ROUTE_SOURCES = 32
# A route source that cannot be reached (the others are asked in turn); any other error is its answer.
_SOURCE_DOWN = (ErrorCode.UNREACHABLE, ErrorCode.DEADLINE_EXCEEDED)

AskMember = Callable[[Stage, list[str]], Awaitable[list[Stage]]]


class RouteSources:
    """A route finder that survives its source: it asks `first` (the seed or the local daemon, say
    the tracker) and, once that cannot be reached, the members it learned of from the routes it was
    given (the stages), in turn, through `ask_member`. Any member plans a route from its own view,
    and the tracker's successor is among them once it is elected."""

    def __init__(self, first: RouteFinder, ask_member: AskMember) -> None:
        self.first = first
        self.ask_member = ask_member
        self.first_down = False
        self.members: dict[str, Stage] = {}

    async def __call__(self, excluded: list[str]) -> list[Stage]:
        failure: ProtocolError | None = None
        if not self.first_down:
            try:
                return self._learn(await self.first(excluded))
            except ProtocolError as exc:
                if exc.code not in _SOURCE_DOWN or not self.members:
                    raise
                log.info("the route source is down (%s); asking the members", exc)
                self.first_down = True
                failure = exc
        for node_id, member in list(self.members.items()):
            if node_id in excluded:
                continue
            try:
                return self._learn(await self.ask_member(member, excluded))
            except ProtocolError as exc:
                if exc.code not in _SOURCE_DOWN:
                    raise
                failure = exc
                del self.members[node_id]
        raise failure or ProtocolError(ErrorCode.UNREACHABLE, "no member is left to ask for a route")

    def _learn(self, route: list[Stage]) -> list[Stage]:
        for stage in route:
            if stage.node_id is not None and len(self.members) < MAX_ROUTE_SOURCES:
                self.members.setdefault(stage.node_id, stage)
        return route
