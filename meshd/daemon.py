"""The mesh daemon: membership and election over peer links, the tracker, and the ranges it serves.

The sans-IO `MeshDuty` (membership, election, the tracker's and the volunteer's
duties) decides; `MeshDriver` runs it in trio, and the daemon only moves its
messages (one stream per SWIM message) and acts on what it asks: it asks the
tracker for this node's range, loads that range beside the old one, lets the
old one finish its sessions, and answers mesh RPCs from the duty's view. The
simulation runs the same `MeshDriver` and `MeshDuty` over an in-memory network.

Model files: a node started with a file serves its bytes to fetchers (the
chunk source, meshd.fetch) under the file's model id, the hash of its
manifest. A node started with `model_id` and no file learns the manifest and
the header from the members holding the model, announces it can serve it, and
on each assignment fetches exactly the tensors of its range into a sparse file
in its state directory before it loads it; what it has fetched it serves to
others in turn, and under a disk budget it drops (punches) what it no longer
serves once the old range has retired.
"""

from __future__ import annotations

import logging
import math
import random
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from tqdm import tqdm

from meshd.client.ask import first_error
from meshd.client.ledger import LedgerKeeper
from meshd.client.probe import probe_stage
from meshd.client.served import Served
from meshd.engine.supervisor import EngineSupervisor, WorkerSpec
from meshd.fetch.fetcher import FetchFailed, FetchProgress, FetchReport, SourceRef, fetch_chunks, fetch_manifest
from meshd.fetch.hub import (
    HubError,
    HubModel,
    HubReader,
    cached_manifest,
    check_binding,
    fetch_from_hub,
    hash_model,
    remember_manifest,
)
from meshd.fetch.source import ChunkSource, SourceConfig, activity, register
from meshd.mesh.addresses import fit_for_peer, is_ip, observed_address, source_group
from meshd.mesh.assignment import ModelSpec, held_ranges, stage_fits
from meshd.mesh.authority import placement_of
from meshd.mesh.credit import NEWCOMER_FLOOR, extra_votes
from meshd.mesh.duty import MeshDuty
from meshd.mesh.duty_events import AskAssignment, AssignmentChanged, DutyConfig, DutyEvent, LoadRange, RangeRefused
from meshd.mesh.membership import SWIM_MESSAGES, MemberEvent, SwimMessage
from meshd.mesh.models import ModelNotFound, model_info
from meshd.mesh.node import MeshNode, TrackerChanged
from meshd.mesh.probes import ProbeConfig, StageProbe
from meshd.mesh.proofs import InvalidProof
from meshd.mesh.records import (
    MAX_HELD,
    ROLE_CLIENT,
    ROLE_RELAY,
    CapabilityRecord,
    HeldRange,
    ModelInfo,
    address_fits,
    host_of,
    is_loopback,
    is_unspecified,
    join_address,
    record_fits,
    split_address,
)
from meshd.mesh.status import held_models
from meshd.net import rpc as net_rpc
from meshd.net.peers import Peers, PeersConfig, open_peers
from meshd.net.rpc import answer_typed
from meshd.net.stream import Stream
from meshd.relay.circuit import enable_circuits
from meshd.relay.punch import Puncher
from meshd.relay.reservations import RelayCandidate, ReservationKeeper
from meshd.relay.service import RelayService, Tap
from meshd.stage.books import StageLimits
from meshd.stage.fast import FastDoor
from meshd.stage.node import model_manifest
from meshd.stage.service import StageService
from meshd.store.gguf_header import GGUFError
from meshd.store.holding import WholeFile
from meshd.store.manifest import CHUNK_SIZE, Chunk, Manifest
from meshd.store.ranges import held_layer_ranges, range_chunks
from meshd.store.sparse import SparseFile
from meshd.store.split import SplitError, model_files
from relay.limits import RelayLimits
from relay.protocol import parse_circuit_address
from wire.codec import Message
from wire.credit import CREDITS_PAGE, CreditsReply, CreditsRequest, PeerCredit, Voucher
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.meshrpc import (
    MESH_PROTOCOL,
    STATUS_PAGE,
    SWIM_PROTOCOL,
    AssignmentReply,
    AssignmentRequest,
    DialBackReply,
    DialBackRequest,
    FetchStatus,
    LinkStatus,
    RouteReply,
    RouteRequest,
    SpeedsReply,
    SpeedsRequest,
    StatusReply,
    StatusRequest,
    TrafficReport,
    TrafficTaken,
)
from wire.receipt import Proof, ProofAccepted, ProofGossip
from wire.stage import STAGE_PROTOCOL, Hop, Open, PeerRef

log = logging.getLogger(__name__)
# members a node passes a new proof on to (each checks it, and passes it on once if it is news to it)
PROOF_FANOUT = 3
# How long a status waits for the tracker's stage speeds: a status answers even when the tracker does
# not (then with this node's own figures), a second or two late at worst, not an rpc timeout late.
SPEEDS_TIMEOUT = 2.0
# How long a claimant holds an assignment ask for the votes that carry it (a gossip round away), well
# inside the asker's rpc timeout: its voters ask the moment they vote, before their votes arrive here.
CLAIM_WAIT = 2.0
# Seconds a node joining with a hub model waits for a member to offer its manifest before it reads the whole
# files itself to build it: records spread within a few push-pull rounds of a join.
HUB_GOSSIP_WAIT = 5.0
# how often the election's votes are weighed again by the credit ledger (meshd.mesh.credit.extra_votes)
CREDIT_VOTES_EVERY = 60.0
# How often a member publishes how busy its stage is (its record's load, which routes count): a record's
# every version is gossiped to every member, so not per session; the tracker's kept route moves off a
# stage whose load makes it cost more than the route margin (meshd.mesh.routing.ROUTE_MARGIN), so one
# hot route (the prefix cache keeps an agent's turns on theirs) spills onto idle replicas.
LOAD_EVERY = 5.0
# the unit a volunteer's memory is told in, as on the command line (--memory 64M)
MIB = 1 << 20


@dataclass(frozen=True)
class NodeConfig:
    listen: tuple[str, int] = ("127.0.0.1", 0)
    seeds: tuple[str, ...] = ()
    model: Path | None = None
    memory_bytes: int = 1 << 30
    # GPU memory offered, and the layers of the assigned range offloaded there (from its end; -1: all)
    gpu_memory_bytes: int = 0
    gpu_layers: int = 0
    threads: int = 0
    limits: StageLimits = field(default_factory=lambda: StageLimits(max_sessions=4, max_session_tokens=1024,
                                                                    max_total_tokens=4096))
    client: bool = False
    relay: bool = False
    # The address others dial, when the operator knows it (port forwarding, a 1:1 NAT, a DNS name);
    # without it a node publishes where its seeds see it, or, listening on a given host, that host.
    advertise: str | None = None
    relay_limits: RelayLimits = field(default_factory=RelayLimits)
    relay_tap: Tap | None = None
    # Whether a circuit a relay brings is tried as a hole punch (meshd.relay.punch): off, the link
    # stays relayed, as before punching (the tests' baseline).
    punch: bool = True
    # Relays a node behind NAT keeps reservations on.
    reservations: int = 2
    dial_back_timeout: float = 3.0
    # How often a node asks its seeds again where they see it (an address can change: DHCP, roaming).
    address_check_interval: float = 300.0
    peers: PeersConfig = field(default_factory=PeersConfig)
    # the tracker places this long after the first news of a burst
    settle: float = 0.5
    # as tracker, how it times the stages it placed (None: it does not, and believes self-reports
    # up to MAX_SPEEDUP_OVER_MEDIAN)
    probes: ProbeConfig | None = field(default_factory=ProbeConfig)
    rpc_timeout: float = 5.0
    # an old range serves its sessions at most this long after its replacement is up
    retire_timeout: float = 60.0
    # a departing node spreads its goodbye at most this long
    leave_timeout: float = 2.0
    # SWIM messages waiting for the state machine; more are dropped (SWIM is built for loss)
    swim_inbox: int = 256
    # Where the node keeps what it fetches (and a model's manifest when it cannot go beside the file).
    state_dir: Path | None = None
    # Volunteer this model (an id, or a name the mesh knows) without a file: fetch the range assigned.
    model_id: str | None = None
    # Volunteer this hub model (resolved to a commit): fetch the range assigned from members that hold
    # it, and what none holds from the hub.
    hub: HubModel | None = None
    # Disk the fetched layers may fill; None: no limit (what was fetched stays, to serve others).
    disk_bytes: int | None = None
    # How long a node joining by model id waits for a member that holds the model.
    model_wait: float = 600.0
    # A progress bar for the fetches (on a TTY).
    progress: bool = False
    # What serving chunks to other members may cost this node: streams, upload budgets, timeouts.
    upload: SourceConfig = field(default_factory=SourceConfig)
    # how often the credit ledger pulls what it lacks from one member (meshd.client.ledger)
    ledger_interval: float = 30.0


