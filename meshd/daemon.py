"""The mesh daemon: membership and election over peer links, the tracker, and the ranges it serves.

The sans-IO `MeshNode` decides; this trio shell only moves its messages (one
stream per SWIM message), sleeps until its next timer, and acts on what it
decided: as tracker it assigns layer ranges; as a volunteer it loads the range
it was assigned (the new one before releasing the old) and says so in its
signed record; as any node it plans routes from its own view.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from meshd.engine.supervisor import EngineSupervisor, WorkerSpec
from meshd.mesh.assignment import Assignment, AssignmentPolicy, CoverageError, ModelSpec, assign, capacities
from meshd.mesh.membership import SWIM_MESSAGES, MemberState
from meshd.mesh.models import file_digest, model_info
from meshd.mesh.node import MeshNode, TrackerChanged
from meshd.mesh.records import ROLE_CLIENT, ROLE_RELAY, CapabilityRecord, ModelInfo, ServedRange
from meshd.mesh.routing import NoRouteError, plan_route, stage_options
from meshd.net.link import Stream
from meshd.net.peers import Peers, PeersConfig, open_peers
from meshd.relay.circuit import enable_circuits
from meshd.relay.reservations import RelayCandidate, ReservationKeeper
from meshd.relay.service import RelayService, Tap
from meshd.stage.service import STAGE_PROTOCOL, StageLimits, StageService, answer_typed
from relay.limits import RelayLimits
from relay.protocol import parse_circuit_address
from wire.codec import ErrorMessage, Message, error_from_message
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.meshrpc import (
    MESH_PROTOCOL,
    SWIM_PROTOCOL,
    AssignmentReply,
    AssignmentRequest,
    DialBackReply,
    DialBackRequest,
    MemberStatus,
    ModelCoverage,
    RouteReply,
    RouteRequest,
    RouteStage,
    StatusReply,
    StatusRequest,
)
from wire.stage import Hop, Open

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeConfig:
    listen: tuple[str, int] = ("127.0.0.1", 0)
    seeds: tuple[str, ...] = ()
    model: Path | None = None
    memory_bytes: int = 1 << 30
    threads: int = 0
    limits: StageLimits = field(default_factory=lambda: StageLimits(max_sessions=4, max_session_tokens=1024,
                                                                    max_total_tokens=4096))
    client: bool = False
    relay: bool = False
    # The address others dial, when it is not the listening one (listening on 0.0.0.0, port forwarding).
    advertise: str | None = None
    relay_limits: RelayLimits = field(default_factory=RelayLimits)
    relay_tap: Tap | None = None
    # Relays a node behind NAT keeps reservations on.
    reservations: int = 2
    dial_back_timeout: float = 3.0
    peers: PeersConfig = field(default_factory=PeersConfig)
    assign_interval: float = 1.0
    rpc_timeout: float = 5.0


@dataclass
class ServingRange:
    start: int
    end: int
    service: StageService | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


async def rpc(peers: Peers, address: str | None, request: Message, node_id: str | None = None,
              timeout: float = 5.0) -> Message:
    """One request on a fresh mesh stream, one reply; a typed error reply is raised."""
    with trio.fail_after(timeout):
        stream = await peers.open_stream(address, MESH_PROTOCOL, node_id=node_id)
        async with stream:
            await stream.send_message(request)
            reply = await stream.receive_message()
    if isinstance(reply, ErrorMessage):
        raise error_from_message(reply)
    return reply


class MeshDaemon:
    def __init__(self, identity: NodeIdentity, config: NodeConfig) -> None:
        self.identity = identity
        self.config = config
        self.peers: Peers
        self.mesh: MeshNode
        self.address = ""
        self.model: ModelInfo | None = None
        self.serving: list[ServingRange] = []
        self.retiring: list[ServingRange] = []
        self.assignments: dict[str, Assignment] = {}
        self._uncovered: set[str] = set()
        self._seed_addresses: dict[str, str] = {}
        self._wake = trio.Event()
        self._nursery: trio.Nursery
        self.relay: RelayService | None = None

    # ----- lifecycle

    async def run(self, *, task_status: trio.TaskStatus[MeshDaemon] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        if cfg.model is not None:
            digest = await trio.to_thread.run_sync(file_digest, cfg.model)
            self.model = await trio.to_thread.run_sync(model_info, cfg.model, digest)
        async with open_peers(self.identity, cfg.peers) as peers, trio.open_nursery() as nursery:
            self.peers, self._nursery = peers, nursery
            peers.handle(SWIM_PROTOCOL, self._on_swim)
            peers.handle(MESH_PROTOCOL, self._on_rpc)
            peers.handle(STAGE_PROTOCOL, self._on_stage)
            enable_circuits(peers)
            if cfg.relay:
                self.relay = RelayService(peers, cfg.relay_limits, self._is_member, cfg.relay_tap)
            port = await peers.listen(*cfg.listen)
            self.address = cfg.advertise or f"{cfg.listen[0]}:{port}"
            roles = ([ROLE_CLIENT] if cfg.client else []) + ([ROLE_RELAY] if cfg.relay else [])
            # A relay is public by its operator's word; others learn it from a seed's dial-back.
            checks = bool(cfg.seeds) and not (cfg.relay or cfg.client)
            record = CapabilityRecord.create(
                self.identity, int(time.time() * 1000), addresses=[self.address],
                reachability="unknown" if checks else "public",
                memory_bytes=0 if cfg.client else cfg.memory_bytes, models=[self.model] if self.model else [],
                kv_tokens=cfg.limits.max_sessions * cfg.limits.max_session_tokens if self.model else 0,
                roles=roles, started_at=time.time())
            self.mesh = MeshNode(self.identity, record, trio.current_time())
            await self._join_seeds()
            if checks:
                await self._check_reachability()
            if self.mesh.record.reachability == "nat":
                keeper = ReservationKeeper(peers, self._relay_candidates, self._publish_relays,
                                           want=cfg.reservations)
                nursery.start_soon(keeper.run)
            nursery.start_soon(self._drive)
            if not cfg.client:
                nursery.start_soon(self._track)
            if self.model is not None and not cfg.client:
                nursery.start_soon(self._volunteer)
            task_status.started(self)

    async def _join_seeds(self) -> None:
        ids = []
        failures = []
        for seed in self.config.seeds:
            try:
                link = await self.peers.connect(seed)
            except (ProtocolError, OSError) as exc:
                failures.append(exc.message if isinstance(exc, ProtocolError) else f"{seed}: {exc}")
                continue
            self._seed_addresses[link.remote_node_id] = seed
            ids.append(link.remote_node_id)
        if self.config.seeds and not ids:
            # one line that says why, for the user who gave the seeds
            raise ProtocolError(ErrorCode.UNREACHABLE, f"no seed answered: {'; '.join(failures)}")
        for failure in failures:
            log.warning("seed unreachable: %s", failure)
        self.mesh.join(trio.current_time(), ids)
        self._flush()

    async def leave(self) -> None:
        """Says goodbye through gossip and gives it a moment to spread."""
        self.mesh.leave(trio.current_time())
        self._flush()
        with trio.move_on_after(1.0):
            while True:
                await trio.sleep(0.1)
                self.mesh.handle_timer(trio.current_time())
                self._flush()

    # ----- SWIM transport

    async def _drive(self) -> None:
        while True:
            delay = max(0.0, self.mesh.next_timer() - trio.current_time())
            with trio.move_on_after(delay):
                await self._wake.wait()
            self._wake = trio.Event()
            self.mesh.handle_timer(trio.current_time())
            self._flush()
            for event in self.mesh.events():
                if isinstance(event, TrackerChanged):
                    log.info("tracker is now %s", event.tracker)

    def _flush(self) -> None:
        for dest, message in self.mesh.messages_to_send():
            self._nursery.start_soon(self._send_swim, dest, message)

    def address_of(self, node_id: str) -> str | None:
        record = self.mesh.membership.record_of(node_id)
        if record is not None:
            address = self.dial_address(record)
            if address is not None:
                return address
        return self._seed_addresses.get(node_id)

    def dial_address(self, record: CapabilityRecord) -> str | None:
        """Where to dial a node: its own address or, behind NAT, a circuit through a relay we believe alive."""
        if record.reachability == "nat" and record.relay_addresses:
            relays = {a for r in self.live_records() if ROLE_RELAY in r.roles for a in r.addresses}
            return next((a for a in record.relay_addresses if parse_circuit_address(a)[0] in relays),
                        record.relay_addresses[0])
        return record.addresses[0] if record.addresses else None

    # ----- reachability and relays

    async def _check_reachability(self) -> None:
        """Asks the seeds to dial this node back; if one can it is public, if every one that answers cannot, NAT."""
        verdicts: list[bool] = []
        for node_id, address in self._seed_addresses.items():
            try:
                reply = await rpc(self.peers, address, DialBackRequest(address=self.address), node_id,
                                  self.config.dial_back_timeout + 2.0)
            except (ProtocolError, OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                log.info("seed %s did not dial back: %s", address, exc)
                continue
            if isinstance(reply, DialBackReply):
                verdicts.append(reply.reachable)
                if not reply.reachable:
                    log.info("seed %s cannot dial %s: %s", address, self.address, reply.detail)
        if verdicts:
            reachability = "public" if any(verdicts) else "nat"
            log.info("reachability: %s", reachability)
            self.mesh.update_record(trio.current_time(), reachability=reachability)
            self._flush()

    async def _dial_back(self, stream: Stream, address: str) -> DialBackReply:
        # As libp2p's AutoNAT: only the host the request comes from, so nobody can aim us at a third party.
        observed = stream.link.address.rpartition(":")[0]
        host, _, port = address.rpartition(":")
        if host != observed or not port.isdigit():
            return DialBackReply(reachable=False, detail=f"{address} is not where you dial from ({observed})")
        with trio.move_on_after(self.config.dial_back_timeout):
            try:
                connection = await trio.open_tcp_stream(host, int(port))
            except OSError as exc:
                return DialBackReply(reachable=False, detail=f"cannot connect to {address}: {exc.strerror}")
            await connection.aclose()
            return DialBackReply(reachable=True)
        return DialBackReply(reachable=False, detail=f"connecting to {address} timed out")

    def _is_member(self, node_id: str) -> bool:
        return self.mesh.membership.record_of(node_id) is not None

    def _relay_candidates(self) -> list[RelayCandidate]:
        records = [r for r in self.live_records() if ROLE_RELAY in r.roles and r.node_id != self.mesh.node_id
                   and r.reachability == "public" and r.addresses]
        return [RelayCandidate(r.node_id, r.addresses[0]) for r in sorted(records, key=lambda r: r.node_id)]

    def _publish_relays(self, addresses: list[str]) -> None:
        log.info("reachable through %s", ", ".join(addresses) or "no relay")
        self.mesh.update_record(trio.current_time(), relay_addresses=addresses)
        self._flush()
        self._wake.set()

    async def _send_swim(self, dest: str, message: Message) -> None:
        address = self.address_of(dest)
        if address is None:
            return
        with trio.move_on_after(1.0):
            try:
                stream = await self.peers.open_stream(address, SWIM_PROTOCOL, node_id=dest)
                async with stream:
                    await stream.send_message(message)
            except (ProtocolError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def _on_swim(self, stream: Stream) -> None:
        message = await stream.receive_message()
        if not isinstance(message, SWIM_MESSAGES):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{message.type!r} is not a SWIM message")
        self.mesh.handle_message(trio.current_time(), stream.remote_node_id, message)
        self._flush()
        self._wake.set()

    # ----- RPCs

    async def _on_rpc(self, stream: Stream) -> None:
        await answer_typed(stream, self._answer)

    async def _answer(self, stream: Stream, request: Message) -> None:
        if isinstance(request, AssignmentRequest):
            reply: Message = self._assignment_for(stream.remote_node_id)
        elif isinstance(request, RouteRequest):
            reply = self.route(request.model, request.exclude)
        elif isinstance(request, StatusRequest):
            reply = self.status()
        elif isinstance(request, DialBackRequest):
            reply = await self._dial_back(stream, request.address)
        else:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown mesh request {request.type!r}")
        await stream.send_message(reply)

    def live_records(self) -> list[CapabilityRecord]:
        return self.mesh.membership.live_records()

    def _models(self) -> dict[str, ModelInfo]:
        out: dict[str, ModelInfo] = {}
        for record in self.live_records():
            for m in record.models:
                out.setdefault(m.digest, m)
        return out

    def _assignment_for(self, node_id: str) -> AssignmentReply:
        tracker = self.mesh.tracker
        if tracker is None or tracker.node_id != self.mesh.node_id:
            raise ProtocolError(ErrorCode.NOT_FOUND, "this node is not the tracker")
        for digest, assignment in self.assignments.items():
            rng = assignment.ranges().get(node_id)
            if rng is not None:
                return AssignmentReply(term=tracker.term, model=digest, start=rng[0], end=rng[1])
        return AssignmentReply(term=tracker.term, reason="no range for this node")

    def route(self, model: str | None, exclude: list[str] | tuple[str, ...] = ()) -> RouteReply:
        models = self._models()
        if model is None:
            if not models:
                raise ProtocolError(ErrorCode.NOT_FOUND, "no member holds a model")
            model = next(iter(models))
        info = models.get(model)
        if info is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no member holds model {model[:12]}")
        records = {r.node_id: r for r in self.live_records()}
        rtt = self.mesh.membership.rtt

        def link_cost(a: str | None, b: str) -> float:
            return (rtt(b) or 0.0) if a is None or a == self.mesh.node_id else 0.001

        try:
            found = plan_route(stage_options(records.values(), model), info.n_layers, link_cost, exclude=exclude)
        except NoRouteError as exc:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no route for {info.name}: {exc}") from None
        stages = [RouteStage(node_id=s.node_id, address=self.dial_address(records[s.node_id]) or "",
                             start=s.start, end=s.end)
                  for s in found.stages]
        return RouteReply(model=model, n_layers=info.n_layers, stages=stages, seconds_per_token=found.seconds)

    def status(self) -> StatusReply:
        tracker = self.mesh.tracker
        members = [self._member_status(self.mesh.record, "alive")]
        for m in self.mesh.membership.members():
            if m.node_id == self.mesh.node_id:
                continue
            members.append(self._member_status(m.record, m.state.value if isinstance(m.state, MemberState)
                                               else str(m.state)))
        coverage = []
        for digest, info in self._models().items():
            served = [(r.node_id, s) for r in self.live_records() for s in r.served if s.model == digest]
            layers = [0] * info.n_layers
            for _, s in served:
                for i in range(s.start, min(s.end, info.n_layers)):
                    layers[i] += 1
            coverage.append(ModelCoverage(
                model=digest, name=info.name, n_layers=info.n_layers, covered_layers=sum(1 for c in layers if c),
                assigned=[f"{node[:12]} [{s.start}, {s.end})" for node, s in served],
                replicas=max(0, min(layers) - 1) if layers else 0))
        return StatusReply(node_id=self.mesh.node_id, tracker=tracker.node_id if tracker else None,
                           term=tracker.term if tracker else 0, members=members, coverage=coverage)

    def _member_status(self, record: CapabilityRecord, state: str) -> MemberStatus:
        tracker = self.mesh.tracker
        roles = list(record.roles) + (["tracker"] if tracker and tracker.node_id == record.node_id else [])
        return MemberStatus(node_id=record.node_id, address=record.addresses[0] if record.addresses else "",
                            state=state, roles=roles, reachability=record.reachability,
                            relay_addresses=list(record.relay_addresses),
                            memory_bytes=record.memory_bytes,
                            served=[f"{s.model[:12]} [{s.start}, {s.end})" for s in record.served],
                            models=[m.name for m in record.models])

    # ----- the tracker's duty and the volunteer's

    def _reassign(self) -> None:
        records = self.live_records()
        for digest, info in self._models().items():
            # the volunteers' own session budgets decide the KV each stage holds, not the tracker's
            kv_tokens = max((r.kv_tokens for r in records if r.model(digest) is not None), default=0) \
                or self.config.limits.max_sessions * self.config.limits.max_session_tokens
            try:
                self.assignments[digest] = assign(capacities(records, digest), ModelSpec.from_info(info, kv_tokens),
                                                  AssignmentPolicy(), self.assignments.get(digest))
            except CoverageError as exc:
                if self.assignments.pop(digest, None) is not None or digest not in self._uncovered:
                    log.warning("model %s cannot be covered: %s", info.name, exc)
                self._uncovered.add(digest)
            else:
                self._uncovered.discard(digest)

    async def _track(self) -> None:
        while True:
            await trio.sleep(self.config.assign_interval)
            tracker = self.mesh.tracker
            if tracker is not None and tracker.node_id == self.mesh.node_id:
                self._reassign()

    async def _volunteer(self) -> None:
        """Asks the tracker for this node's range and serves it; the new range loads before the old goes."""
        while True:
            await trio.sleep(self.config.assign_interval)
            tracker = self.mesh.tracker
            if tracker is None:
                continue
            try:
                if tracker.node_id == self.mesh.node_id:
                    reply = self._assignment_for(self.mesh.node_id)
                else:
                    address = self.address_of(tracker.node_id)
                    if address is None:
                        continue
                    got = await rpc(self.peers, address, AssignmentRequest(), tracker.node_id, self.config.rpc_timeout)
                    if not isinstance(got, AssignmentReply):
                        continue
                    reply = got
            except (ProtocolError, OSError, trio.TooSlowError, trio.BrokenResourceError):
                continue
            want = (reply.start, reply.end) if reply.model is not None else None
            current = (self.serving[-1].start, self.serving[-1].end) if self.serving else None
            if want is not None and want != current:
                await self._serve_range(*want)

    async def _serve_range(self, start: int, end: int) -> None:
        assert self.model is not None and self.config.model is not None
        serving = ServingRange(start, end)
        try:
            await self._nursery.start(self._run_range, serving)
        except Exception as exc:
            log.warning("cannot serve layers [%d, %d): %s", start, end, exc)
            return
        old, self.serving = self.serving, [serving]
        self._publish_served()
        for previous in old:
            self.retiring.append(previous)
            self._nursery.start_soon(self._retire, previous)

    async def _run_range(self, serving: ServingRange, *, task_status: trio.TaskStatus[None]) -> None:
        cfg, limits = self.config, self.config.limits
        assert self.model is not None and cfg.model is not None
        spec = WorkerSpec(cfg.model, None if (serving.start, serving.end) == (0, self.model.n_layers)
                          else (serving.start, serving.end),
                          n_ctx=limits.max_sessions * limits.max_session_tokens, n_seq_max=limits.max_sessions,
                          n_batch=limits.n_batch, threads=cfg.threads)
        engine = EngineSupervisor(spec)
        with serving.scope:
            async with trio.open_nursery() as nursery:
                report = await nursery.start(engine.run)
                service = StageService(self.peers, engine, report, self.model.digest, self.model.name, limits)
                engine.on_down = service.on_worker_down
                await nursery.start(service.run)
                serving.service = service
                task_status.started()

    async def _retire(self, serving: ServingRange) -> None:
        """Lets the old range finish the sessions it holds, then unloads it."""
        with trio.move_on_after(60.0):
            while serving.service is not None and serving.service.sessions:
                await trio.sleep(0.2)
        serving.scope.cancel()
        self.retiring.remove(serving)

    def _publish_served(self) -> None:
        assert self.model is not None
        served = [ServedRange(model=self.model.digest, start=s.start, end=s.end) for s in self.serving]
        self.mesh.update_record(trio.current_time(), served=served)
        self._flush()

    async def _on_stage(self, stream: Stream) -> None:
        await answer_typed(stream, self._route_stage_stream)

    async def _route_stage_stream(self, stream: Stream, first: Message) -> None:
        """Picks the range a stage stream is for: sessions stay on the range they opened on."""
        services = [s.service for s in self.serving if s.service is not None]
        retiring = [s.service for s in self.retiring if s.service is not None]
        chosen = services[-1] if services else None
        if isinstance(first, Open):
            chosen = next((s for s in services + retiring
                           if (s.report.layer_begin, s.report.layer_end) == (first.layer_begin, first.layer_end)),
                          chosen)
        elif isinstance(first, Hop):
            chosen = next((s for s in services + retiring if s.holds(first.session)), chosen)
        if chosen is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, "this node serves no layers yet",
                                retry_after_ms=1000)
        await chosen.handle_first(stream, first)


