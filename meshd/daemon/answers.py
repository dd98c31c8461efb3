"""The daemon's answers to mesh RPCs, and the routes, status and speeds it asks the tracker for."""

from __future__ import annotations

import logging
import random

import trio

from meshd.daemon.credit import Credit
from meshd.daemon.reachability import Reachability
from meshd.mesh.proofs import InvalidProof
from meshd.mesh.records import address_fits, host_of, record_fits
from meshd.net.rpc import answer_typed, mesh_rpc
from meshd.net.stream import Stream
from wire.credit import CreditsRequest
from wire.errors import ErrorCode, ProtocolError
from wire.meshrpc import (
    STATUS_PAGE,
    AssignmentRequest,
    DialBackRequest,
    LinkStatus,
    RouteReply,
    RouteRequest,
    SpeedsReply,
    SpeedsRequest,
    StatusReply,
    StatusRequest,
    TrafficReport,
    TrafficTaken,
)
from wire.message import Message
from wire.receipt import Proof, ProofAccepted, ProofGossip

log = logging.getLogger(__name__)


# members a node passes a new proof on to (each checks it, and passes it on once if it is news to it)
PROOF_FANOUT = 3
# How long a status waits for the tracker's stage speeds: a status answers even when the tracker does
# not (then with this node's own figures), a second or two late at worst, not an rpc timeout late.
SPEEDS_TIMEOUT = 2.0
# How long a claimant holds an assignment ask for the votes that carry it (a gossip round away), well
# inside the asker's rpc timeout: its voters ask the moment they vote, before their votes arrive here.
CLAIM_WAIT = 2.0