@dataclass
class ServingRange:
    start: int
    end: int
    service: StageService | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


async def rpc(peers: Peers, address: str | None, request: Message, node_id: str | None = None,
              timeout: float = 5.0) -> Message:
    """One request on a fresh mesh stream, one reply; a typed error reply is raised."""
    return await net_rpc.call(peers, address, MESH_PROTOCOL, request, Message, node_id=node_id, timeout=timeout)


class MeshDriver:
    """Runs a `MeshDuty` in trio: feeds it what arrives and the time, sleeps until its next timer,
    and hands on what it sends and asks.

    Transport-agnostic: `send(dest, message)` and `on_event(event)` must not block (start a task,
    or queue); received messages come in through `deliver`. After calling a duty method from
    another task, `poke` the loop so it sends what that queued and looks at the timers again.
    """

    def __init__(self, duty: MeshDuty, send: Callable[[str, SwimMessage], None],
                 on_event: Callable[[DutyEvent], None], inbox: float = 256) -> None:
        self.duty = duty
        self._send = send
        self._on_event = on_event
        self._inbox, self._pending = trio.open_memory_channel[tuple[str, SwimMessage] | None](inbox)
        self._announced = trio.Event()

    def deliver(self, src: str, message: SwimMessage) -> None:
        try:
            self._inbox.send_nowait((src, message))
        except trio.WouldBlock:
            log.debug("SWIM inbox full: dropped a %s from %s", message.type, src[:12])

    def poke(self) -> None:
        try:
            self._inbox.send_nowait(None)
        except trio.WouldBlock:
            pass  # a full inbox wakes the loop anyway

    def flush(self) -> None:
        """Sends what the duty queued and hands on its events."""
        for dest, message in self.duty.messages_to_send():
            self._send(dest, message)
        for event in self.duty.events():
            self._on_event(event)
        if self.duty.left_announced:
            self._announced.set()

    async def run(self) -> None:
        duty = self.duty
        while True:
            deadline = duty.next_timer()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                item = await self._pending.receive()
                # everything already waiting is taken in this pass: one send-out per wakeup
                now = trio.current_time()
                while True:
                    if item is not None:
                        duty.handle_message(now, *item)
                    try:
                        item = self._pending.receive_nowait()
                    except trio.WouldBlock:
                        break
            now = trio.current_time()
            deadline = duty.next_timer()
            if deadline is not None and now >= deadline:
                duty.handle_timer(now)
            self.flush()

    async def leave(self) -> None:
        """Says goodbye and returns once the news is out (`left_announced`); `run` must be running.
        Bound it with a deadline: with every peer gone, nobody takes the news."""
        self.duty.leave(trio.current_time())
        self.flush()
        self.poke()
        await self._announced.wait()


