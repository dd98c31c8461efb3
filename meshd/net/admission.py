"""Admission of inbound connections: what a stranger may cost before it authenticates.

Pure bookkeeping (no trio): the shell asks ``admit`` for every accepted TCP
connection, cancels the connections it names as evicted, and reports when a
connection authenticates and when it ends.

Before authentication a connection is cheap to open and costs us memory, a
file descriptor and handshake work, so there are few of them at a time:
``max_preauth`` in all and ``max_preauth_per_source`` per source address. A
newcomer over either cap displaces the oldest pending connection (of its own
source, or of the source holding the most) instead of being refused: honest
dialers finish their handshake in a few round trips, so a flood of idle
connections churns itself while a late honest dialer still gets in.

A source whose connections keep failing before they authenticate (timed
out, displaced, garbage, a wrong mesh key) is refused for a while: each such
failure spends one of its ``source_burst`` tokens, which come back at
``source_rate`` per second. A refusal costs an accept and a close, not a
WebSocket upgrade, so reconnecting in a loop buys nothing; a source whose
connections authenticate spends nothing.

All inbound connections together, authenticated or not, stay under
``max_inbound``, which ``fd_budget`` derives from the file-descriptor limit
less a reserve for dialing out, model files, the engine worker and local
control; ``raise_fd_limit`` lifts the soft limit to the hard one first.
"""

from __future__ import annotations

import resource
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import count

# Seen as "unlimited" hard limits; a soft limit that high would only hide leaks.
_FD_CEILING = 1 << 20
# Sources whose connection rate is remembered; beyond it, full buckets are forgotten.
_MAX_BUCKETS = 4096


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_preauth: int = 256
    max_preauth_per_source: int = 16
    # Seconds an inbound connection has to finish the WebSocket upgrade and
    # the Noise handshake (a few round trips).
    preauth_timeout: float = 5.0
    # Failed pre-auth connections a source may have: a burst, then one per 2 s.
    source_rate: float = 0.5
    source_burst: int = 8
    # Authenticated inbound links at most (before the file-descriptor cap).
    max_links: int = 1024
    # File descriptors kept free for everything that is not an inbound connection.
    fd_reserve: int = 128

    def __post_init__(self) -> None:
        if self.source_rate <= 0 or self.source_burst < 1:
            raise ValueError("source_rate must be positive and source_burst at least 1")
        if self.max_preauth < 1 or self.max_preauth_per_source < 1 or self.max_links < 1:
            raise ValueError("admission caps must be at least 1")
        if self.preauth_timeout <= 0 or self.fd_reserve < 0:
            raise ValueError("preauth_timeout must be positive and fd_reserve not negative")


def raise_fd_limit() -> int:
    """Lift this process's soft RLIMIT_NOFILE to the hard limit; return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _FD_CEILING if hard == resource.RLIM_INFINITY else min(hard, _FD_CEILING)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return _FD_CEILING if soft == resource.RLIM_INFINITY else soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target


def fd_budget(fd_limit: int, config: AdmissionConfig) -> int:
    """Inbound connections allowed under ``fd_limit``: the limit less the reserve
    (an eighth of the limit, at least ``fd_reserve``), and at most ``max_links``."""
    reserve = max(config.fd_reserve, fd_limit // 8)
    return max(1, min(fd_limit - reserve, config.max_links + config.max_preauth))


@dataclass(eq=False, slots=True)
class Ticket:
    """One inbound connection's place."""

    source: str
    number: int
    authenticated: bool = False
    was_authenticated: bool = False
    evicted: bool = False
    released: bool = False


@dataclass
class Admission:
    config: AdmissionConfig
    max_inbound: int
    _pending: dict[str, OrderedDict[int, Ticket]] = field(default_factory=dict)
    _preauth: int = 0
    _links: int = 0
    _numbers: count[int] = field(default_factory=count)
    # source -> (tokens, when): a token bucket of new connections per source
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def preauth(self) -> int:
        return self._preauth

    @property
    def inbound(self) -> int:
        return self._preauth + self._links

    def admit(self, source: str, now: float) -> tuple[Ticket | None, list[Ticket]]:
        """A place for a new connection from ``source`` at time ``now`` (None:
        refuse it), and the pending connections it displaces, to be cancelled now."""
        if self._tokens(source, now) < 1.0:
            return None, []
        evicted: list[Ticket] = []
        mine = self._pending.get(source)
        if mine is not None and len(mine) >= self.config.max_preauth_per_source:
            evicted.append(self._evict_oldest(source))
        elif self._preauth >= self.config.max_preauth or self.inbound >= self.max_inbound:
            if self._links >= min(self.max_inbound, self.config.max_links) or not self._pending:
                return None, []
            heaviest = max(self._pending, key=lambda key: len(self._pending[key]))
            evicted.append(self._evict_oldest(heaviest))
        ticket = Ticket(source, next(self._numbers))
        self._pending.setdefault(source, OrderedDict())[ticket.number] = ticket
        self._preauth += 1
        return ticket, evicted

    def authenticated(self, ticket: Ticket) -> bool:
        """The connection finished its handshake: it leaves the pending set. False
        if it was evicted meanwhile or links are at their cap (close it then)."""
        if ticket.evicted or ticket.authenticated:
            return False
        self._drop_pending(ticket)
        if self._links >= min(self.max_inbound, self.config.max_links):
            ticket.evicted = True
            return False
        ticket.authenticated = ticket.was_authenticated = True
        self._links += 1
        return True

    def handed_off(self, ticket: Ticket) -> None:
        """The connection proved itself another way (a fast-path token) and left the node's hands:
        it leaves the pending set, at no cost to its source."""
        if ticket.evicted or ticket.authenticated:
            return
        self._drop_pending(ticket)
        ticket.was_authenticated = True

    def release(self, ticket: Ticket, now: float) -> None:
        """The connection is closed; idempotent. One that never authenticated
        counts against its source."""
        if ticket.released:
            return
        ticket.released = True
        if ticket.authenticated:
            ticket.authenticated = False
            self._links -= 1
            return
        if not ticket.evicted:
            self._drop_pending(ticket)
        ticket.evicted = True
        if not ticket.was_authenticated:
            self._spend(ticket.source, now)

    def _tokens(self, source: str, now: float) -> float:
        config = self.config
        bucket = self._buckets.get(source)
        if bucket is None:
            return float(config.source_burst)
        tokens, then = bucket
        return min(float(config.source_burst), tokens + max(0.0, now - then) * config.source_rate)

    def _spend(self, source: str, now: float) -> None:
        self._buckets[source] = (max(0.0, self._tokens(source, now) - 1.0), now)
        if len(self._buckets) > _MAX_BUCKETS:
            self._forget_full_buckets(now)

    def _forget_full_buckets(self, now: float) -> None:
        config = self.config
        for key, (tokens, then) in list(self._buckets.items()):
            if tokens + (now - then) * config.source_rate >= config.source_burst:
                del self._buckets[key]
        while len(self._buckets) > _MAX_BUCKETS // 2:
            del self._buckets[next(iter(self._buckets))]

    def _evict_oldest(self, source: str) -> Ticket:
        pending = self._pending[source]
        _, ticket = next(iter(pending.items()))
        self._drop_pending(ticket)
        ticket.evicted = True
        return ticket

    def _drop_pending(self, ticket: Ticket) -> None:
        pending = self._pending.get(ticket.source)
        if pending is None or pending.pop(ticket.number, None) is None:
            return
        self._preauth -= 1
        if not pending:
            del self._pending[ticket.source]
