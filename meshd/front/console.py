"""The console: a page at `/` that shows the mesh as this member sees it, and a chat box.

The page (static HTML, CSS and JS shipped in the package, no build step) polls
`GET /console/state` once a second. Polling rather than SSE: `fetch` can send
the API key (`EventSource` cannot set headers), the server holds no connection
per viewer, and a hidden tab slows its own polling. Every viewer shares one
snapshot per `REFRESH` seconds, so ten tabs cost the mesh what one does.

A snapshot is this node's status view (members, tracker and term, coverage and
why a model is not covered: the same coverage-reason code as `meshd status`),
each model's layers with the ranges that cover them, the route an ask gets now,
and each serving member's stage figures (sessions, KV tokens, live tok/s from
its `decode_rows` counter), asked over the stage protocol. Members are
strangers: their figures are taken only if finite and in bounds, a slow one is
cut off after `METRICS_TIMEOUT`, at most `MAX_POLLED` are asked per snapshot,
and whatever they name reaches the page as JSON text that the page sets as
text, never as markup.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any, Protocol, runtime_checkable

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from meshd.daemon import MeshDaemon
from meshd.front import openai_api
from meshd.front.door import ApiError, Asking, FrontDoor, Mesh
from meshd.front.mesh import DaemonMesh
from meshd.mesh.membership import MemberInfo, MemberState
from meshd.mesh.records import CapabilityRecord
from meshd.net import rpc as net_rpc
from meshd.status_table import speed_from
from wire.errors import ErrorCode, ProtocolError
from wire.meshrpc import ModelCoverage, RouteReply, SpeedsReply, StageSpeed, StatusReply
from wire.stage import STAGE_PROTOCOL, Metrics, MetricsRequest

# A snapshot younger than this is served again: one mesh poll a second whatever the viewers.
REFRESH = 0.9
# Stage figures asked per snapshot, how many at once, and how long one member may take.
MAX_POLLED = 64
POLL_CONCURRENCY = 8
METRICS_TIMEOUT = 1.0
# The front door's asks in flight shown (it runs at most door.MAX_ASKS at once).
MAX_ASKS_SHOWN = 64
# A figure a member reports beyond this is not believed.
MAX_FIGURE = 1e15

# The page runs only the package's own script and style and talks only to this origin.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@runtime_checkable
class MeshSource(Protocol):
    """What the console reads of a member: the daemon is one (`DaemonSource`); tests use a fake."""

    def status(self) -> StatusReply:
        """The status view: members, tracker, coverage with its reasons."""
        ...

    def members(self) -> list[MemberInfo]:
        """Every member in the mesh (none departed), with its record and measured round-trip time."""
        ...

    async def route(self, model: str) -> RouteReply:
        """The route an ask for `model` gets now; a ProtocolError says why there is none."""
        ...

    async def stage_metrics(self, node_id: str) -> dict[str, float]:
        """A serving member's stage figures; a ProtocolError or OSError when it cannot say."""
        ...

    async def stage_speeds(self) -> SpeedsReply | None:
        """The stage speeds routes count, and where each came from; None: this source knows none."""
        ...


@runtime_checkable
class CreditSource(Protocol):
    """A source that also knows each member's credit (meshd.mesh.credit): the daemon's ledger."""

    def credits(self) -> dict[str, float]:
        """Each member's balance (work units, decayed) as this node's ledger counts it."""
        ...


class DaemonSource:
    """The console's view of the `MeshDaemon` it runs beside: its own stage read directly,
    the others' asked over the stage protocol."""

    def __init__(self, daemon: MeshDaemon) -> None:
        self.daemon = daemon

    def status(self) -> StatusReply:
        return self.daemon.status()

    def members(self) -> list[MemberInfo]:
        return self.daemon.mesh.membership.members()

    async def route(self, model: str) -> RouteReply:
        # the tracker's plan, as the front door's asks get it (meshd.front.mesh.DaemonMember.route), not this node's records
        return await self.daemon.planned_route(model)

    async def stage_metrics(self, node_id: str) -> dict[str, float]:
        if node_id == self.daemon.identity.node_id:
            services = [s.service for s in self.daemon.serving if s.service is not None]
            if not services:
                raise ProtocolError(ErrorCode.NOT_FOUND, "this node serves no layers yet")
            return services[-1].metric_values()
        address = self.daemon.address_of(node_id)
        reply = await net_rpc.call(self.daemon.peers, address, STAGE_PROTOCOL, MetricsRequest(), Metrics,
                                   node_id=node_id, timeout=METRICS_TIMEOUT)
        return dict(reply.values)

    async def stage_speeds(self) -> SpeedsReply | None:
        # the tracker's, as routes count them (MeshDaemon.stage_speeds), not this node's records
        return await self.daemon.stage_speeds()

    def credits(self) -> dict[str, float]:
        return {node_id: standing.balance for node_id, standing in self.daemon.credit.standing().items()}