class MeshDaemon:
    def __init__(self, identity: NodeIdentity, config: NodeConfig) -> None:
        self.identity = identity
        self.config = config
        self.peers: Peers
        self.mesh: MeshNode
        self.duty: MeshDuty
        self.driver: MeshDriver | None = None
        self.port = 0
        self.model: ModelInfo | None = None
        # the file the ranges load: the one given, or the sparse one fetched into
        self.model_path: Path | None = None
        self.manifest: Manifest | None = None
        self.sparse: SparseFile | None = None
        # a hub model's files, read by range; and whether chunks of it may come from members (its
        # manifest this node's own, or named by two of them: DESIGN, "Model distribution")
        self.hub: HubReader | None = None
        self._members_vouch = True
        self.fetches: list[FetchStatus] = []
        self.serving: list[ServingRange] = []
        self.retiring: list[ServingRange] = []
        # uploads trickle while this node's stages compute, so chunks served never starve decode
        self.source = ChunkSource(config.upload, busy=activity(self._engine_calls))
        self._seed_addresses: dict[str, str] = {}
        self._nursery: trio.Nursery
        # a traffic report of this node's own asks is on its way to the tracker (`report_traffic`)
        self._traffic_passing = False
        self._sends = 0
        self._sent = trio.Event()
        self._tracker_news = trio.Event()  # set (and replaced) at each change of the tracker followed
        self.relay: RelayService | None = None
        self.puncher: Puncher | None = None
        self._keeper: ReservationKeeper | None = None
        # members whose probes timed them much slower than they say (warned of once each)
        self._slower_than_said: set[str] = set()
        # where fast-path connections meet the sessions of every range this node serves
        self.fast_door = FastDoor()
        self.credit: LedgerKeeper

    # ----- lifecycle

    async def run(self, *, task_status: trio.TaskStatus[MeshDaemon] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        if cfg.model is not None:
            # the model id hashes the manifest, computed once (a progress bar on a TTY) and cached
            self.manifest = await trio.to_thread.run_sync(model_manifest, cfg.model, cfg.state_dir)
            self.model = await trio.to_thread.run_sync(describe_model, cfg.model, self.manifest.model_id)
            check_volunteer(self.model, cfg)
            whole = WholeFile(cfg.model, self.manifest)
            # a split set loads from its first part, whichever part was named
            self.model_path = whole.path
            self.source.offer(whole)
        async with open_peers(self.identity, cfg.peers) as peers, trio.open_nursery() as nursery:
            self.peers, self._nursery = peers, nursery
            peers.handle(SWIM_PROTOCOL, self._on_swim)
            peers.handle(MESH_PROTOCOL, self._on_rpc)
            peers.handle(STAGE_PROTOCOL, self._on_stage)
            peers.handle_fast(self.fast_door.accept)
            register(peers, self.source)
            self.puncher = Puncher(peers, direct_address=self._public_address)
            enable_circuits(peers, self._reserved_on, self.puncher.initiate if cfg.punch else None)
            if cfg.relay:
                self.relay = RelayService(peers, cfg.relay_limits, self._is_member, cfg.relay_tap,
                                          self._has_record)
            self.port = await peers.listen(*cfg.listen)
            roles = ([ROLE_CLIENT] if cfg.client else []) + ([ROLE_RELAY] if cfg.relay else [])
            # A relay is public by its operator's word; others learn it from a seed's dial-back.
            checks = bool(cfg.seeds) and not (cfg.relay or cfg.client)
            # memory is offered for a model's layers: a node with no model to serve (a seed, an asker, a
            # relay) offers none, whatever --memory's default says, and status shows it so
            offers = not cfg.client and (cfg.model is not None or cfg.model_id is not None or cfg.hub is not None)
            record = CapabilityRecord.create(
                self.identity, int(time.time() * 1000), addresses=self._configured_addresses(),
                reachability="unknown" if checks else "public",
                memory_bytes=cfg.memory_bytes if offers else 0, models=[self.model] if self.model else [],
                gpu_memory_bytes=cfg.gpu_memory_bytes if offers else 0, gpu_layers=cfg.gpu_layers if offers else 0,
                kv_tokens=cfg.limits.max_sessions * cfg.limits.max_session_tokens if self.model else 0,
                roles=roles, started_at=time.time())
            self.mesh = MeshNode(self.identity, record, trio.current_time())
            limits = cfg.limits
            self.duty = MeshDuty(self.mesh, DutyConfig(
                volunteer=self.model if not cfg.client else None,
                kv_tokens=limits.max_sessions * limits.max_session_tokens, settle=cfg.settle, probes=cfg.probes))
            self.driver = MeshDriver(self.duty, self._send, self._on_event, cfg.swim_inbox)
            nursery.start_soon(self.driver.run)
            self.credit = LedgerKeeper(self.identity, peers, rpc, self.placed_members, interval=cfg.ledger_interval,
                                       timeout=cfg.rpc_timeout)
            nursery.start_soon(self.credit.run, self._ledger_peers)
            nursery.start_soon(self._weigh_by_credit)
            nursery.start_soon(self._publish_load)
            await self._join_seeds()
            if cfg.seeds and not cfg.client:
                await self._check_reachability()
                nursery.start_soon(self._recheck_address)
            self._keep_relays()
            if cfg.model_id is not None and not cfg.client:
                nursery.start_soon(self._fetch_model, cfg.model_id)
            if cfg.hub is not None and not cfg.client:
                nursery.start_soon(self._hub_model, cfg.hub)
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
        """Says goodbye through gossip: returns once the news is out and sent, or after `leave_timeout`."""
        if self.driver is None:
            return
        with trio.move_on_after(self.config.leave_timeout):
            await self.driver.leave()
            while self._sends:
                await self._sent.wait()
                self._sent = trio.Event()

    # ----- SWIM transport

    def _flush(self) -> None:
        """After a change to the mesh state from outside the driver: send what it queued, look at the timers."""
        if self.driver is not None:
            self.driver.flush()
            self.driver.poke()

    def _on_event(self, event: DutyEvent) -> None:
        if isinstance(event, TrackerChanged):
            log.info("tracker is now %s", event.tracker)
            self._tracker_news.set()
            self._tracker_news = trio.Event()
        elif isinstance(event, AssignmentChanged):
            if event.assignment is None:
                log.warning("model %s cannot be covered: %s", event.model[:12], event.reason)
            else:
                log.info("placed %s on %d nodes", event.model[:12], len(event.assignment.stages))
        elif isinstance(event, RangeRefused):
            log.warning("refused layers [%d, %d): %s", event.start, event.end, event.reason)
        elif isinstance(event, AskAssignment):
            self._nursery.start_soon(self._ask_tracker, event)
        elif isinstance(event, LoadRange):
            self._nursery.start_soon(self._load_range, event)
        elif isinstance(event, StageProbe):
            self._nursery.start_soon(self._probe_stage, event)
        elif isinstance(event, MemberEvent) and self._keeper is not None:
            self._keeper.candidates_changed()  # a member's record came, changed or went: maybe a relay's

    def _send(self, dest: str, message: SwimMessage) -> None:
        self._sends += 1
        self._nursery.start_soon(self._send_swim, dest, message)

    def _engine_calls(self) -> int:
        return sum(r.service.metrics.engine_calls for r in [*self.serving, *self.retiring] if r.service is not None)

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
        # An unspecified address (from an older peer) would dial this very host.
        return next((a for a in record.addresses if not is_unspecified(host_of(a))), None)

    # ----- this node's address, reachability and relays

    @property
    def address(self) -> str:
        """The address this node publishes ("" until it knows one)."""
        return self.mesh.record.addresses[0] if self.mesh.record.addresses else ""

    @property
    def local_address(self) -> str:
        """Where a command on this host reaches the daemon: the listening host, loopback for a wildcard."""
        host = self.config.listen[0]
        if is_unspecified(host):
            host = "::1" if ":" in host else "127.0.0.1"
        return join_address(host, self.port)

    def _configured_addresses(self) -> list[str]:
        """What to publish before any peer has said where it sees this node: --advertise, else the
        listening host if it is one (never 0.0.0.0 or ::, which nobody can dial), else nothing yet."""
        if self.config.advertise:
            return [self.config.advertise]
        host = self.config.listen[0]
        return [] if is_unspecified(host) else [join_address(host, self.port)]

    def _learns_from_peers(self) -> bool:
        # A first node listening on every interface has no seed to ask: the peers that reach it tell it.
        cfg = self.config
        return not cfg.advertise and not cfg.seeds and not cfg.client and is_unspecified(cfg.listen[0])

    def _learn_address(self, peer: str) -> None:
        """Publishes this host's address on the way to `peer` (its route source), when this node has
        no better one: loopback only while no other peer has come, and a non-loopback one is kept."""
        if not self._learns_from_peers():
            return
        current = self.mesh.record.addresses
        if current and not is_loopback(host_of(current[0])):
            return
        source = route_source(host_of(peer))
        if source is None or (current and is_loopback(source)):
            return
        address = join_address(source, self.port)
        log.info("peers reach this node at %s", address)
        self.mesh.update_record(trio.current_time(), addresses=[address])
        self._flush()

    async def _check_reachability(self) -> None:
        """Asks the seeds where they see this node and to dial it back there.

        The address a seed sees (with the listening port) becomes the published
        one once a seed has dialled it; if every seed that answers fails to,
        the node is behind NAT. `--advertise` is checked but never replaced, and
        a relay stays public by its operator's word. Called again from time to
        time: a changed address is published only with its own dial-back.
        """
        cfg = self.config
        request = DialBackRequest(address=cfg.advertise) if cfg.advertise else DialBackRequest(port=self.port)
        verdicts: list[bool] = []
        seen: Counter[str] = Counter()
        for node_id, address in self._seed_addresses.items():
            try:
                reply = await rpc(self.peers, address, request, node_id, cfg.dial_back_timeout + 2.0)
            except ProtocolError as exc:
                log.info("seed %s did not dial back: %s", address, exc)
                continue
            if not isinstance(reply, DialBackReply):
                continue
            verdicts.append(reply.reachable)
            if not reply.reachable:
                log.info("seed %s cannot dial this node: %s", address, reply.detail)
                continue
            observed = observed_address(reply.observed, self.port, host_of(address))
            if observed is not None:
                seen[observed] += 1
        if not verdicts:
            return
        changes: dict[str, object] = {}
        if not cfg.relay:
            changes["reachability"] = "public" if any(verdicts) else "nat"
        elif not any(verdicts):
            log.warning("no seed can dial this relay at %s: members behind NAT cannot use it",
                        self.address or f"port {self.port}")
        if seen and not cfg.advertise:
            # The address most seeds agree on: one seed alone cannot move a node that others see elsewhere.
            changes["addresses"] = [seen.most_common(1)[0][0]]
        record = self.mesh.record
        changes = {k: v for k, v in changes.items() if getattr(record, k) != v}
        if changes:
            log.info("published %s", ", ".join(f"{k} {v}" for k, v in changes.items()))
            self.mesh.update_record(trio.current_time(), **changes)
            self._flush()

    async def _recheck_address(self) -> None:
        while True:
            await trio.sleep(self.config.address_check_interval)
            await self._check_reachability()
            self._keep_relays()

    def _keep_relays(self) -> None:
        """Behind NAT, keeps reservations on relays (started once, the first time NAT is found)."""
        if self.mesh.record.reachability != "nat" or self._keeper is not None:
            return
        self._keeper = ReservationKeeper(self.peers, self._relay_candidates, self._publish_relays,
                                         want=self.config.reservations)
        self._nursery.start_soon(self._keeper.run)

    async def _dial_back(self, stream: Stream, request: DialBackRequest) -> DialBackReply:
        # As libp2p's AutoNAT: only the host the request comes from, so nobody can aim us at a third party.
        observed = host_of(stream.link.address)
        if not is_ip(observed):
            return DialBackReply(reachable=False, detail="this link has no IP address to dial back")
        if request.port is not None:
            host, port = observed, request.port
        else:
            parts = split_address(request.address or "")
            if parts is None or parts[0] != observed:
                return DialBackReply(reachable=False, observed=observed,
                                     detail=f"{request.address} is not where you dial from ({observed})")
            host, port = parts
        target = join_address(host, port)
        with trio.move_on_after(self.config.dial_back_timeout):
            try:
                connection = await trio.open_tcp_stream(host, port)
            except OSError as exc:
                return DialBackReply(reachable=False, observed=observed,
                                     detail=f"cannot connect to {target}: {exc.strerror}")
            await connection.aclose()
            return DialBackReply(reachable=True, observed=observed)
        return DialBackReply(reachable=False, observed=observed, detail=f"connecting to {target} timed out")

    def _is_member(self, node_id: str) -> bool:
        """A live member this node has itself probed (a round trip measured): a record planted by
        someone's Sync, of a node nobody here has heard from, does not count."""
        membership = self.mesh.membership
        live = any(r.node_id == node_id for r in membership.live_records())
        return live and membership.rtt(node_id) is not None

    def _public_address(self, node_id: str) -> str | None:
        """Where a member that says it is public can be dialed (its signed record's first address)."""
        record = self.mesh.membership.record_of(node_id)
        if record is None or record.reachability != "public":
            return None
        return next((a for a in record.addresses if not is_unspecified(host_of(a))), None)

    def _has_record(self, node_id: str) -> bool:
        """A live member by its record (a light client such as `meshd ask` has none)."""
        return self.mesh.membership.record_of(node_id) is not None and \
            any(r.node_id == node_id for r in self.mesh.membership.live_records())

    def _relay_candidates(self) -> list[RelayCandidate]:
        records = [r for r in self.live_records() if ROLE_RELAY in r.roles and r.node_id != self.mesh.node_id
                   and r.reachability == "public" and r.addresses]
        return [RelayCandidate(r.node_id, r.addresses[0]) for r in sorted(records, key=lambda r: r.node_id)]

    def _publish_relays(self, addresses: list[str]) -> None:
        log.info("reachable through %s", ", ".join(addresses) or "no relay")
        self.mesh.update_record(trio.current_time(), relay_addresses=addresses)
        self._flush()

    async def _send_swim(self, dest: str, message: Message) -> None:
        try:
            # A node that has not learned its address yet is still reached over the link it dialled.
            address = self.address_of(dest)
            if address is None and self.peers.link_to(dest) is None:
                return
            with trio.move_on_after(1.0):
                try:
                    stream = await self.peers.open_stream(address, SWIM_PROTOCOL, node_id=dest)
                    async with stream:
                        await stream.send_message(fit_for_peer(message, host_of(stream.link.address)))
                except ProtocolError:
                    pass
        finally:
            self._sends -= 1
            if not self._sends:
                self._sent.set()

    async def _on_swim(self, stream: Stream) -> None:
        self._learn_address(stream.link.address)
        message = await stream.receive_message()
        if not isinstance(message, SWIM_MESSAGES):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{message.type!r} is not a SWIM message")
        if self.driver is not None:
            self.driver.deliver(stream.remote_node_id, message)

    # ----- RPCs

    async def _on_rpc(self, stream: Stream) -> None:
        self._learn_address(stream.link.address)
        await answer_typed(stream, self._answer)

    async def _answer(self, stream: Stream, request: Message) -> None:
        if self.driver is None:
            raise ProtocolError(ErrorCode.OVERLOADED, "this node is still starting", retry_after_ms=500)
        peer = host_of(stream.link.address)
        if isinstance(request, AssignmentRequest):
            await self._votes_for_own_claim()
            reply: Message = self.duty.assignment_for(stream.remote_node_id)
        elif isinstance(request, RouteRequest):
            reply = await self.planned_route(request.model, request.exclude, peer)
        elif isinstance(request, StatusRequest):
            reply = await self.measured_status(peer, request.offset)
        elif isinstance(request, SpeedsRequest):
            reply = self.duty.speed_view()
        elif isinstance(request, DialBackRequest):
            reply = await self._dial_back(stream, request)
        elif isinstance(request, ProofGossip):
            reply = self.take_proof(request.proof, stream.remote_node_id)
        elif isinstance(request, TrafficReport):
            reply = self.duty.traffic_report(trio.current_time(), stream.remote_node_id, request)
        elif isinstance(request, CreditsRequest):
            reply = self.credits(request.offset)
        elif (answered := self.credit.answer(request)) is not None:
            reply = answered
        else:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown mesh request {request.type!r}")
        await stream.send_message(reply)

    async def _votes_for_own_claim(self) -> None:
        """While this node claims the tracker role without seeing the claim carried, waits (at most
        `CLAIM_WAIT`) for the votes: an asker that voted for it asks before its vote gets here, and
        was refused with "not the tracker" in every fresh mesh."""
        with trio.move_on_after(CLAIM_WAIT):
            while self.duty.awaiting_votes:
                await self._tracker_news.wait()

    def take_proof(self, proof: Proof, sender: str | None = None) -> ProofAccepted:
        """A proof that a node lied: checked here before anything is done with it; if its culprit is
        news, it is kept out of routes (and, as tracker, placements) and passed on to a few members,
        each of which checks it again (a node passes each culprit on once, so the flood ends)."""
        try:
            culprit = self.duty.accept_proof(trio.current_time(), proof)
        except InvalidProof as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"the proof does not hold: {exc}") from None
        if culprit is not None:
            log.warning("node %s is proven to lie; kept out of routes", culprit[:16])
            for node_id in self._proof_targets(sender, culprit):
                self._nursery.start_soon(self._pass_proof, node_id, proof)
        return ProofAccepted(culprit=proof.culprit.node_id, news=culprit is not None)

    def _proof_targets(self, sender: str | None, culprit: str) -> list[str]:
        """Who a proof that is news goes on to: the tracker always (it places and plans every route,
        so the liar leaves them mesh-wide at once), and `PROOF_FANOUT` members this node has itself
        heard from (a record planted by a Sync, or one of a member gone quiet, takes no share)."""
        skip = {self.duty.node_id, sender, culprit}
        tracker = self.mesh.tracker
        first = [tracker.node_id] if tracker is not None and tracker.node_id not in skip else []
        membership = self.mesh.membership
        others = [r.node_id for r in self.live_records()
                  if r.node_id not in skip and r.node_id not in first and membership.rtt(r.node_id) is not None]
        return first + random.sample(others, min(PROOF_FANOUT, len(others)))

    async def _pass_proof(self, node_id: str, proof: Proof) -> None:
        try:
            await rpc(self.peers, None, ProofGossip(proof=proof), node_id=node_id)
        except ProtocolError as exc:
            log.info("passing a proof to %s: %s", node_id[:16], exc)

    # ----- credit (meshd.mesh.credit)

    def placed_members(self) -> set[str]:
        """The members whose placement by a tracker this node followed their records carry, and those
        trackers: whose asks pay credit whatever they hold (meshd.mesh.credit)."""
        followed = self.mesh.election.followed
        placed = {r.node_id for r in self.live_records() if placement_of(r, followed) is not None}
        return placed | {node_id for _, node_id in followed}

    async def _weigh_by_credit(self) -> None:
        """Every `CREDIT_VOTES_EVERY`, gives each placed member the extra votes its served work earns it in
        the election (meshd.mesh.credit.extra_votes of what it earned: the work it served members who pay,
        not less what it asked, as authority goes by work served): rarely, as ledgers agree a round or two late."""
        while True:
            await trio.sleep(CREDIT_VOTES_EVERY)
            placed = self.placed_members()
            extra = {node_id: votes for node_id, standing in self.credit.standing().items()
                     if node_id in placed and (votes := extra_votes(standing.earned))}
            self.duty.credit_weights(trio.current_time(), extra)
            self._flush()

    async def _publish_load(self) -> None:
        """Every `LOAD_EVERY`, the busiest of this member's stages as its record's load, when it changed."""
        while True:
            await trio.sleep(LOAD_EVERY)
            load = max((s.service.books.load for s in self.serving if s.service is not None), default=0.0)
            if load != self.mesh.record.load:
                self.mesh.update_record(trio.current_time(), load=load)
                self._flush()

    def _ledger_peers(self) -> list[tuple[str, str | None]]:
        membership = self.mesh.membership
        return [(r.node_id, self.dial_address(r)) for r in self.live_records()
                if r.node_id != self.mesh.node_id and membership.rtt(r.node_id) is not None]

    def voucher(self, opener: str) -> Voucher:
        """Lets `opener` (an identity of this member's own commands) ask on this member's credit."""
        return self.credit.voucher(opener)

    def countersign(self, served: list[Served]) -> int:
        """Countersigns what each stage of an ask made for this member served, and gives it to the stage."""
        return len(self.credit.countersign(self._nursery, served, self.address_of))

    def credits(self, offset: int = 0) -> CreditsReply:
        """This node's ledger: its own standing and every member's (a page from `offset`), for `meshd credits`."""
        me = self.mesh.node_id
        standing = self.credit.standing()
        between = self.credit.ledger.between(me, time.time())
        members = sorted(set(standing) | set(between) | {me})

        def line(node_id: str) -> PeerCredit:
            held = standing.get(node_id)
            served, asked = between.get(node_id, (0.0, 0.0))
            return PeerCredit(node_id=node_id, balance=held.balance if held else 0.0,
                              earned=held.earned if held else 0.0, spent=held.spent if held else 0.0,
                              served_us=served, asked_us=asked, placed=bool(held and held.placed))

        others = [m for m in members if m != me]
        return CreditsReply(node_id=me, own=line(me), members=[line(m) for m in others[offset:offset + CREDITS_PAGE]],
                            total_members=len(others), summaries=len(self.credit.ledger), root=self.credit.ledger.root,
                            floor=NEWCOMER_FLOOR)

    def live_records(self) -> list[CapabilityRecord]:
        return self.mesh.membership.live_records()

    def _reserved_on(self, relay: str) -> bool:
        return self._keeper is not None and self._keeper.reserved_on(relay)

    def may_dial(self, ref: PeerRef) -> None:
        """A stage dials for a session only a live member, at an address its signed record names."""
        if ref.node_id is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a stage dials only a member named by its node id")
        record = next((r for r in self.live_records() if r.node_id == ref.node_id), None)
        if record is None:
            # retryable: gossip may not have brought the record here yet
            raise ProtocolError(ErrorCode.UNREACHABLE, f"node {ref.node_id[:16]} is not a live member here")
        if ref.address not in (*record.addresses, *record.relay_addresses):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, f"{ref.address} is not an address node "
                                                        f"{ref.node_id[:16]} signed")

    def route(self, model: str | None, exclude: list[str] | tuple[str, ...] = (),
              peer: str | None = None) -> RouteReply:
        """A route for `model`; with `peer` (the asker's host), only through nodes it may be told of."""
        return self.duty.route(model, exclude, self.dial_address,
                               None if peer is None else lambda record: record_fits(record, peer))

    async def planned_route(self, model: str | None, exclude: list[str] | tuple[str, ...] = (),
                            peer: str | None = None) -> RouteReply:
        """A route planned by the tracker, the one node that knows which ranges it placed where.

        Any other node's records say only what each member claims to serve: a member signing
        every layer at a made-up speed would win a route planned from them. So a node that is not
        the tracker asks the tracker and hands on its route, with each stage's address as this
        node dials it (and, with `peer`, only members that asker may be told of). With no tracker
        known, or none reachable, it plans from its own records, as before a tracker is elected.
        """
        tracker = self.mesh.tracker
        address = None if tracker is None or tracker.node_id == self.mesh.node_id else self.address_of(tracker.node_id)
        if tracker is None or address is None:
            return self.route(model, exclude, peer)
        request = RouteRequest(model=model, exclude=list(exclude))
        try:
            reply = await rpc(self.peers, address, request, tracker.node_id, self.config.rpc_timeout)
        except ProtocolError as exc:
            if exc.code in (ErrorCode.NOT_FOUND, ErrorCode.BAD_REQUEST):
                raise  # the tracker's answer: no route, or no such model
            log.info("tracker %s gave no route: %s; planning from this node's records", tracker.node_id[:12], exc)
            return self.route(model, exclude, peer)
        if not isinstance(reply, RouteReply):
            raise ProtocolError(ErrorCode.INTERNAL, f"the tracker answered a route request with {reply.type!r}")
        stages = []
        for stage in reply.stages:
            record = self.mesh.membership.record_of(stage.node_id)
            dial = None if record is None else self.dial_address(record)
            if record is None or dial is None or (peer is not None and not record_fits(record, peer)):
                raise ProtocolError(ErrorCode.UNREACHABLE, f"no address to dial {stage.node_id[:12]} from here",
                                    retry_after_ms=1000)
            stages.append(stage.model_copy(update={"address": dial}))
        return reply.model_copy(update={"stages": stages})

    def status(self, peer: str | None = None, offset: int = 0) -> StatusReply:
        """The mesh as this node sees it, from member `offset` on; with `peer` (the asker's host), only
        addresses it may be told."""
        reply = self.duty.status(None if peer is None else lambda address: address_fits(address, peer), offset)
        update: dict[str, object] = {"fetches": self.fetches[-8:]} if self.fetches else {}
        if not offset:
            update["links"] = [LinkStatus(node_id=link.remote_node_id, path=link.path,
                                          address=link.address if peer is None or address_fits(link.address, peer)
                                          else "", rtt_ms=None if link.rtt is None else link.rtt * 1000.0)
                               for link in sorted(self.peers.links, key=lambda link: link.remote_node_id)
                               [:STATUS_PAGE]]
        if self.relay is not None:
            update["relayed_bytes"] = self.relay.forwarded_bytes
        return reply.model_copy(update=update) if update else reply

    def report_traffic(self, report: TrafficReport) -> TrafficTaken:
        """What this node's own asker saw of a route (meshd.mesh.traffic), as this member's report:
        taken here where this node is the tracker (first-hand), else passed on in the background (the
        asker's answer is done; it does not wait on the tracker), one report at a time (the rest dropped)."""
        tracker = self.mesh.tracker
        if tracker is not None and tracker.node_id == self.mesh.node_id:
            return self.duty.traffic_report(trio.current_time(), self.mesh.node_id, report)
        address = None if tracker is None else self.address_of(tracker.node_id)
        if tracker is None or address is None:
            return TrafficTaken(taken=False, reason="no tracker to report to")
        if self._traffic_passing:
            return TrafficTaken(taken=False, reason="a report is on its way to the tracker already")
        self._traffic_passing = True
        self._nursery.start_soon(self._pass_traffic, address, tracker.node_id, report)
        return TrafficTaken(taken=True, reason="passed on to the tracker")

    async def _pass_traffic(self, address: str, tracker: str, report: TrafficReport) -> None:
        try:
            reply = await rpc(self.peers, address, report, tracker, self.config.rpc_timeout)
            if isinstance(reply, TrafficTaken) and not reply.taken:
                log.debug("the tracker did not count a traffic report: %s", reply.reason)
        except ProtocolError as exc:
            log.info("passing a traffic report to the tracker %s: %s", tracker[:16], exc)
        finally:
            self._traffic_passing = False

    async def measured_status(self, peer: str | None = None, offset: int = 0) -> StatusReply:
        """`status`, with (on the first page) the stage speeds routes count as `stage_speeds` gives them."""
        reply = self.status(peer, offset)
        if offset:
            return reply
        speeds = await self.stage_speeds()
        return reply.model_copy(update={"speeds": speeds.speeds, "speeds_by": speeds.by})

    async def stage_speeds(self) -> SpeedsReply:
        """The stage speeds routes count and where each came from, as the tracker counts them (it
        plans every route and is the one that times stages); this node's own where no tracker is
        known or it does not answer (then every figure is a default or a member's word against itself)."""
        tracker = self.mesh.tracker
        address = None if tracker is None or tracker.node_id == self.mesh.node_id else self.address_of(tracker.node_id)
        if tracker is None or address is None:
            return self.duty.speed_view()
        try:
            reply = await rpc(self.peers, address, SpeedsRequest(), tracker.node_id,
                              min(SPEEDS_TIMEOUT, self.config.rpc_timeout))
        except ProtocolError as exc:
            log.info("tracker %s gave no stage speeds: %s", tracker.node_id[:12], exc)
            return self.duty.speed_view()
        if not isinstance(reply, SpeedsReply) or reply.by != tracker.node_id:
            log.info("tracker %s answered a speeds request with %s", tracker.node_id[:12], reply.type)
            return self.duty.speed_view()
        return reply

    # ----- the tracker's probes, carried out

    async def _probe_stage(self, probe: StageProbe) -> None:
        """Times a stage this tracker placed (meshd.mesh.probes): routes believe no member faster."""
        address = self.address_of(probe.node_id)
        config = self.duty.prober.config if self.duty.prober is not None else None
        result = None
        if address is not None and config is not None:
            try:
                result = await probe_stage(self.peers, address, probe, config)
            except OSError as exc:
                log.info("probing %s: %s", probe.node_id[:12], exc)
        self.duty.probe_finished(trio.current_time(), probe, result)
        self._flush()
        record, timed = self.mesh.membership.record_of(probe.node_id), self.duty.speeds.measured(probe.node_id)
        if result is not None and record is not None and timed is not None and record.seconds_per_layer \
                and timed > 2 * record.seconds_per_layer and probe.node_id not in self._slower_than_said:
            # said once per node (the set is bounded as the members are): it is worth an operator's look
            if len(self._slower_than_said) < 4096:
                self._slower_than_said.add(probe.node_id)
            log.warning("node %s says it computes a layer in %.3g s, timed at %.3g s: routes count the time",
                        probe.node_id[:16], record.seconds_per_layer, timed)

    # ----- the volunteer's duty, carried out

    async def _ask_tracker(self, ask: AskAssignment) -> None:
        reply = None
        address = self.address_of(ask.tracker.node_id)
        if address is not None:
            try:
                got = await rpc(self.peers, address, AssignmentRequest(), ask.tracker.node_id,
                                self.config.rpc_timeout)
            except ProtocolError as exc:
                log.info("tracker %s did not say our range: %s", ask.tracker.node_id[:12], exc)
            else:
                if isinstance(got, AssignmentReply):
                    reply = got
        self.duty.assignment_reply(trio.current_time(), reply)
        self._flush()

    async def _load_range(self, load: LoadRange) -> None:
        """Fetches the new range's tensors if this node fetches its model, loads the range beside the
        old ones; once it serves, the old ones retire."""
        serving = ServingRange(load.start, load.end)
        try:
            if self.sparse is not None:
                await self._fetch_range(load.start, load.end)
            await self._nursery.start(self._run_range, serving)
        except Exception as exc:
            # the worker's own reason (a stale library, a bad file), not the nursery's wrapper
            reason = first_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
            log.warning("cannot serve layers [%d, %d): %s", load.start, load.end, reason)
            self.duty.range_failed(trio.current_time(), load.start, load.end)
            self._flush()
            return
        old, self.serving = self.serving, [serving]
        self.duty.range_loaded(trio.current_time(), load.start, load.end)
        report = serving.service.report if serving.service is not None else None
        if report is not None and (report.numerics, report.offloaded[:256]) != (self.mesh.record.numerics,
                                                                          self.mesh.record.offload):
            # the tracker names replicas of one numerics with each stage of a route; members show
            # what each offloaded, and where
            self.mesh.update_record(trio.current_time(), numerics=report.numerics, offload=report.offloaded[:256])
        self._flush()
        for previous in old:
            self.retiring.append(previous)
            self._nursery.start_soon(self._retire, previous)

    async def _run_range(self, serving: ServingRange, *, task_status: trio.TaskStatus[None]) -> None:
        cfg, limits = self.config, self.config.limits
        assert self.model is not None and self.model_path is not None
        spec = WorkerSpec(self.model_path, None if (serving.start, serving.end) == (0, self.model.n_layers)
                          else (serving.start, serving.end),
                          n_ctx=limits.max_sessions * limits.max_session_tokens, n_seq_max=limits.max_sessions,
                          n_batch=limits.n_batch, threads=cfg.threads, gpu_layers=cfg.gpu_layers)
        engine = EngineSupervisor(spec)
        with serving.scope:
            async with trio.open_nursery() as nursery:
                report = await nursery.start(engine.run)
                service = StageService(self.peers, engine, report, self.model.digest, self.model.name, limits,
                                       may_dial=self.may_dial, door=self.fast_door,
                                       credit_of=self.credit.credit_of)
                engine.on_event = service.on_engine_event

                def down(generation: int, reason: str) -> None:
                    service.on_worker_down(generation, reason)
                    self.duty.range_down(trio.current_time(), serving.start, serving.end)
                    self._flush()

                def up(generation: int) -> None:
                    self.duty.range_up(trio.current_time(), serving.start, serving.end)
                    self._flush()

                def gone(reason: str) -> None:
                    assert self.model is not None
                    log.error("layers [%d, %d) of %s withdrawn: %s", serving.start, serving.end, self.model.name,
                              reason)
                    self.duty.range_gone(trio.current_time(), serving.start, serving.end)
                    self._flush()

                engine.on_down, engine.on_up, engine.on_gone = down, up, gone
                await nursery.start(service.run)
                serving.service = service
                task_status.started()

    async def _retire(self, serving: ServingRange) -> None:
        """Lets the old range finish the sessions it holds (at most `retire_timeout`), then unloads it."""
        if serving.service is not None:
            with trio.move_on_after(self.config.retire_timeout):
                await serving.service.wait_idle()
        serving.scope.cancel()
        self.retiring.remove(serving)
        if self.sparse is not None:
            await self._trim_disk()

    # ----- a model fetched range by range

    def _sources(self, digest: str) -> list[SourceRef]:
        """The other live members that hold some layers of `digest` on disk, whole files first."""
        found = []
        for record in self.live_records():
            held = held_ranges(record, digest)
            address = self.dial_address(record)
            if record.node_id != self.mesh.node_id and held and not record.leaving and address is not None:
                info = record.model(digest)
                found.append((not (info is not None and info.whole), record.node_id, address))
        return [SourceRef(address, node_id) for _, node_id, address in sorted(found)]

    def _resolve(self, wanted: str) -> str | None:
        """The id of the model `wanted` names (an id, or a name the mesh knows: a model's own or its file's),
        once a member holds it."""
        models = held_models(r for r in self.live_records() if r.node_id != self.mesh.node_id)
        # An id names one model whatever others are named (a member may name its model anything, an
        # id included); a name shared by several names none, and the error lists every id in full,
        # for the user to give one (a shortened id matched nothing and waited out model_wait).
        ids = [wanted.lower()] if wanted.lower() in models else sorted(
            d for d, info in models.items() if info.known_as(wanted))
        if len(ids) > 1:
            raise ModelNotFound(f"'{wanted}' names {len(ids)} models of the mesh: {', '.join(ids)}; "
                                "give --model-id with the id of one (meshd models lists them)")
        return ids[0] if ids and self._sources(ids[0]) else None

    async def _fetch_model(self, wanted: str) -> None:
        """Learns the model from its holders (manifest, header), then volunteers it."""
        cfg = self.config
        assert cfg.state_dir is not None, "a node that fetches needs a state directory"
        digest = None
        with trio.move_on_after(cfg.model_wait):
            for waited in range(math.ceil(cfg.model_wait) + 1):
                if (digest := self._resolve(wanted)) is not None:
                    break
                if waited == 10:
                    log.warning("no member holds model '%s' yet; waiting up to %g s for one (meshd models lists "
                                "what the mesh has)", wanted, cfg.model_wait)
                await trio.sleep(1.0)
        if digest is None:
            raise ModelNotFound(f"no member of the mesh holds model '{wanted}' (waited {cfg.model_wait:g} s); "
                                "meshd models lists what it has")
        manifest = None
        with trio.move_on_after(cfg.model_wait):
            while manifest is None:
                try:
                    manifest = await fetch_manifest(self.peers, self._sources(digest), digest)
                except ProtocolError as exc:
                    log.info("no manifest of %s yet: %s", digest[:12], exc)
                    await trio.sleep(1.0)
        if manifest is None:
            raise ModelNotFound(f"no member sent the manifest of model {digest[:16]} (waited {cfg.model_wait:g} s)")
        known = held_models(r for r in self.live_records() if r.node_id != self.mesh.node_id).get(digest)
        await self._volunteer_fetched(manifest, known.file if known is not None else "")

    async def _volunteer_fetched(self, manifest: Manifest, file: str, hub: str = "") -> None:
        """Opens the sparse file of `manifest`, fetches its header, and volunteers the model as `file` (fetched
        from members, and from the `hub` file it names)."""
        cfg = self.config
        assert cfg.state_dir is not None, "a node that fetches needs a state directory"
        digest = manifest.model_id
        path = cfg.state_dir / "models" / f"{digest}.gguf"
        sparse = await trio.to_thread.run_sync(SparseFile.open, path, manifest)
        self.manifest, self.sparse, self.model_path = manifest, sparse, sparse.path
        # a holder that is busy, restarting or gone for a moment is no reason to give up (the node
        # would exit): the header is asked for again, like the manifest, for up to model_wait
        failure: Exception | str = "no member answered"
        fetched = False
        with trio.move_on_after(cfg.model_wait):
            while not fetched:
                try:
                    await self._fetch(digest, manifest.header_chunks_list(), "header", 0, 0)
                    fetched = True
                except (FetchFailed, ProtocolError) as exc:
                    failure = exc
                    log.info("no header of %s yet: %s", digest[:12], exc)
                    await trio.sleep(1.0)
        if not fetched:
            raise ModelNotFound(f"cannot fetch the header of model {digest[:16]} (waited {cfg.model_wait:g} s): "
                                f"{failure}")
        # the sparse file is named by the id: the model keeps the file name its holders know it by
        info = (await trio.to_thread.run_sync(describe_model, sparse.path, digest)).model_copy(
            update={"whole": False, "file": file, "hub": hub})
        check_volunteer(info, cfg)
        self.model = info
        self.source.offer(sparse)
        limits, now = cfg.limits, trio.current_time()
        self.mesh.update_record(now, models=[info], kv_tokens=limits.max_sessions * limits.max_session_tokens)
        self.duty.volunteer(now, info)
        self.duty.held(now, self._held())
        self._flush()
        log.info("volunteering %s (%s), fetching the layers assigned", info.name, digest[:12])

    def _held(self) -> list[HeldRange]:
        """What the sparse file holds verified, as layer ranges (what fetchers may ask this node for)."""
        assert self.sparse is not None and self.model is not None and self.manifest is not None
        ranges = held_layer_ranges(self.manifest, self.model.n_layers, self.sparse.has)
        return [HeldRange(model=self.manifest.model_id, start=a, end=b) for a, b in ranges[:MAX_HELD]]

    async def _fetch_range(self, start: int, end: int) -> None:
        """Fetches the tensors of layers [start, end) the sparse file lacks (a re-assignment: only the
        difference), within the disk budget, and publishes what it then holds."""
        assert self.sparse is not None and self.manifest is not None and self.model is not None
        chunks = range_chunks(self.manifest, self.model.n_layers, start, end)
        await self._trim_disk(keep=chunks)
        await self._fetch(self.manifest.model_id, chunks, "layers", start, end)
        self.duty.held(trio.current_time(), self._held())
        self._flush()

    async def _fetch(self, digest: str, chunks: list[Chunk], what: str, start: int, end: int) -> None:
        assert self.sparse is not None and self.model_path is not None
        # before the header is here the model is known by what the user named it
        name = self.model.name if self.model is not None else (self.config.model_id or digest)
        status = FetchStatus(model=digest, name=name[:256], start=start, end=end, done_bytes=0,
                             total_bytes=sum(c.size for c in chunks), rate=0.0)
        self.fetches = [*self.fetches[-7:], status]
        index = len(self.fetches) - 1
        bar: Any = tqdm(total=status.total_bytes, unit="B", unit_scale=True, file=sys.stderr,
                        desc=f"fetch {what} [{start}, {end})" if end else f"fetch {what}",
                        disable=not self.config.progress, leave=False)

        def progress(p: FetchProgress) -> None:
            bar.update(p.done_bytes - bar.n)
            self.fetches[index] = status.model_copy(update={
                "done_bytes": p.done_bytes, "total_bytes": p.total_bytes, "fetched_bytes": p.fetched_bytes,
                "rate": max(0.0, p.rate), "sources": p.sources})

        t0 = time.monotonic()
        try:
            with bar:
                report = await self._fetch_chunks(digest, chunks, progress)
        except (FetchFailed, ProtocolError, OSError) as exc:
            self.fetches[index] = self.fetches[index].model_copy(update={"state": f"failed: {exc}"[:256]})
            raise
        done = self.fetches[index].model_copy(update={"state": "done", "done_bytes": status.total_bytes,
                                                      "fetched_bytes": report.fetched_bytes})
        self.fetches[index] = done
        log.info("fetched %s: %d bytes over the network, %d already here, in %.1f s",
                 f"{what} [{start}, {end})" if end else what, report.fetched_bytes, report.reused_bytes,
                 time.monotonic() - t0)

    async def _fetch_chunks(self, digest: str, chunks: list[Chunk], progress: Callable[[FetchProgress], None]
                            ) -> FetchReport:
        """From the members that hold them; for a hub model, what none of them holds (or every chunk, while
        its manifest is one member's word alone) from the hub."""
        assert self.sparse is not None
        if self.hub is None:
            return await fetch_chunks(self.peers, self._sources(digest), self.sparse, chunks, progress=progress)
        missing = self.sparse.missing(chunks)
        report = FetchReport(chunks=len(chunks), reused_bytes=sum(c.size for c in chunks) - sum(c.size for c in missing))
        sources = self._sources(digest) if self._members_vouch else []
        held = self._held_by_members(digest) if sources else set()
        # members preferred, asked only for what their records say they hold: a fetch from them ends as
        # soon as a chunk is held by none (the rest would wait on it); the hub has what they lack
        parts: list[FetchReport] = []
        if any(c.index in held for c in missing):
            try:
                parts.append(await fetch_chunks(self.peers, sources, self.sparse,
                                                [c for c in missing if c.index in held], progress=progress))
            except FetchFailed as exc:
                parts.append(exc.report)
        parts.append(await fetch_from_hub(self.hub, self.sparse, self.sparse.missing(missing), progress=progress))
        for part in parts:
            report.fetched_chunks += part.fetched_chunks
            report.fetched_bytes += part.fetched_bytes
            for key, n in part.by_source.items():
                report.by_source[key] = report.by_source.get(key, 0) + n
            report.excluded.update(part.excluded)
            report.lost.update(part.lost)
        return report

    def _held_by_members(self, digest: str) -> set[int]:
        """The chunks of `digest` other live members' records say they hold (the header's with any layer)."""
        assert self.manifest is not None
        held: set[int] = set()
        for record in self.live_records():
            if record.node_id == self.mesh.node_id or record.leaving:
                continue
            for start, end in held_ranges(record, digest):
                if self.model is None:
                    held.update(c.index for c in self.manifest.header_chunks_list())
                else:
                    held.update(c.index for c in range_chunks(self.manifest, self.model.n_layers, start, end))
        return held

    async def _hub_model(self, model: HubModel) -> None:
        """Learns a hub model's manifest (a member's, bound to the hub's files, or its own from the whole
        files, once), then volunteers it like a model fetched from members."""
        cfg = self.config
        assert cfg.state_dir is not None, "a node that fetches needs a state directory"
        reader = HubReader(model)
        try:
            await trio.to_thread.run_sync(reader.check)
            manifest = await trio.to_thread.run_sync(cached_manifest, cfg.state_dir, model)
            # a member's record may come a moment after the seeds answer: a whole read is worth waiting for
            with trio.move_on_after(HUB_GOSSIP_WAIT if cfg.seeds else 0):
                while manifest is None:
                    manifest = await self._member_manifest(reader)
                    if manifest is None:
                        await trio.sleep(1.0)
            if manifest is None:
                log.info("no member offers %s of %s: reading its %d bytes once to build its manifest", model.name,
                         model.where, sum(f.size for f in model.files))
                bar: Any = tqdm(total=sum(f.size for f in model.files), unit="B", unit_scale=True, file=sys.stderr,
                                desc=f"hashing {model.name}", disable=not cfg.progress, leave=False)
                started = time.monotonic()
                with bar:
                    manifest = await trio.to_thread.run_sync(hash_model, reader, CHUNK_SIZE, bar.update,
                                                             abandon_on_cancel=True)
                took = time.monotonic() - started
                log.info("read and checked %d bytes of %s in %.1f s (%.1f MB/s) to build its manifest",
                         reader.read_bytes, model.name, took, reader.read_bytes / max(took, 1e-9) / 1e6)
                await trio.to_thread.run_sync(remember_manifest, cfg.state_dir, model, manifest)
        except HubError as exc:
            raise ModelNotFound(str(exc)) from None
        self.hub = reader
        log.info("%s of %s is model %s", model.name, model.where, manifest.model_id[:16])
        await self._volunteer_fetched(manifest, Path(model.name).stem, f"hf:{model.repo}@{model.commit}")

    async def _member_manifest(self, reader: HubReader) -> Manifest | None:
        """The manifest of the hub model a member offers under its file name, once its sizes and headers are
        the hub's at the pinned commit. Its tensors' hashes are the member's word: chunks come from members
        only when a second one, at another address, names the same model (else from the hub, each checked
        against it). Addresses, not identities: identities cost nothing to make."""
        # as a model's record names its file: the file's (or set's) name less .gguf
        name = Path(reader.model.name).stem
        offered: dict[str, list[SourceRef]] = {}
        for record in self.live_records():
            address = self.dial_address(record)
            if record.node_id == self.mesh.node_id or record.leaving or address is None:
                continue
            for info in record.models:
                if info.file == name:
                    # a member fetching its range serves the manifest (and what it holds) before any layer
                    offered.setdefault(info.digest, []).append(SourceRef(address, record.node_id))
        for digest, holders in sorted(offered.items(), key=lambda item: -len(item[1])):
            try:
                manifest = await fetch_manifest(self.peers, holders, digest)
                await trio.to_thread.run_sync(check_binding, reader, manifest)
            except (ProtocolError, HubError) as exc:
                log.warning("model %s, offered as %s, is not %s of %s: %s", digest[:16], name, reader.model.name,
                            reader.model.where, exc)
                continue
            self._members_vouch = len({source_group(host_of(ref.address or "")) for ref in holders}) >= 2
            return manifest
        return None

    async def _trim_disk(self, keep: list[Chunk] | None = None) -> None:
        """Under a disk budget: drops (punches) the chunks of tensors that no range loaded or about to be
        loaded (`keep`) reads, once their bytes plus what is still to fetch exceed the budget."""
        budget, sparse, manifest, model = self.config.disk_bytes, self.sparse, self.manifest, self.model
        if budget is None or sparse is None or manifest is None or model is None:
            return
        needed = {c.index for c in keep or ()}
        for r in [*self.serving, *self.retiring]:
            needed.update(c.index for c in range_chunks(manifest, model.n_layers, r.start, r.end))
        missing = sum(c.size for c in keep or () if not sparse.has(c.index))
        if sparse.verified_bytes() + missing <= budget:
            return
        spare = [c for c in manifest.chunks if c.index not in needed and sparse.has(c.index)]
        released = await trio.to_thread.run_sync(sparse.punch, spare)
        log.info("dropped %d bytes of layers no longer served (--disk %d)", released, budget)
        self.duty.held(trio.current_time(), self._held())
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


