"""A node behind NAT keeps reservations on relays and says where it can be reached."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from meshd.net.peers import Peers
from relay.protocol import HOP_PROTOCOL, Reserve, Reserved, circuit_address
from wire.codec import ErrorMessage, error_from_message
from wire.errors import ErrorCode, ProtocolError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RelayCandidate:
    node_id: str
    address: str


@dataclass
class ReservationKeeper:
    """Holds up to ``want`` reservations among the relays ``candidates`` names, re-reserving
    when one is lost; ``on_change`` gets the circuit addresses held, oldest first."""

    peers: Peers
    candidates: Callable[[], list[RelayCandidate]]
    on_change: Callable[[list[str]], None]
    want: int = 2
    check_interval: float = 0.5
    reserve_timeout: float = 5.0
    held: dict[str, str] = field(default_factory=dict)
    _trying: set[str] = field(default_factory=set)
    # relay node id -> trio time before which it is not asked again
    _backoff: dict[str, float] = field(default_factory=dict)

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                now = trio.current_time()
                for relay in self.candidates():
                    if len(self.held) + len(self._trying) >= self.want:
                        break
                    if relay.node_id in self.held or relay.node_id in self._trying:
                        continue
                    if self._backoff.get(relay.node_id, 0.0) > now:
                        continue
                    self._trying.add(relay.node_id)
                    nursery.start_soon(self._hold, relay)
                await trio.sleep(self.check_interval)

    async def _hold(self, relay: RelayCandidate) -> None:
        try:
            with trio.fail_after(self.reserve_timeout):
                stream = await self.peers.open_stream(relay.address, HOP_PROTOCOL, node_id=relay.node_id)
            async with stream:
                with trio.fail_after(self.reserve_timeout):
                    await stream.send_message(Reserve())
                    reply = await stream.receive_message()
                if isinstance(reply, ErrorMessage):
                    raise error_from_message(reply)
                if not isinstance(reply, Reserved):
                    raise ProtocolError(ErrorCode.BAD_REQUEST, f"relay answered reserve with {reply.type!r}")
                self._trying.discard(relay.node_id)
                self.held[relay.node_id] = circuit_address(relay.address, self.peers.node_id)
                log.info("reserved on relay %s at %s", relay.node_id[:16], relay.address)
                self.on_change(list(self.held.values()))
                try:
                    await stream.receive_message()
                except trio.EndOfChannel:
                    pass
            raise ProtocolError(ErrorCode.UNREACHABLE, "the relay ended the reservation")
        except (ProtocolError, OSError, trio.TooSlowError, trio.BrokenResourceError,
                trio.ClosedResourceError, trio.EndOfChannel) as exc:
            retry = getattr(exc, "retry_after_ms", None)
            self._backoff[relay.node_id] = trio.current_time() + (retry / 1000 if retry else 2.0)
            log.info("no reservation on relay %s: %s", relay.node_id[:16], exc)
        finally:
            self._trying.discard(relay.node_id)
            if self.held.pop(relay.node_id, None) is not None:
                self.on_change(list(self.held.values()))
