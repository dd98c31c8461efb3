"""The relay's books, sans IO: reservations, circuits and their quotas.

Every decision takes the current time as a parameter, and ``next_timer`` says
when a circuit or a reservation will run out of time, so the trio service only
sleeps and forwards, and tests run without clocks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from wire.errors import ErrorCode, ProtocolError


@dataclass(frozen=True)
class RelayLimits:
    max_reservations: int = 128
    # Reservations from one source address: identities are free, addresses are not.
    max_reservations_per_address: int = 4
    max_circuits: int = 1024
    # Circuits one node takes part in, at either end.
    max_circuits_per_peer: int = 16
    # Bytes both ways together; a relay lends bandwidth, it does not carry a node's whole traffic.
    max_circuit_bytes: int = 1 << 30
    max_circuit_seconds: float = 3600.0
    idle_timeout: float = 120.0
    # A reservation not renewed within this lifetime ends (a reserver renews halfway).
    reservation_seconds: float = 900.0
    # What a refused reserver or dialer is told to wait before asking again.
    retry_after_ms: int = 2000


@dataclass
class Circuit:
    id: int
    source: str
    target: str
    opened_at: float
    last_active: float
    bytes: int = 0

    def deadline(self, limits: RelayLimits) -> float:
        return min(self.opened_at + limits.max_circuit_seconds, self.last_active + limits.idle_timeout)


@dataclass
class RelayState:
    limits: RelayLimits = field(default_factory=RelayLimits)
    # node id -> the id of its current reservation (a node re-reserving replaces its old one)
    reservations: dict[str, int] = field(default_factory=dict)
    # reservation id -> when it ends unless renewed
    expiry: dict[int, float] = field(default_factory=dict)
    circuits: dict[int, Circuit] = field(default_factory=dict)
    # node id -> the source address (host) its reservation came from
    hosts: dict[str, str] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def reserve(self, node: str, now: float, host: str = "") -> int:
        """A reservation for ``node`` (reserving from ``host``) until ``now`` plus the lifetime,
        replacing (renewing) any it holds; raises OVERLOADED when the relay, or its share for
        ``host``, is full."""
        if node not in self.reservations and len(self.reservations) >= self.limits.max_reservations:
            raise ProtocolError(ErrorCode.OVERLOADED,
                                f"this relay holds its maximum of {self.limits.max_reservations} reservations",
                                retry_after_ms=self.limits.retry_after_ms)
        same_host = sum(1 for n, h in self.hosts.items() if h == host and n != node)
        if same_host >= self.limits.max_reservations_per_address:
            raise ProtocolError(ErrorCode.OVERLOADED,
                                f"this relay holds its maximum of {self.limits.max_reservations_per_address} "
                                f"reservations from one address", retry_after_ms=self.limits.retry_after_ms)
        self.hosts[node] = host
        old = self.reservations.get(node)
        if old is not None:
            del self.expiry[old]
        reservation = next(self._ids)
        self.reservations[node] = reservation
        self.expiry[reservation] = now + self.limits.reservation_seconds
        return reservation

    def release(self, node: str, reservation: int) -> None:
        """Ends ``reservation``, unless a newer one of the same node replaced it."""
        if self.reservations.get(node) == reservation:
            del self.reservations[node]
            del self.expiry[reservation]
            self.hosts.pop(node, None)

    def reservation_deadline(self, reservation: int) -> float:
        """When ``reservation`` ends unless renewed; -inf once replaced or released."""
        return self.expiry.get(reservation, float("-inf"))

    def holds_reservation(self, node: str, now: float) -> bool:
        reservation = self.reservations.get(node)
        return reservation is not None and now < self.expiry[reservation]

    def open_circuit(self, source: str, target: str, now: float) -> Circuit:
        if not self.holds_reservation(target, now):
            raise ProtocolError(ErrorCode.NOT_FOUND, f"node {target[:16]} holds no reservation on this relay")
        if len(self.circuits) >= self.limits.max_circuits:
            raise ProtocolError(ErrorCode.OVERLOADED, "this relay carries its maximum of circuits",
                                retry_after_ms=self.limits.retry_after_ms)
        for node in {source, target}:
            if self.circuits_of(node) >= self.limits.max_circuits_per_peer:
                raise ProtocolError(
                    ErrorCode.OVERLOADED,
                    f"node {node[:16]} already has {self.limits.max_circuits_per_peer} circuits on this relay",
                    retry_after_ms=self.limits.retry_after_ms)
        circuit = Circuit(next(self._ids), source, target, now, now)
        self.circuits[circuit.id] = circuit
        return circuit

    def circuits_of(self, node: str) -> int:
        return sum(1 for c in self.circuits.values() if node in (c.source, c.target))

    def close_circuit(self, circuit_id: int) -> None:
        self.circuits.pop(circuit_id, None)

    def forwarded(self, circuit_id: int, size: int, now: float) -> None:
        """Counts ``size`` bytes about to be forwarded; raises OVERLOADED if they break the byte quota.

        Checked before forwarding, so a circuit never carries more than its quota."""
        circuit = self.circuits[circuit_id]
        if circuit.bytes + size > self.limits.max_circuit_bytes:
            raise ProtocolError(ErrorCode.OVERLOADED,
                                f"circuit reached its limit of {self.limits.max_circuit_bytes} bytes")
        circuit.bytes += size
        circuit.last_active = now

    def expired(self, circuit_id: int, now: float) -> ProtocolError | None:
        """Why the circuit must end now (time or idleness), or None."""
        circuit = self.circuits.get(circuit_id)
        if circuit is None:
            return None
        if now >= circuit.opened_at + self.limits.max_circuit_seconds:
            return ProtocolError(ErrorCode.DEADLINE_EXCEEDED,
                                 f"circuit reached its limit of {self.limits.max_circuit_seconds:g} s")
        if now >= circuit.last_active + self.limits.idle_timeout:
            return ProtocolError(ErrorCode.DEADLINE_EXCEEDED,
                                 f"circuit idle for {self.limits.idle_timeout:g} s")
        return None

    def deadline(self, circuit_id: int) -> float:
        circuit = self.circuits.get(circuit_id)
        return float("inf") if circuit is None else circuit.deadline(self.limits)

    def next_timer(self) -> float | None:
        """The next moment a circuit or a reservation runs out; None while nothing can."""
        times = [c.deadline(self.limits) for c in self.circuits.values()]
        times.extend(self.expiry.values())
        return min(times, default=None)
