"""This node's address and reachability: where its seeds see it and whether they can dial it back
(else it is behind NAT and keeps relay reservations), what it publishes, and which addresses it dials."""

from __future__ import annotations

import logging
import socket
from collections import Counter

import trio

from meshd.daemon.state import DaemonState
from meshd.mesh.addresses import is_ip, observed_address
from meshd.mesh.records import ROLE_RELAY, host_of, is_loopback, is_unspecified, join_address, split_address
from meshd.net.rpc import mesh_rpc
from meshd.net.stream import Stream
from meshd.relay.reservations import RelayCandidate, ReservationKeeper
from wire.errors import ErrorCode, ProtocolError
from wire.meshrpc import DialBackReply, DialBackRequest
from wire.stage import PeerRef

log = logging.getLogger(__name__)


class Reachability(DaemonState):
    """This node's own address and reachability, its relays, and the addresses it dials for others."""

    @property
    def address(self) -> str:
        """The address this node publishes ("" until it knows one)."""
        return self.mesh.record.addresses[0] if self.mesh.record.addresses else ""

    @property
    def local_address(self) -> str:
        """Where a command on this host reaches the daemon: the listening host, loopback for a wildcard."""
        host = self.config.listen[0]
        if is_unspecified(host):
            host = "::1" if ":" in host else "127.0.0.1"
        return join_address(host, self.port)

    def _configured_addresses(self) -> list[str]:
        """What to publish before any peer has said where it sees this node: --advertise, else the
        listening host if it is one (never 0.0.0.0 or ::, which nobody can dial), else nothing yet."""
        if self.config.advertise:
            return [self.config.advertise]
        host = self.config.listen[0]
        return [] if is_unspecified(host) else [join_address(host, self.port)]

    def _learns_from_peers(self) -> bool:
        # A first node listening on every interface has no seed to ask: the peers that reach it tell it.
        cfg = self.config
        return not cfg.advertise and not cfg.seeds and not cfg.client and is_unspecified(cfg.listen[0])

    def _learn_address(self, peer: str) -> None:
        """Publishes this host's address on the way to `peer` (its route source), when this node has
        no better one: loopback only while no other peer has come, and a non-loopback one is kept."""
        if not self._learns_from_peers():
            return
        current = self.mesh.record.addresses
        if current and not is_loopback(host_of(current[0])):
            return
        source = route_source(host_of(peer))
        if source is None or (current and is_loopback(source)):
            return
        address = join_address(source, self.port)
        log.info("peers reach this node at %s", address)
        self.mesh.update_record(trio.current_time(), addresses=[address])
        self._flush()

    async def _check_reachability(self) -> None:
        """Asks the seeds where they see this node and to dial it back there.

        The address a seed sees (with the listening port) becomes the published
        one once a seed has dialled it; if every seed that answers fails to,
        the node is behind NAT. `--advertise` is checked but never replaced, and
        a relay stays public by its operator's word. Called again from time to
        time: a changed address is published only with its own dial-back.
        """
        cfg = self.config
        request = DialBackRequest(address=cfg.advertise) if cfg.advertise else DialBackRequest(port=self.port)
        verdicts: list[bool] = []
        seen: Counter[str] = Counter()
        for node_id, address in self._seed_addresses.items():
            try:
                reply = await mesh_rpc(self.peers, address, request, node_id, cfg.dial_back_timeout + 2.0)
            except ProtocolError as exc:
                log.info("seed %s did not dial back: %s", address, exc)
                continue
            if not isinstance(reply, DialBackReply):
                continue
            verdicts.append(reply.reachable)
            if not reply.reachable:
                log.info("seed %s cannot dial this node: %s", address, reply.detail)
                continue
            observed = observed_address(reply.observed, self.port, host_of(address))
            if observed is not None:
                seen[observed] += 1
        if not verdicts:
            return
        changes: dict[str, object] = {}
        if not cfg.relay:
            changes["reachability"] = "public" if any(verdicts) else "nat"
        elif not any(verdicts):
            log.warning("no seed can dial this relay at %s: members behind NAT cannot use it",
                        self.address or f"port {self.port}")
        if seen and not cfg.advertise:
            # The address most seeds agree on: one seed alone cannot move a node that others see elsewhere.
            changes["addresses"] = [seen.most_common(1)[0][0]]
        record = self.mesh.record
        changes = {k: v for k, v in changes.items() if getattr(record, k) != v}
        if changes:
            log.info("published %s", ", ".join(f"{k} {v}" for k, v in changes.items()))
            self.mesh.update_record(trio.current_time(), **changes)
            self._flush()

    async def _recheck_address(self) -> None:
        while True:
            await trio.sleep(self.config.address_check_interval)
            await self._check_reachability()
            self._keep_relays()

    def _keep_relays(self) -> None:
        """Behind NAT, keeps reservations on relays (started once, the first time NAT is found)."""
        if self.mesh.record.reachability != "nat" or self._keeper is not None:
            return
        self._keeper = ReservationKeeper(self.peers, self._relay_candidates, self._publish_relays,
                                         want=self.config.reservations)
        self._nursery.start_soon(self._keeper.run)

    async def _dial_back(self, stream: Stream, request: DialBackRequest) -> DialBackReply:
        # As libp2p's AutoNAT: only the host the request comes from, so nobody can aim us at a third party.
        observed = host_of(stream.link.address)
        if not is_ip(observed):
            return DialBackReply(reachable=False, detail="this link has no IP address to dial back")
        if request.port is not None:
            host, port = observed, request.port
        else:
            parts = split_address(request.address or "")
            if parts is None or parts[0] != observed:
                return DialBackReply(reachable=False, observed=observed,
                                     detail=f"{request.address} is not where you dial from ({observed})")
            host, port = parts
        target = join_address(host, port)
        with trio.move_on_after(self.config.dial_back_timeout):
            try:
                connection = await trio.open_tcp_stream(host, port)
            except OSError as exc:
                return DialBackReply(reachable=False, observed=observed,
                                     detail=f"cannot connect to {target}: {exc.strerror}")
            await connection.aclose()
            return DialBackReply(reachable=True, observed=observed)
        return DialBackReply(reachable=False, observed=observed, detail=f"connecting to {target} timed out")

    def _is_member(self, node_id: str) -> bool:
        """A live member this node has itself probed (a round trip measured): a record planted by
        someone's Sync, of a node nobody here has heard from, does not count."""
        membership = self.mesh.membership
        live = any(r.node_id == node_id for r in membership.live_records())
        return live and membership.rtt(node_id) is not None

    def _public_address(self, node_id: str) -> str | None:
        """Where a member that says it is public can be dialed (its signed record's first address)."""
        record = self.mesh.membership.record_of(node_id)
        if record is None or record.reachability != "public":
            return None
        return next((a for a in record.addresses if not is_unspecified(host_of(a))), None)

    def _has_record(self, node_id: str) -> bool:
        """A live member by its record (a light client such as `meshd ask` has none)."""
        return self.mesh.membership.record_of(node_id) is not None and \
            any(r.node_id == node_id for r in self.mesh.membership.live_records())

    def _relay_candidates(self) -> list[RelayCandidate]:
        records = [r for r in self.live_records() if ROLE_RELAY in r.roles and r.node_id != self.mesh.node_id
                   and r.reachability == "public" and r.addresses]
        return [RelayCandidate(r.node_id, r.addresses[0]) for r in sorted(records, key=lambda r: r.node_id)]

    def _publish_relays(self, addresses: list[str]) -> None:
        log.info("reachable through %s", ", ".join(addresses) or "no relay")
        self.mesh.update_record(trio.current_time(), relay_addresses=addresses)
        self._flush()

    def _reserved_on(self, relay: str) -> bool:
        return self._keeper is not None and self._keeper.reserved_on(relay)

    def may_dial(self, ref: PeerRef) -> None:
        """A stage dials for a session only a live member, at an address its signed record names."""
        if ref.node_id is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a stage dials only a member named by its node id")
        record = next((r for r in self.live_records() if r.node_id == ref.node_id), None)
        if record is None:
            # retryable: gossip may not have brought the record here yet
            raise ProtocolError(ErrorCode.UNREACHABLE, f"node {ref.node_id[:16]} is not a live member here")
        if ref.address not in (*record.addresses, *record.relay_addresses):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, f"{ref.address} is not an address node "
                                                        f"{ref.node_id[:16]} signed")


def route_source(host: str) -> str | None:
    """This host's own address on the way to `host`, as the kernel routes it (no packet is sent)."""
    if not is_ip(host):
        return None
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            source: str = probe.getsockname()[0]
    except OSError:
        return None
    return None if is_unspecified(source) else source
