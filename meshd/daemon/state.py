"""The mesh daemon's shared state (``DaemonState``), which each of its parts extends."""

from __future__ import annotations

from pathlib import Path

import trio

from meshd.client.ledger import LedgerKeeper
from meshd.daemon.config import NodeConfig, ServingRange
from meshd.daemon.driver import MeshDriver
from meshd.fetch.hub import HubReader
from meshd.fetch.source import ChunkSource, activity
from meshd.mesh.duty import MeshDuty
from meshd.mesh.node import MeshNode
from meshd.mesh.records import ROLE_RELAY, CapabilityRecord, ModelInfo, host_of, is_unspecified
from meshd.net.peers import Peers
from meshd.relay.punch import Puncher
from meshd.relay.reservations import ReservationKeeper
from meshd.relay.service import RelayService
from meshd.stage.fast import FastDoor
from meshd.store.manifest import Manifest
from meshd.store.sparse import SparseFile
from relay.protocol import parse_circuit_address
from wire.identity import NodeIdentity
from wire.meshrpc import FetchStatus


class DaemonState:
    """What every part of the daemon shares: its identity, configuration, peers and mesh state, the
    model it serves, and the few moves each part makes (flush the duty, find where to dial a member)."""

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

    def _flush(self) -> None:
        """After a change to the mesh state from outside the driver: send what it queued, look at the timers."""
        if self.driver is not None:
            self.driver.flush()
            self.driver.poke()

    def _engine_calls(self) -> int:
        return sum(r.service.metrics.engine_calls for r in [*self.serving, *self.retiring] if r.service is not None)

    def live_records(self) -> list[CapabilityRecord]:
        return self.mesh.membership.live_records()

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