class StatusSource:
    """A front door's mesh that offers only its status view (a mesh of fakes): the console shows the
    status and says it has no routes or figures, instead of refusing to mount."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def status(self) -> StatusReply:
        return self.mesh.status()

    def members(self) -> list[MemberInfo]:
        return []

    async def route(self, model: str) -> RouteReply:
        raise ProtocolError(ErrorCode.NOT_FOUND, "this front door's mesh plans no routes")

    async def stage_metrics(self, node_id: str) -> dict[str, float]:
        raise ProtocolError(ErrorCode.NOT_FOUND, "this front door's mesh reads no stage figures")

    async def stage_speeds(self) -> SpeedsReply | None:
        return None


def source_of(mesh: Mesh) -> MeshSource:
    if isinstance(mesh, DaemonMesh) and isinstance(mesh.daemon, MeshDaemon):
        return DaemonSource(mesh.daemon)
    return mesh if isinstance(mesh, MeshSource) else StatusSource(mesh)


# ----- stage figures: believed only in bounds, tok/s from successive readings

def figure(values: dict[str, float], key: str) -> float | None:
    """A member's reported figure if it is a finite number within bounds, else None."""
    value = values.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) and 0.0 <= value <= MAX_FIGURE else None


@dataclass
class Rates:
    """Live tok/s of each stage: the growth of its `decode_rows` counter between two readings.

    A counter that shrinks (a restarted worker, a new range) starts afresh; only the stages
    of the latest snapshot are remembered, so the table stays within MAX_POLLED."""

    _last: dict[str, tuple[float, float]] = field(default_factory=dict)

    def rate(self, node_id: str, now: float, count: float) -> float:
        last = self._last.get(node_id)
        self._last[node_id] = (now, count)
        if last is None or now <= last[0] or count < last[1]:
            return 0.0
        return (count - last[1]) / (now - last[0])

    def keep(self, node_ids: set[str]) -> None:
        for gone in self._last.keys() - node_ids:
            del self._last[gone]


def stage_figures(values: dict[str, float], tok_s: float) -> dict[str, Any]:
    looked, hit = figure(values, "cache_looked_tokens"), figure(values, "cache_hit_tokens")
    return {"sessions": figure(values, "sessions"), "kv_tokens": figure(values, "kv_tokens"),
            "step_ms_p50": figure(values, "step_ms_p50"), "tok_s": tok_s,
            "worker_up": figure(values, "worker_up") == 1.0, "cache_tokens": figure(values, "cache_tokens"),
            # the prefix cache's hit rate: of the prompt tokens looked up, the share it held (None: no lookup yet)
            "cache_hit_rate": min(1.0, hit / looked) if looked and hit is not None else None}


# ----- the snapshot: a pure function of the view, the figures and the routes

LIVE_STATES = (MemberState.ALIVE, MemberState.SUSPECT)


