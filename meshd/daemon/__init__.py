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

The daemon's parts, each a module of one concern over ``DaemonState`` (state.py):
reachability.py (this node's address, dial-backs, relays), answers.py (mesh RPCs,
routes, status), credit.py (the ledger's part), fetching.py (a model fetched range
by range); driver.py runs the duty; config.py and volunteer.py say what a node
offers. This module is the node: its lifecycle, SWIM transport, and the ranges
it serves.
"""

from __future__ import annotations

import logging
import time

import trio

from meshd.client.ask import first_error
from meshd.client.ledger import LedgerKeeper
from meshd.client.probe import probe_stage
from meshd.daemon.answers import Answers
from meshd.daemon.config import ServingRange
from meshd.daemon.driver import MeshDriver
from meshd.daemon.fetching import ModelFetch
from meshd.daemon.volunteer import check_volunteer
from meshd.engine.supervisor import EngineSupervisor, WorkerSpec
from meshd.fetch.source import register
from meshd.mesh.addresses import fit_for_peer
from meshd.mesh.credit import Ledger
from meshd.mesh.duty import MeshDuty
from meshd.mesh.duty_events import AskAssignment, AssignmentChanged, DutyConfig, DutyEvent, LoadRange, RangeRefused
from meshd.mesh.membership import SWIM_MESSAGES, MemberEvent, SwimMessage
from meshd.mesh.node import MeshNode, TrackerChanged
from meshd.mesh.probes import StageProbe
from meshd.mesh.records import ROLE_CLIENT, ROLE_RELAY, CapabilityRecord, host_of
from meshd.net.peers import open_peers
from meshd.net.rpc import answer_typed, mesh_rpc
from meshd.net.stream import Stream
from meshd.relay.circuit import enable_circuits
from meshd.relay.punch import Puncher
from meshd.relay.service import RelayService
from meshd.stage.model_file import describe_model, model_manifest
from meshd.stage.service import StageService
from meshd.store.holding import WholeFile
from wire.errors import ErrorCode, ProtocolError
from wire.meshrpc import MESH_PROTOCOL, SWIM_PROTOCOL, AssignmentReply, AssignmentRequest
from wire.message import Message
from wire.stage import STAGE_PROTOCOL, Hop, Open

log = logging.getLogger(__name__)


# How often a member publishes how busy its stage is (its record's load, which routes count): a record's
# every version is gossiped to every member, so not per session; the tracker's kept route moves off a
# stage whose load makes it cost more than the route margin (meshd.mesh.routing.ROUTE_MARGIN), so one
# hot route (the prefix cache keeps an agent's turns on theirs) spills onto idle replicas.
LOAD_EVERY = 5.0


class MeshDaemon(Answers, ModelFetch):
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
            self.puncher = Puncher(peers, cfg.punch_limits, direct_address=self._public_address)
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
            self.mesh = MeshNode(self.identity, record, trio.current_time(), election=cfg.election)
            limits = cfg.limits
            self.duty = MeshDuty(self.mesh, DutyConfig(
                volunteer=self.model if not cfg.client else None,
                kv_tokens=limits.max_sessions * limits.max_session_tokens, settle=cfg.settle, probes=cfg.probes))
            self.driver = MeshDriver(self.duty, self._send, self._on_event, cfg.swim_inbox)
            nursery.start_soon(self.driver.run)
            self.credit = LedgerKeeper(self.identity, peers, mesh_rpc, self.placed_members,
                                       ledger=Ledger(cap=cfg.asker_window_cap), interval=cfg.ledger_interval,
                                       timeout=cfg.rpc_timeout, standing_every=cfg.standing_every)
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

    async def _publish_load(self) -> None:
        """Every `LOAD_EVERY`, the busiest of this member's stages as its record's load, when it changed."""
        while True:
            await trio.sleep(LOAD_EVERY)
            load = max((s.service.books.load for s in self.serving if s.service is not None), default=0.0)
            if load != self.mesh.record.load:
                self.mesh.update_record(trio.current_time(), load=load)
                self._flush()

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

    async def _ask_tracker(self, ask: AskAssignment) -> None:
        reply = None
        address = self.address_of(ask.tracker.node_id)
        if address is not None:
            try:
                got = await mesh_rpc(self.peers, address, AssignmentRequest(), ask.tracker.node_id,
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
