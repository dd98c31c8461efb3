"""Hole punching through a relay's circuit (sans-IO): messages, where a punch may dial, and how often.

After libp2p's DCUtR: two nodes linked through a relay's circuit swap the ports they listen on and a
sync over that circuit, then both dial each other from their listening ports at once (TCP
simultaneous open), so each NAT sees an outgoing connection and lets the other's SYN in.

The *initiator* is the end a relay brought the circuit to (it holds the reservation, so it is behind a
NAT); it sends ``PunchConnect`` and times the reply (the circuit's round trip), then ``PunchSync``,
and dials half that round trip later, when the sync reaches the other end, which dials at once.
The other end is the WebSocket client and Noise initiator on the punched connection.

A peer names only a port: the host dialed is the one the relay saw the peer's link come from, so
a peer cannot aim us at anyone else (as AutoNAT's dial-back dials only the asker's host).
"""

from __future__ import annotations

import ipaddress
from collections import deque
from dataclasses import dataclass, field

from wire.limits import Limits, register_protocol
from wire.message import Message
from wire.types import Port

PUNCH_PROTOCOL = "meshd/punch/1"

register_protocol(PUNCH_PROTOCOL, Limits(max_message_bytes=256, max_objects=8, max_depth=2))


class PunchConnect(Message, tag="punch_connect"):
    """Each end's listening port, which it dials from and the other dials (at the relay-seen host)."""

    port: Port


class PunchSync(Message, tag="punch_sync"):
    """From the initiator: dial now (it dials half the measured round trip later)."""


# A fast-path connection (meshd.net.fastpunch) over a direct or punched link to a node that has no
# address to dial: a round on a stream of that link, one connection per round.
FAST_PUNCH_PROTOCOL = "meshd/punch-fast/1"

register_protocol(FAST_PUNCH_PROTOCOL, Limits(max_message_bytes=256, max_objects=8, max_depth=2))


class FastPunch(Message, tag="punch_fast"):
    """Each end's fresh port for one fast-path connection (the asking end's first, the answer's after
    it); each end dials the other's port at the host its link comes from."""

    port: Port


@dataclass(frozen=True)
class FastPunchLimits:
    # rounds one connection may take, each with new ports (a NAT that drops a first SYN often takes the next)
    tries: int = 3
    # rounds this node answers at once for one peer, and for all: each holds a socket and a dial, and a
    # stage holds a few sessions (--max-sessions), each wanting one connection
    per_peer: int = 4
    in_flight: int = 32


@dataclass(frozen=True)
class PunchLimits:
    # DCUtR's three rounds: a NAT that drops a first SYN often takes the next.
    tries: int = 3
    # A failed punch (every round) is tried again while the relayed link lives, after `retry_after`
    # s doubling to `retry_cap`: one failure under a load spike or a NAT's slow start would
    # otherwise leave a pair relayed for the circuit's whole life (days). The first wait outlasts
    # `window`, so the budget has rounds for it; a symmetric NAT costs a few dials per 15 min.
    retry_after: float = 90.0
    retry_cap: float = 900.0
    # Seconds each message of a round may take over the circuit, and the punched connection's TCP
    # connect (the WebSocket upgrade and Noise handshake after it have the peers' dial_timeout).
    step_timeout: float = 5.0
    connect_timeout: float = 3.0
    # Rounds one peer may start within `window` seconds, and rounds in flight at once on this node:
    # each costs a dial, so a peer that floods requests gets no more than this.
    per_peer: int = 3
    window: float = 60.0
    in_flight: int = 8
    # The initiator's dial trails the sync's arrival at the other end by this share of the circuit's
    # round trip, at most `max_trail` s: on a link with no NAT the other end's SYN then lands on its
    # listener first, as a plain dial; across NATs both SYNs still cross (a direct one-way trip is
    # longer than that).
    trail: float = 0.125
    max_trail: float = 0.002


def punch_target(observed: str, port: int) -> tuple[str, int] | None:
    """The address a punch dials: the relay-seen host and the peer's port, or None if that host is
    not one to dial (no IP, unspecified, multicast)."""
    try:
        ip = ipaddress.ip_address(observed)
    except ValueError:
        return None
    if ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
        return None
    if not 1 <= port <= 65535:
        return None
    return str(ip), port


def dial_delay(rtt: float, limits: PunchLimits) -> float:
    """How long after sending the sync the initiator dials."""
    return rtt / 2 + min(rtt * limits.trail, limits.max_trail)


@dataclass
class PunchBudget:
    """How many punch rounds each peer may start (per window) and how many run at once."""

    limits: PunchLimits = field(default_factory=PunchLimits)
    _started: dict[str, deque[float]] = field(default_factory=dict)
    running: int = 0

    def take(self, peer: str, now: float) -> str | None:
        """Takes a round for ``peer``: None, or why not (then nothing is taken)."""
        if self.running >= self.limits.in_flight:
            return f"{self.running} hole punches are running"
        times = self._started.setdefault(peer, deque())
        while times and times[0] <= now - self.limits.window:
            times.popleft()
        if len(times) >= self.limits.per_peer:
            return f"{len(times)} hole punches from this node within {self.limits.window:g} s"
        times.append(now)
        self.running += 1
        # peers with no recent round are forgotten, so the table is bounded by the peers of one window
        for stale in [p for p, t in self._started.items() if not t or t[-1] <= now - self.limits.window]:
            del self._started[stale]
        return None

    def done(self) -> None:
        self.running -= 1