def snapshot(status: StatusReply, members: Sequence[MemberInfo], stages: dict[str, dict[str, Any]],
             route_of: Callable[[str], RouteReply], asks: Sequence[Asking], now: float,
             speeds: SpeedsReply | None = None, credits: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The console's JSON: `stages` holds each polled member's `stage_figures`; `route_of` gives a
    covered model's route (a ProtocolError says why there is none); `asks` are the front door's
    asks in flight; `now` is Unix time; `speeds` what routes count of each stage (None: unknown);
    `credits` each member's balance in this node's ledger (None: this source keeps none)."""
    info = {m.node_id: m for m in members}
    # a member's figure is one for all its ranges (routes count it per node), shown on its row
    speed_of = {(p.node_id, p.model, p.start, p.end): _speed(p, speeds.by, status.tracker)
                for p in speeds.speeds} if speeds is not None else {}
    node_speed = {node_id: shown for (node_id, *_), shown in speed_of.items()}
    rows = []
    for shown in status.members:
        member = info.get(shown.node_id)
        record = member.record if member is not None else None
        rows.append({
            "node_id": shown.node_id, "address": shown.address, "state": shown.state, "roles": shown.roles,
            "reachability": shown.reachability, "memory_bytes": shown.memory_bytes,
            "served": _served(record), "models": shown.models, "offload": shown.offload,
            "rtt_ms": member.rtt * 1000.0 if member is not None and member.rtt is not None else None,
            # what routes count (the tracker's probe, or the default while unmeasured), never its own word
            "ms_per_layer": node_speed[shown.node_id]["ms_per_layer"] if shown.node_id in node_speed else None,
            "speed_from": node_speed[shown.node_id]["from"] if shown.node_id in node_speed else None,
            "load": record.load if record is not None else 0.0,
            "leaving": bool(record and record.leaving),
            "stage": stages.get(shown.node_id),
            "credit": None if credits is None else credits.get(shown.node_id, 0.0),
        })
    return {"node_id": status.node_id, "tracker": status.tracker, "term": status.term, "time": now,
            "members": rows, "models": [_model(c, members, route_of, speed_of) for c in status.coverage],
            "asks": [_ask(a, now) for a in asks[:MAX_ASKS_SHOWN]]}


def _ask(a: Asking, now: float) -> dict[str, Any]:
    r = a.result
    return {"id": a.id, "model": a.model, "dialect": a.dialect, "stream": a.stream,
            "seconds": max(0.0, now - a.started), "prompt_tokens": len(r.prompt_tokens), "tokens": len(r.tokens),
            "epochs": r.epochs,
            "route": [{"node_id": s.node_id, "start": s.layer_begin, "end": s.layer_end} for s in r.route]}


def _speed(p: StageSpeed, by: str, tracker: str | None) -> dict[str, Any]:
    return {"ms_per_layer": p.seconds_per_layer * 1000.0, "source": p.source, "from": speed_from(p, by, tracker)}


def _served(record: CapabilityRecord | None) -> list[dict[str, Any]]:
    return [] if record is None else [{"model": s.model, "start": s.start, "end": s.end} for s in record.served]


def _model(c: ModelCoverage, members: Sequence[MemberInfo], route_of: Callable[[str], RouteReply],
           speed_of: Mapping[tuple[str, str, int, int], dict[str, Any]]) -> dict[str, Any]:
    ranges, depth, gone = [], [0] * c.n_layers, []
    for m in members:
        live = m.state in LIVE_STATES and not m.record.leaving
        state = "leaving" if m.record.leaving and m.state in LIVE_STATES else m.state.value
        for s in m.record.served:
            if s.model != c.model or s.start >= c.n_layers:
                continue
            ranges.append({"node_id": m.node_id, "start": s.start, "end": min(s.end, c.n_layers), "state": state,
                           "speed": speed_of.get((m.node_id, s.model, s.start, s.end))})
            if live:
                for layer in range(s.start, min(s.end, c.n_layers)):
                    depth[layer] += 1
            else:
                gone.append(f"{m.node_id[:12]} ({state}) served layers [{s.start}, {s.end})")
    covered = c.covered_layers == c.n_layers and c.n_layers > 0
    why = ([c.reason] if c.reason else []) + [f"unreachable: {g}" for g in gone]
    if not covered and not c.reason:
        why.append("the live members can cover it: its ranges are being assigned or loaded")
    route, route_error = None, ""
    if covered:
        try:
            reply = route_of(c.model)
        except ProtocolError as exc:
            route_error = exc.message
        else:
            route = {"seconds_per_token": reply.seconds_per_token,
                     "stages": [{"node_id": s.node_id, "address": s.address, "start": s.start, "end": s.end}
                                for s in reply.stages]}
    return {"digest": c.model, "name": c.name, "n_layers": c.n_layers, "covered_layers": c.covered_layers,
            "covered": covered, "replicas": c.replicas, "depth": depth, "ranges": ranges,
            "why": why if not covered else [], "route": route, "route_error": route_error}


# ----- the console: one snapshot shared by every viewer

class Console:
    def __init__(self, source: MeshSource, asking: Mapping[int, Asking] | None = None) -> None:
        self.source = source
        # the front door's asks in flight: its own sessions and the routes they run on
        self.asking: Mapping[int, Asking] = asking if asking is not None else {}
        self._rates = Rates()
        self._lock = trio.Lock()
        self._snapshot: dict[str, Any] | None = None
        self._taken = -math.inf

    async def state(self) -> dict[str, Any]:
        async with self._lock:
            now = trio.current_time()
            if self._snapshot is None or now - self._taken >= REFRESH:
                self._snapshot = await self._take()
                self._taken = now
            return self._snapshot

    async def _take(self) -> dict[str, Any]:
        members = self.source.members()
        status = self.source.status()
        polled = [m.node_id for m in members
                  if m.state is MemberState.ALIVE and m.record.served and not m.record.leaving][:MAX_POLLED]
        readings: dict[str, dict[str, float]] = {}
        planned: dict[str, RouteReply | ProtocolError] = {}
        speeds: list[SpeedsReply | None] = [None]
        limiter = trio.CapacityLimiter(POLL_CONCURRENCY)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._speeds, limiter, speeds)
            for c in status.coverage:
                if c.n_layers > 0 and c.covered_layers == c.n_layers:
                    nursery.start_soon(self._plan, c.model, limiter, planned)
            for node_id in polled:
                nursery.start_soon(self._poll, node_id, limiter, readings)
        now = trio.current_time()
        stages = {}
        for node_id, values in readings.items():
            count = figure(values, "decode_rows")
            stages[node_id] = stage_figures(values, self._rates.rate(node_id, now, count) if count is not None else 0.0)
        self._rates.keep(set(readings))

        def route_of(model: str) -> RouteReply:
            got = planned.get(model)
            if got is None:
                raise ProtocolError(ErrorCode.DEADLINE_EXCEEDED, "no route was planned in time")
            if isinstance(got, ProtocolError):
                raise got
            return got

        credits = self.source.credits() if isinstance(self.source, CreditSource) else None
        return snapshot(status, members, stages, route_of, list(self.asking.values()), time.time(), speeds[0],
                        credits)

    async def _speeds(self, limiter: trio.CapacityLimiter, out: list[SpeedsReply | None]) -> None:
        async with limiter:
            # the tracker's rpc has its own deadline; this one bounds a snapshot's wait for it and the limiter
            with trio.move_on_after(METRICS_TIMEOUT * 2):
                try:
                    out[0] = await self.source.stage_speeds()
                except ProtocolError:
                    return

    async def _plan(self, model: str, limiter: trio.CapacityLimiter, out: dict[str, RouteReply | ProtocolError]) -> None:
        async with limiter:
            # the tracker's rpc has its own deadline; this one bounds a snapshot's wait for it and the limiter
            with trio.move_on_after(METRICS_TIMEOUT * 2):
                try:
                    out[model] = await self.source.route(model)
                except ProtocolError as exc:
                    out[model] = exc

    async def _poll(self, node_id: str, limiter: trio.CapacityLimiter, out: dict[str, dict[str, float]]) -> None:
        async with limiter:
            # the remote call has its own deadline; this one bounds the wait for the limiter too
            with trio.move_on_after(METRICS_TIMEOUT * 2):
                try:
                    out[node_id] = await self.source.stage_metrics(node_id)
                except (ProtocolError, OSError):
                    return


# ----- HTTP

# Decides whether a request may read the mesh's state: None lets it, a response refuses it.
Guard = Callable[[Request], Response | None]


def routes(front: FrontDoor, console: Console) -> list[BaseRoute]:
    """`console` (of the front door's mesh) on the front door's app: the state is guarded by the API's own keys."""

    def guard(request: Request) -> Response | None:
        try:
            front.check_key(request.headers.get("authorization"), request.headers.get("x-api-key"))
        except ApiError as exc:
            return openai_api.error_response(exc)
        return None

    return console_routes(console, guard)


def console_routes(console: Console, guard: Guard | None = None) -> list[BaseRoute]:
    """The page at `/`, its assets, and the state it polls."""
    page = (files("meshd.front") / "static" / "index.html").read_bytes()

    async def index(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    async def state(request: Request) -> Response:
        refused = guard(request) if guard is not None else None
        if refused is not None:
            return refused
        return JSONResponse(await console.state(), headers={"Cache-Control": "no-store"})

    return [
        Route("/", index, methods=["GET"]),
        Route("/console/state", state, methods=["GET"]),
        Mount("/console/static", StaticFiles(packages=[("meshd.front", "static")]), name="console-static"),
    ]