# ----- what a model file holds

def describe_model(path: Path, digest: str) -> ModelInfo:
    """What placement needs to know of the GGUF at `path` (whole, or a sparse file with its header; a split
    set's part, every part's header read), from the headers alone; ModelNotFound, naming the file, if it is
    no usable GGUF."""
    try:
        files = model_files(path)
    except (GGUFError, SplitError, OSError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ModelNotFound(f"{path.name} is not a usable GGUF model ({reason})") from None
    first = files.layouts[0]
    sizes = {t.name: t.size for layout in files.layouts for t in layout.tensors}
    return model_info(digest, files.name, first.metadata, sizes, first.arrays)


class CannotVolunteer(Exception):
    """This node's memory holds no stage of the model it volunteers: it would serve nothing, and say nothing."""


def check_volunteer(info: ModelInfo, cfg: NodeConfig) -> None:
    """CannotVolunteer, with what the smallest stage needs and the flags that change it, unless some range
    of `info` fits this node's memory (as the tracker counts it: weights and KV at its session budget)."""
    limits = cfg.limits
    spec = ModelSpec.from_info(info, limits.max_sessions * limits.max_session_tokens)
    pieces = spec.pieces()
    if any(stage_fits(spec, start, end, cfg.memory_bytes, cfg.gpu_memory_bytes, cfg.gpu_layers) is None
           for start, end in pieces):
        return
    start, end = min(pieces, key=lambda piece: spec.stage_bytes(*piece))
    need = spec.stage_bytes(start, end)
    kv = (end - start) * spec.kv_bytes_per_layer
    offered = f"--memory {cfg.memory_bytes / MIB:.1f} MiB " + \
        (f"and --gpu-memory {cfg.gpu_memory_bytes / MIB:.1f} MiB hold" if cfg.gpu_layers else "holds")
    raise CannotVolunteer(
        f"{offered} no layer of {info.name}: its smallest stage (layers {start}:{end}) needs {need / MIB:.1f} MiB, "
        f"{(need - kv) / MIB:.1f} MiB of weights and {kv / MIB:.1f} MiB of KV for {limits.max_sessions} × "
        f"{limits.max_session_tokens} tokens (--max-sessions × --session-tokens); offer more memory, "
        f"or fewer sessions or tokens, or join with --no-model")


# ----- addresses


def route_source(host: str) -> str | None:
    """This host's own address on the way to `host`, as the kernel routes it (no packet is sent)."""
    if not is_ip(host):
        return None
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            source: str = probe.getsockname()[0]
    except OSError:
        return None
    return None if is_unspecified(source) else source
