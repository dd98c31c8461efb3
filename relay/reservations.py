"""Which relays a node behind NAT reserves on, and when (sans IO).

The policy holds up to ``want`` reservations among the relay candidates it is
told of, in the order given. It says when to ask a relay (now, or after a
back-off that doubles with each failure, or what the relay said to wait),
when to renew a reservation (halfway through the lifetime the relay granted),
and ``next_timer`` says when it next has something to do. The trio shell
(``meshd.relay.reservations``) carries out its ``due`` actions and reports
back; nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RelayCandidate:
    node_id: str
    address: str


@dataclass(frozen=True)
class Reserve:
    """Ask ``relay`` for a reservation; report ``reserved`` or ``failed``."""

    relay: RelayCandidate


@dataclass(frozen=True)
class Renew:
    """Renew the reservation held on relay ``node_id``; report ``reserved``, or ``lost``."""

    node_id: str


Action = Reserve | Renew


@dataclass
class _Held:
    relay: RelayCandidate
    # When to renew; None: the relay granted no lifetime, the reservation lasts as long as its stream.
    renew_at: float | None
    renewing: bool = False


@dataclass
class _Backoff:
    until: float
    failures: int


@dataclass
class ReservationPolicy:
    want: int = 2
    # The first wait after a failure; each further failure doubles it, up to backoff_max.
    backoff: float = 2.0
    backoff_max: float = 60.0
    # Renew when this share of the granted lifetime has passed, but never sooner than
    # renew_min after a grant: a relay granting a tiny lifetime must not make us spin.
    renew_after: float = 0.5
    renew_min: float = 1.0
    _candidates: list[RelayCandidate] = field(default_factory=list)
    _held: dict[str, _Held] = field(default_factory=dict)
    _trying: dict[str, RelayCandidate] = field(default_factory=dict)
    _backoff: dict[str, _Backoff] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.want < 0 or not 0 < self.backoff <= self.backoff_max or not 0 < self.renew_after < 1
                or self.renew_min <= 0):
            raise ValueError("want >= 0, 0 < backoff <= backoff_max, 0 < renew_after < 1 and renew_min > 0")

    # ----- what the shell tells the policy

    def set_candidates(self, candidates: Sequence[RelayCandidate]) -> None:
        """The relays one may reserve on, best first (a held one that is gone stays held until lost)."""
        unique: dict[str, RelayCandidate] = {}
        for candidate in candidates:
            unique.setdefault(candidate.node_id, candidate)
        self._candidates = list(unique.values())

    def reserved(self, node_id: str, now: float, lifetime: float | None) -> None:
        """Relay ``node_id`` granted (or renewed) a reservation for ``lifetime`` seconds (None: unbounded)."""
        held = self._held.get(node_id)
        relay = self._trying.pop(node_id, None) or (held.relay if held is not None else None)
        if relay is None:
            raise KeyError(f"relay {node_id[:16]} was not asked")
        self._backoff.pop(node_id, None)
        renew_at = None if lifetime is None else now + max(lifetime * self.renew_after, self.renew_min)
        self._held[node_id] = _Held(relay, renew_at)

    def failed(self, node_id: str, now: float, retry_after: float | None = None) -> None:
        """Asking relay ``node_id`` failed; ``retry_after`` is what it said to wait, if it did."""
        self._trying.pop(node_id, None)
        self._held.pop(node_id, None)
        previous = self._backoff.get(node_id)
        failures = 1 if previous is None else previous.failures + 1
        wait = min(self.backoff_max, self.backoff * 2 ** min(failures - 1, 32))
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.backoff_max))
        self._backoff[node_id] = _Backoff(now + wait, failures)

    def lost(self, node_id: str, now: float) -> None:
        """A reservation that held has ended (the relay ended it, or its link went).

        Asking the same relay again at once would meet the same fate: it waits
        the first back-off, and the other candidates are asked meanwhile.
        """
        was_held = self._held.pop(node_id, None) is not None
        self._trying.pop(node_id, None)
        if was_held:
            self._backoff[node_id] = _Backoff(now + self.backoff, 0)
        else:
            self.failed(node_id, now)

    # ----- what the policy tells the shell

    @property
    def held(self) -> list[RelayCandidate]:
        """The relays holding a reservation, oldest first."""
        return [h.relay for h in self._held.values()]

    def due(self, now: float) -> list[Action]:
        """What to do now; each action is handed out once (until reported on)."""
        actions: list[Action] = []
        for node_id, held in self._held.items():
            if held.renew_at is not None and held.renew_at <= now and not held.renewing:
                held.renewing = True
                actions.append(Renew(node_id))
        for relay in self._candidates:
            if len(self._held) + len(self._trying) >= self.want:
                break
            if self._available(relay.node_id, now):
                self._trying[relay.node_id] = relay
                actions.append(Reserve(relay))
        return actions

    def next_timer(self) -> float | None:
        """When ``due`` next has an action without anything being reported; None: not before an event."""
        times = [h.renew_at for h in self._held.values() if h.renew_at is not None and not h.renewing]
        if len(self._held) + len(self._trying) < self.want:
            times.extend(
                backoff.until
                for relay in self._candidates
                if (backoff := self._backoff.get(relay.node_id)) is not None
                and relay.node_id not in self._held
                and relay.node_id not in self._trying
            )
        return min(times, default=None)

    # -----

    def _available(self, node_id: str, now: float) -> bool:
        if node_id in self._held or node_id in self._trying:
            return False
        backoff = self._backoff.get(node_id)
        return backoff is None or backoff.until <= now