class Answers(Reachability, Credit):
    """Answers to mesh RPCs, from the duty's view: assignments, routes, status, speeds, dial-backs,
    proofs and credit."""

    async def _on_rpc(self, stream: Stream) -> None:
        self._learn_address(stream.link.address)
        await answer_typed(stream, self._answer)

    async def _answer(self, stream: Stream, request: Message) -> None:
        if self.driver is None:
            raise ProtocolError(ErrorCode.OVERLOADED, "this node is still starting", retry_after_ms=500)
        peer = host_of(stream.link.address)
        if isinstance(request, AssignmentRequest):
            await self._votes_for_own_claim()
            reply: Message = self.duty.assignment_for(stream.remote_node_id)
        elif isinstance(request, RouteRequest):
            reply = await self.planned_route(request.model, request.exclude, peer)
        elif isinstance(request, StatusRequest):
            reply = await self.measured_status(peer, request.offset)
        elif isinstance(request, SpeedsRequest):
            reply = self.duty.speed_view()
        elif isinstance(request, DialBackRequest):
            reply = await self._dial_back(stream, request)
        elif isinstance(request, ProofGossip):
            reply = self.take_proof(request.proof, stream.remote_node_id)
        elif isinstance(request, TrafficReport):
            reply = self.duty.traffic_report(trio.current_time(), stream.remote_node_id, request)
        elif isinstance(request, CreditsRequest):
            reply = self.credits(request.offset)
        elif (answered := self.credit.answer(request)) is not None:
            reply = answered
        else:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown mesh request {request.type!r}")
        await stream.send_message(reply)

    async def _votes_for_own_claim(self) -> None:
        """While this node claims the tracker role without seeing the claim carried, waits (at most
        `CLAIM_WAIT`) for the votes: an asker that voted for it asks before its vote gets here, and
        was refused with "not the tracker" in every fresh mesh."""
        with trio.move_on_after(CLAIM_WAIT):
            while self.duty.awaiting_votes:
                await self._tracker_news.wait()

    def take_proof(self, proof: Proof, sender: str | None = None) -> ProofAccepted:
        """A proof that a node lied: checked here before anything is done with it; if its culprit is
        news, it is kept out of routes (and, as tracker, placements) and passed on to a few members,
        each of which checks it again (a node passes each culprit on once, so the flood ends)."""
        try:
            culprit = self.duty.accept_proof(trio.current_time(), proof)
        except InvalidProof as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"the proof does not hold: {exc}") from None
        if culprit is not None:
            log.warning("node %s is proven to lie; kept out of routes", culprit[:16])
            for node_id in self._proof_targets(sender, culprit):
                self._nursery.start_soon(self._pass_proof, node_id, proof)
        return ProofAccepted(culprit=proof.culprit.node_id, news=culprit is not None)

    def _proof_targets(self, sender: str | None, culprit: str) -> list[str]:
        """Who a proof that is news goes on to: the tracker always (it places and plans every route,
        so the liar leaves them mesh-wide at once), and `PROOF_FANOUT` members this node has itself
        heard from (a record planted by a Sync, or one of a member gone quiet, takes no share)."""
        skip = {self.duty.node_id, sender, culprit}
        tracker = self.mesh.tracker
        first = [tracker.node_id] if tracker is not None and tracker.node_id not in skip else []
        membership = self.mesh.membership
        others = [r.node_id for r in self.live_records()
                  if r.node_id not in skip and r.node_id not in first and membership.rtt(r.node_id) is not None]
        return first + random.sample(others, min(PROOF_FANOUT, len(others)))

    async def _pass_proof(self, node_id: str, proof: Proof) -> None:
        try:
            await mesh_rpc(self.peers, None, ProofGossip(proof=proof), node_id=node_id)
        except ProtocolError as exc:
            log.info("passing a proof to %s: %s", node_id[:16], exc)

    def route(self, model: str | None, exclude: list[str] | tuple[str, ...] = (),
              peer: str | None = None) -> RouteReply:
        """A route for `model`; with `peer` (the asker's host), only through nodes it may be told of."""
        return self.duty.route(model, exclude, self.dial_address,
                               None if peer is None else lambda record: record_fits(record, peer))

    async def planned_route(self, model: str | None, exclude: list[str] | tuple[str, ...] = (),
                            peer: str | None = None) -> RouteReply:
        """A route planned by the tracker, the one node that knows which ranges it placed where.

        Any other node's records say only what each member claims to serve: a member signing
        every layer at a made-up speed would win a route planned from them. So a node that is not
        the tracker asks the tracker and hands on its route, with each stage's address as this
        node dials it (and, with `peer`, only members that asker may be told of). With no tracker
        known, or none reachable, it plans from its own records, as before a tracker is elected.
        """
        tracker = self.mesh.tracker
        address = None if tracker is None or tracker.node_id == self.mesh.node_id else self.address_of(tracker.node_id)
        if tracker is None or address is None:
            return self.route(model, exclude, peer)
        request = RouteRequest(model=model, exclude=list(exclude))
        try:
            reply = await mesh_rpc(self.peers, address, request, tracker.node_id, self.config.rpc_timeout)
        except ProtocolError as exc:
            if exc.code in (ErrorCode.NOT_FOUND, ErrorCode.BAD_REQUEST):
                raise  # the tracker's answer: no route, or no such model
            log.info("tracker %s gave no route: %s; planning from this node's records", tracker.node_id[:12], exc)
            return self.route(model, exclude, peer)
        if not isinstance(reply, RouteReply):
            raise ProtocolError(ErrorCode.INTERNAL, f"the tracker answered a route request with {reply.type!r}")
        stages = []
        for stage in reply.stages:
            record = self.mesh.membership.record_of(stage.node_id)
            dial = None if record is None else self.dial_address(record)
            if record is None or dial is None or (peer is not None and not record_fits(record, peer)):
                raise ProtocolError(ErrorCode.UNREACHABLE, f"no address to dial {stage.node_id[:12]} from here",
                                    retry_after_ms=1000)
            stages.append(stage.model_copy(update={"address": dial}))
        return reply.model_copy(update={"stages": stages})

    def status(self, peer: str | None = None, offset: int = 0) -> StatusReply:
        """The mesh as this node sees it, from member `offset` on; with `peer` (the asker's host), only
        addresses it may be told."""
        reply = self.duty.status(None if peer is None else lambda address: address_fits(address, peer), offset)
        update: dict[str, object] = {"fetches": self.fetches[-8:]} if self.fetches else {}
        if not offset:
            update["links"] = [LinkStatus(node_id=link.remote_node_id, path=link.path,
                                          address=link.address if peer is None or address_fits(link.address, peer)
                                          else "", rtt_ms=None if link.rtt is None else link.rtt * 1000.0)
                               for link in sorted(self.peers.links, key=lambda link: link.remote_node_id)
                               [:STATUS_PAGE]]
        if self.relay is not None:
            update["relayed_bytes"] = self.relay.forwarded_bytes
        return reply.model_copy(update=update) if update else reply

    def report_traffic(self, report: TrafficReport) -> TrafficTaken:
        """What this node's own asker saw of a route (meshd.mesh.traffic), as this member's report:
        taken here where this node is the tracker (first-hand), else passed on in the background (the
        asker's answer is done; it does not wait on the tracker), one report at a time (the rest dropped)."""
        tracker = self.mesh.tracker
        if tracker is not None and tracker.node_id == self.mesh.node_id:
            return self.duty.traffic_report(trio.current_time(), self.mesh.node_id, report)
        address = None if tracker is None else self.address_of(tracker.node_id)
        if tracker is None or address is None:
            return TrafficTaken(taken=False, reason="no tracker to report to")
        if self._traffic_passing:
            return TrafficTaken(taken=False, reason="a report is on its way to the tracker already")
        self._traffic_passing = True
        self._nursery.start_soon(self._pass_traffic, address, tracker.node_id, report)
        return TrafficTaken(taken=True, reason="passed on to the tracker")

    async def _pass_traffic(self, address: str, tracker: str, report: TrafficReport) -> None:
        try:
            reply = await mesh_rpc(self.peers, address, report, tracker, self.config.rpc_timeout)
            if isinstance(reply, TrafficTaken) and not reply.taken:
                log.debug("the tracker did not count a traffic report: %s", reply.reason)
        except ProtocolError as exc:
            log.info("passing a traffic report to the tracker %s: %s", tracker[:16], exc)
        finally:
            self._traffic_passing = False

    async def measured_status(self, peer: str | None = None, offset: int = 0) -> StatusReply:
        """`status`, with (on the first page) the stage speeds routes count as `stage_speeds` gives them."""
        reply = self.status(peer, offset)
        if offset:
            return reply
        speeds = await self.stage_speeds()
        return reply.model_copy(update={"speeds": speeds.speeds, "speeds_by": speeds.by})

    async def stage_speeds(self) -> SpeedsReply:
        """The stage speeds routes count and where each came from, as the tracker counts them (it
        plans every route and is the one that times stages); this node's own where no tracker is
        known or it does not answer (then every figure is a default or a member's word against itself)."""
        tracker = self.mesh.tracker
        address = None if tracker is None or tracker.node_id == self.mesh.node_id else self.address_of(tracker.node_id)
        if tracker is None or address is None:
            return self.duty.speed_view()
        try:
            reply = await mesh_rpc(self.peers, address, SpeedsRequest(), tracker.node_id,
                              min(SPEEDS_TIMEOUT, self.config.rpc_timeout))
        except ProtocolError as exc:
            log.info("tracker %s gave no stage speeds: %s", tracker.node_id[:12], exc)
            return self.duty.speed_view()
        if not isinstance(reply, SpeedsReply) or reply.by != tracker.node_id:
            log.info("tracker %s answered a speeds request with %s", tracker.node_id[:12], reply.type)
            return self.duty.speed_view()
        return reply
