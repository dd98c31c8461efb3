"""A node behind NAT keeps reservations on relays and says where it can be reached.

``ReservationKeeper`` is the trio shell of ``relay.reservations.ReservationPolicy``:
it sleeps until the policy's next timer or an event (the candidates changed,
a reservation was granted, refused or lost), and carries out what the policy
says is due. Each reservation is a hop stream held open, on which the keeper
renews it when the policy says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from meshd.net import rpc
from meshd.net.peers import Peers
from meshd.net.stream import Stream
from relay.protocol import HOP_PROTOCOL, Reserve, Reserved, circuit_address
from relay.reservations import RelayCandidate, Renew, ReservationPolicy
from relay.reservations import Reserve as ReserveAction
from wire.errors import ProtocolError

__all__ = ["RelayCandidate", "ReservationKeeper"]

log = logging.getLogger(__name__)


@dataclass
class ReservationKeeper:
    """Holds up to ``want`` reservations among the relays ``candidates`` names, re-reserving
    when one is lost; ``on_change`` gets the circuit addresses held, oldest first.

    Call ``candidates_changed`` when what ``candidates`` returns may have changed.
    """

    peers: Peers
    candidates: Callable[[], list[RelayCandidate]]
    on_change: Callable[[list[str]], None]
    want: int = 2
    reserve_timeout: float = 5.0
    policy: ReservationPolicy = field(init=False)
    _wake: trio.Event = field(default_factory=trio.Event)
    # relay node id -> the hop stream holding its reservation
    _streams: dict[str, Stream] = field(default_factory=dict)
    _published: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.policy = ReservationPolicy(want=self.want)

    @property
    def held(self) -> list[str]:
        """The circuit addresses held, oldest first."""
        return [circuit_address(relay.address, self.peers.node_id) for relay in self.policy.held]

    def reserved_on(self, relay: str) -> bool:
        """Whether relay ``relay`` (a node id) holds a reservation of ours now: only it may bring circuits."""
        return relay in self._streams

    def candidates_changed(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        policy = self.policy
        async with trio.open_nursery() as nursery:
            while True:
                policy.set_candidates(self.candidates())
                for action in policy.due(trio.current_time()):
                    if isinstance(action, ReserveAction):
                        nursery.start_soon(self._hold, action.relay)
                    elif isinstance(action, Renew):
                        stream = self._streams.get(action.node_id)
                        if stream is not None:
                            nursery.start_soon(self._renew, stream)
                self._publish()
                deadline = policy.next_timer()
                with trio.move_on_at(float("inf") if deadline is None else deadline):
                    await self._wake.wait()
                self._wake = trio.Event()

    def _publish(self) -> None:
        held = self.held
        if held != self._published:
            self._published = held
            self.on_change(list(held))

    async def _hold(self, relay: RelayCandidate) -> None:
        what = f"a reservation on relay {relay.node_id[:16]} at {relay.address}"
        granted = False
        try:
            with rpc.within(self.reserve_timeout, what):
                stream = await self.peers.open_stream(relay.address, HOP_PROTOCOL, node_id=relay.node_id)
            async with stream:
                reply = await rpc.request(stream, Reserve(), Reserved, what, self.reserve_timeout)
                granted = True
                self._streams[relay.node_id] = stream
                log.info("reserved on relay %s at %s", relay.node_id[:16], relay.address)
                # Each renewal (``_renew``) is answered on this stream; its end ends the reservation.
                while True:
                    self.policy.reserved(relay.node_id, trio.current_time(), reply.lifetime_seconds)
                    self._wake.set()
                    reply = await rpc.receive(stream, Reserved, what)
        # A ValueError is a relay's record naming an address that is none.
        except (ProtocolError, ValueError) as exc:
            now = trio.current_time()
            if granted:
                self.policy.lost(relay.node_id, now)
                log.info("lost the reservation on relay %s: %s", relay.node_id[:16], exc)
            else:
                retry = getattr(exc, "retry_after_ms", None)
                self.policy.failed(relay.node_id, now, None if retry is None else retry / 1000)
                log.info("no reservation on relay %s: %s", relay.node_id[:16], exc)
        finally:
            self._streams.pop(relay.node_id, None)
            self._wake.set()

    async def _renew(self, stream: Stream) -> None:
        try:
            await stream.send_message(Reserve())
        except ProtocolError as exc:
            # The holder reading this stream sees the reset, and reports the reservation lost.
            stream.reset(exc)
