"""A mesh node's configuration: what it offers, where it listens, and its budgets and timeouts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import trio

from meshd.client.ledger import LedgerKeeper
from meshd.fetch.hub import HubModel
from meshd.fetch.source import SourceConfig
from meshd.mesh.credit import ASKER_WINDOW_CAP, VOTES_EVERY
from meshd.mesh.election import ElectionConfig
from meshd.mesh.probes import ProbeConfig
from meshd.net.peers import PeersConfig
from meshd.relay.service import Tap
from meshd.stage.books import StageLimits
from meshd.stage.service import StageService
from relay.limits import RelayLimits
from relay.punch import PunchLimits

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
    # the punch's rounds, timeouts and retry delay (the tests shorten the retry: join --punch-retry)
    punch_limits: PunchLimits = field(default_factory=PunchLimits)
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
    ledger_interval: float = LedgerKeeper.interval
    # how often it works every member's credit out again (a test mesh's: seconds, not the product's 10)
    standing_every: float = LedgerKeeper.standing_every
    # how often the election's votes are weighed again by the credit ledger (meshd.mesh.credit.VOTES_EVERY)
    credit_votes_every: float = VOTES_EVERY
    # the work one asker credits one stage an hour (meshd.mesh.credit.ASKER_WINDOW_CAP), the same on every
    # member of a mesh (a test mesh's is smaller, so a few asks earn a cap's worth)
    asker_window_cap: float = ASKER_WINDOW_CAP
    # the election's timers (a test mesh shortens them, to watch a bid over several terms in seconds)
    election: ElectionConfig = field(default_factory=ElectionConfig)


@dataclass
class ServingRange:
    start: int
    end: int
    service: StageService | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
