"""What SWIM membership says of members, and how it is tuned: states, events, the table's rows, and
the timings and caps of the protocol (meshd.mesh.membership runs it)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Literal

from wire.swim import CapabilityRecord


class MemberState(str, enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


@dataclass(frozen=True)
class SwimConfig:
    """Defaults from HashiCorp memberlist's LAN profile, with Lifeguard suspicion."""

    probe_interval: float = 1.0
    probe_timeout: float = 0.5
    indirect_checks: int = 3
    # Suspicion lasts suspicion_mult * log10(N) probe intervals once confirmed, up to
    # suspicion_max_mult times that when nobody else confirms.
    suspicion_mult: float = 4.0
    suspicion_max_mult: float = 6.0
    # Each node passes each update on retransmit_mult * ceil(log10(N + 1)) times, so a node misses
    # it with odds of about exp(-that); the version every message carries lets it pull what it
    # missed at the next message from that member rather than at the next push-pull.
    retransmit_mult: int = 4
    gossip_interval: float = 0.2
    gossip_nodes: int = 3
    # Keep gossiping to a dead member this long (one per round), so a falsely declared node hears.
    gossip_to_dead: float = 30.0
    push_pull_interval: float = 30.0
    # Try a push-pull with a random dead member this often: heals partitions.
    reconnect_interval: float = 30.0
    # Forget a dead or departed member after this long (its version is kept, so its old records are
    # stale and a peer's Sync cannot bring it back), checked at each push-pull round: no member is kept
    # past reap_after + push_pull_interval of its death here. The table keeps the dead only so that a
    # falsely declared node hears (gossip_to_dead) and a partition heals (the reconnect loop tries one
    # dead member each reconnect_interval): half an hour is 60 such tries, while a volunteer mesh's
    # churn (every departed laptop kept a day, as before) no longer fills the table with the gone.
    reap_after: float = 1800.0
    join_retry_interval: float = 2.0
    max_piggyback: int = 32
    # Members are strangers: the table holds at most this many others (a status reply lists them
    # all), and one sender introduces at most a burst of `introductions` members it alone vouches
    # for, refilled at `introductions_per_second`: two Syncs cannot plant ten thousand members.
    max_members: int = 4095
    introductions: int = 1024
    introductions_per_second: float = 32.0
    # Accusations count per accuser: one accuser may start or confirm a suspicion of one member
    # `accusations` times in a burst, refilled one per shortest suspicion (suspicion_mult probe
    # intervals); the rest are dropped before they suspect anyone or travel on. An honest node
    # accuses a member once per incarnation, and again (dead) only when its own suspicion runs out,
    # no sooner than that, so its accusations all count, while a member sending a fresh accusation
    # every 50 ms makes its target suspect here once every 4 s at most.
    accusations: int = 1
    # A node refutes a suspicion of itself at most once a `refute_interval`: accusations within it
    # are answered by one refutation at its end. It is not counted per accuser like the above: a
    # refutation it withheld from an accuser it had heard too often could leave others, who had not,
    # to time the suspicion out and declare it dead. Well under the shortest suspicion
    # (suspicion_mult probe intervals), so a refutation always comes in time, while a stream of
    # accusations, from any number of accusers, re-signs its record at most this often.
    refute_interval: float = 1.0
    # A member counts as a voter only once heard from over its own link (`first_hand`): each probe
    # period, ping this many live members not heard from yet, in the order they became live, so
    # that joiners and a healed partition's other side vote within seconds rather than after a
    # probe round, while records a Sync planted for nobody who answers never do.
    confirmations: int = 8


EventKind = Literal["joined", "alive", "updated", "suspect", "dead", "left"]


@dataclass(frozen=True)
class MemberEvent:
    """A change in this node's view. `joined`: newly live; `alive`: refuted a suspicion or came
    back; `updated`: a live member published a new record; then `suspect`, `dead`, `left`."""

    kind: EventKind
    node_id: str
    record: CapabilityRecord


@dataclass(frozen=True)
class MemberInfo:
    node_id: str
    state: MemberState
    incarnation: int
    record: CapabilityRecord
    rtt: float | None


def advance(deadline: float, interval: float, now: float) -> float:
    """The next tick of a periodic timer; after a stall, skip the missed ticks rather than burst."""
    deadline += interval
    return deadline if deadline > now else now + interval


def push_pull_scale(interval: float, n: int) -> float:
    # memberlist's scaling: full-state exchanges grow with N, so space them out beyond 32 nodes.
    if n <= 32:
        return interval
    return interval * (math.ceil(math.log2(n) - math.log2(32)) + 1)
