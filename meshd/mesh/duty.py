"""A mesh node's duties around its `MeshNode`, as one sans-IO machine: the tracker's and the volunteer's.

The daemon runs it over real SWIM streams and the clock; the simulation runs
the very same machine over an in-memory network in virtual time:

    duty = MeshDuty(node, config)
    loop:
        wait for a message, a local change or until duty.next_timer()
        duty.handle_message(now, src, msg)  or  duty.handle_timer(now)
        for dest, msg in duty.messages_to_send(): send msg to dest
        for event in duty.events(): act on it (AskAssignment, LoadRange) or log it

As tracker it places every model its live members hold once their news has
settled (a burst of joins costs one assignment), and counts each change of
placement in its own record (`assignment_version`), so gossip tells the
volunteers when to ask again. As a volunteer it asks the tracker for its range
when the tracker or that count changes (again after a backoff if the ask
failed), refuses a range beyond its model or its memory, and asks for the
range to be loaded; the shell loads it beside the old one and says when it
serves, and when its worker goes down and comes back (the range is offered
only while it can serve). Any node answers route and status queries from its
own view.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import replace

from meshd.mesh.assignment import (
    Assignment,
    CoverageError,
    ModelSpec,
    NodeCapacity,
    capacities,
    range_refusal,
    unheld_layers,
)
from meshd.mesh.authority import Exclusions, ProofAgainstSelf, placed_on
from meshd.mesh.duty_events import AskAssignment, AssignmentChanged, DutyConfig, DutyEvent, LoadRange, RangeRefused
from meshd.mesh.election import Tracker
from meshd.mesh.membership import MemberEvent, SwimMessage
from meshd.mesh.node import MeshNode, TrackerChanged, earliest
from meshd.mesh.placement import Placer, served_assignment
from meshd.mesh.probes import Prober, ProbeResult, StageProbe
from meshd.mesh.proofs import check_proof
from meshd.mesh.records import CapabilityRecord, HeldRange, ModelInfo, ServedRange
from meshd.mesh.route_reply import pick_model, route_reply, same_numerics
from meshd.mesh.routing import (
    DEFAULT_SECONDS_PER_LAYER,
    RouteKey,
    SpeedBook,
    StageOption,
    believe,
    route_key,
    stage_hop_seconds,
    stage_options,
)
from meshd.mesh.shortfall import coverage_shortfall
from meshd.mesh.status import held_models, stage_speeds, status_view
from meshd.mesh.traffic import MIN_TRAFFIC_TOKENS, TrafficBook, route_charges
from wire.errors import ErrorCode, ProtocolError
from wire.meshrpc import AssignmentReply, RouteReply, SpeedsReply, StatusReply, TrafficReport, TrafficTaken
from wire.receipt import Proof
from wire.swim import Placement

Range = tuple[int, int]
# proven liars a node keeps (each costs a proof of a few receipts): bounds what a flood of proofs can hold
MAX_LIARS = 1024
# models whose route in use a node keeps (for hysteresis): a mesh holds a handful
MAX_KEPT_ROUTES = 64
# A probe that times a member this many times slower than its placement counted places anew: only
# a gross miss (a member placed at the default and timed far slower, as a slow liar is), never the
# noise of timings (a probe's steps on a shared box vary by tens of per cent, not fourfold), which
# would move ranges (and reload engines) back and forth.
REPLACE_SPEED_RATIO = 4.0
# Member news that can change a placement; "suspect" cannot (suspects still count as live).
_PLACEMENT_NEWS = frozenset({"joined", "alive", "updated", "dead", "left"})



def _capacity_key(record: CapabilityRecord) -> tuple[object, ...]:
    """What placement reads of a record: a new version that changes none of it needs no new placement."""
    return (record.memory_bytes, record.gpu_memory_bytes, record.gpu_layers, record.kv_tokens,
            record.seconds_per_layer, record.leaving, tuple(record.roles),
            tuple((m.digest, m.whole) for m in record.models),
            tuple((h.model, h.start, h.end) for h in record.holds))


class MeshDuty:
    """The duties of one node; see the module's docstring for how it is driven."""

    def __init__(self, node: MeshNode, config: DutyConfig = DutyConfig()) -> None:
        self.node = node
        self.config = config
        # the tracker's books: soft state, rebuilt from gossip by whoever is tracker next
        self.assignments: dict[str, Assignment] = {}
        self.uncovered: dict[str, str] = {}
        # each model's placement over time, with what its hysteresis remembers (departed members' ranges)
        self._placers: dict[str, Placer] = {}
        self._placed_before: dict[str, Assignment] = {}  # the placement each model had before the last
        # why a model is not covered, by digest, with the placement inputs it was worked out from
        self._reasons: dict[str, tuple[object, str]] = {}
        self._capacity_seen: dict[str, tuple[object, ...]] = {}
        self._place_at: float | None = None
        # the volunteer's: which (tracker, assignment_version) the range we hold answers
        self.serving: Range | None = None
        self.loading: Range | None = None
        self.wanted: Range | None = None
        self._down = False  # the served range's worker is restarting
        self._answered: tuple[Tracker, int] | None = None
        self._asking: tuple[Tracker, int] | None = None
        self._ask_at: float | None = None
        self._failures = 0
        self._events: list[DutyEvent] = []
        # nodes proven to lie (meshd.mesh.proofs), with the proof: out of every placement and route
        # (each for an hour unless a new proof renews it: meshd.mesh.authority)
        self.exclusions = Exclusions(MAX_LIARS)
        self.liars: dict[str, Proof] = self.exclusions.proofs
        # stage step times this node timed itself: routes never believe a member faster than these
        self.speeds = SpeedBook()
        # as tracker, it times the stages it placed (each a `StageProbe` event for the shell)
        self.prober = Prober(self.speeds, config.probes) if config.probes is not None else None
        # the stages to probe may have changed (a placement, member news) since the prober last saw them
        self._stages_news = True
        # the route each model's asks got last (without exclusions): kept while nearly the cheapest
        self._routes: dict[str, RouteKey] = {}
        # the speed each member's last placement counted (as believed then): a probe far off it places anew
        self._placed_speeds: dict[str, float] = {}
        # as tracker, what members' asks saw of the stages (meshd.mesh.traffic); routes count it beside the probes
        self.traffic = TrafficBook(node.node_id, config.traffic)
        self.speeds.traffic = self.traffic
        # each member's extra votes for its credit (`credit_weights`): credit gives a member's traffic reports weight
        self._credit: dict[str, int] = {}

    # ----- queries

    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def is_tracker(self) -> bool:
        tracker = self.node.tracker
        return tracker is not None and tracker.node_id == self.node.node_id

    @property
    def awaiting_votes(self) -> bool:
        """This node claims the tracker role and does not see the claim carried yet: the voters that
        carry it may ask it for their ranges before their votes reach it (the shell holds such asks)."""
        return bool(self.node.election.claim) and not self.is_tracker

    @property
    def left_announced(self) -> bool:
        return self.node.left_announced

    @property
    def _left(self) -> bool:
        # a node that said goodbye signs no more records: what the shell reports after that is moot
        return self.node.record.leaving

    def next_timer(self) -> float | None:
        ask_at = self._ask_at if self._ask_at is not None and self._ask_pending() else None
        probe_at = self.prober.next_timer() if self.prober is not None and self.is_tracker else None
        traffic_at = self.traffic.next_timer() if self.is_tracker else None
        return earliest(self.node.next_timer(), self._place_at, ask_at, probe_at, self.exclusions.next_timer(),
                        traffic_at)

    # ----- inputs

    def handle_message(self, now: float, src: str, message: SwimMessage) -> None:
        self.node.handle_message(now, src, message)
        self._settle(now)

    def handle_timer(self, now: float) -> None:
        """Run whatever is due by `now`; calling it early is harmless."""
        self.node.handle_timer(now)
        self.traffic.expire(now)
        if self.exclusions.expire(now):
            self.node.election.disown(now, self.liars)
            if self.is_tracker:
                self._place_at = now  # a member whose exclusion ran out may be placed again
        if self._place_at is not None and now >= self._place_at:
            self._place_at = None
            self._place(now)
        self._probe(now)
        self._settle(now)

    def leave(self, now: float) -> None:
        self.node.leave(now)
        self._settle(now)

    def volunteer(self, now: float, info: ModelInfo) -> None:
        """From now on this node offers to serve `info` (one it fetches, known once its manifest and
        header are here); the shell has put it in the record."""
        self.config = replace(self.config, volunteer=info)
        self._settle(now)

    def held(self, now: float, holds: list[HeldRange]) -> None:
        """What this node holds on disk for fetchers changed: publish it; as tracker, place anew
        (a layer nobody held may be coverable now)."""
        if self._left:
            return
        self.node.update_record(now, holds=holds)
        if self.is_tracker and self._place_at is None:
            self._place_at = now + self.config.settle
        self._settle(now)

    def assignment_reply(self, now: float, reply: AssignmentReply | None) -> None:
        """The tracker's answer to the last `AskAssignment`; None when the ask failed."""
        asked, self._asking = self._asking, None
        if asked is None:
            return
        if reply is None:
            if self._current_ask() is not None and self.node.tracker == asked[0]:
                self._failed(now)  # a tracker that changed meanwhile is asked at once, not after a backoff
        elif self.node.tracker != asked[0] or reply.term != asked[0].term:
            # Not from the tracker we follow now, or for another term: the asker's rpc reached the
            # node it named, but that node no longer speaks for the mesh (or lies about its term):
            # ask again after the backoff a failed ask gets (at once if the tracker changed).
            self._events.append(RangeRefused(reply.start, reply.end,
                                             f"from term {reply.term}, not the tracker followed"))
            if self.node.tracker == asked[0]:
                self._failed(now)
        else:
            self._answered = asked
            self._failures = 0
            self._take(now, reply)
        self._settle(now)

    def range_loaded(self, now: float, start: int, end: int) -> None:
        """The range asked for by `LoadRange` serves now: publish it, in place of the old one."""
        if self.loading != (start, end) or self.config.volunteer is None or self._left:
            return
        self.loading, self.serving, self._down = None, (start, end), False
        self._publish(now)
        self._load_wanted()
        self._settle(now)

    def range_down(self, now: float, start: int, end: int) -> None:
        """The served range's engine worker is down (its supervisor restarts it): stop offering the
        range, so routes avoid this node meanwhile. The placement stands: a restart is not a move."""
        if self.serving == (start, end) and not self._down and not self._left:
            self._down = True
            self.node.update_record(now, served=[])
            self._settle(now)

    def range_up(self, now: float, start: int, end: int) -> None:
        """The served range's worker is back: offer the range again."""
        if self.serving == (start, end) and self._down and not self._left:
            self._down = False
            self._publish(now)
            self._settle(now)

    def range_gone(self, now: float, start: int, end: int) -> None:
        """The served range's engine worker cannot start again (its model file is gone): this node
        volunteers its model no more. Its record stops offering, holding and carrying a placement
        of it, so the tracker places those layers elsewhere and routes no ask here."""
        info = self.config.volunteer
        if self.serving != (start, end) or info is None or self._left:
            return
        self.config = replace(self.config, volunteer=None)
        self.serving = self.loading = self.wanted = None
        self._down = False
        record = self.node.record
        self.node.update_record(now, served=[], placement=None,
                                models=[m for m in record.models if m.digest != info.digest],
                                holds=[h for h in record.holds if h.model != info.digest])
        if self.is_tracker and self._place_at is None:
            self._place_at = now + self.config.settle
        self._settle(now)

    def range_failed(self, now: float, start: int, end: int) -> None:
        """The range could not be loaded: ask again later (the placement may have moved meanwhile)."""
        if self.loading != (start, end):
            return
        self.loading = None
        self._answered = None
        self._failed(now)
        self._settle(now)

    def probe_finished(self, now: float, probe: StageProbe, result: ProbeResult | None) -> None:
        """The shell timed (or failed to time: None) the stage a `StageProbe` named."""
        if self.prober is None:
            return
        swim = self.node.membership.rtt(probe.node_id)
        if result is not None and swim is not None and swim < result.rtt:
            # The probe's own round trip is the stage's to answer, and it is taken off each step: a
            # stage that held that answer back by a step's time looked free. SWIM's is taken off
            # instead where shorter; to look faster a stage must slow its pings too, which every
            # route through it then pays as link time.
            result = replace(result, rtt=swim)
        self.prober.finished(now, probe, result)
        placed, timed = self._placed_speeds.get(probe.node_id), self.speeds.measured(probe.node_id)
        record = self.node.membership.record_of(probe.node_id)
        said = record.seconds_per_layer if record is not None else 0.0
        if self.is_tracker and said and placed and timed is not None and self._place_at is None:
            # (only a member that says its speed is placed by it: see `_believed`)
            if max(said, timed) > REPLACE_SPEED_RATIO * placed:
                # placed as far faster than it runs: where its layers go may be wrong now
                self._place_at = now + self.config.settle
        self._probe(now)

    # ----- outputs

    def messages_to_send(self) -> list[tuple[str, SwimMessage]]:
        return self.node.messages_to_send()

    def events(self) -> list[DutyEvent]:
        out, self._events = self._events, []
        return out

    # ----- answers

    def assignment_for(self, node_id: str) -> AssignmentReply:
        """As tracker: the range `node_id` is to serve."""
        tracker = self.node.tracker
        if tracker is None or tracker.node_id != self.node.node_id:
            raise ProtocolError(ErrorCode.NOT_FOUND, "this node is not the tracker")
        for digest, assignment in self.assignments.items():
            rng = assignment.ranges().get(node_id)
            if rng is not None:
                # signed, so that the asker's record shows every member who placed it (meshd.mesh.authority)
                placement = Placement.create(self.node.identity, tracker.term, node_id, digest, *rng)
                return AssignmentReply(term=tracker.term, model=digest, start=rng[0], end=rng[1], placement=placement)
        return AssignmentReply(term=tracker.term, reason="no range for this node")

    def route(self, model: str | None, exclude: Collection[str],
              address_of: Callable[[CapabilityRecord], str | None],
              fits: Callable[[CapabilityRecord], bool] | None = None) -> RouteReply:
        """The cheapest route for `model` (a digest or a name; None: the mesh's only one) from this node's view;
        `address_of` says where the asker dials each stage, `fits` which members it may be told of."""
        live = self.node.membership.live_records()
        info = pick_model(held_models(live), model)
        model = info.digest
        records = {r.node_id: r for r in live if address_of(r) is not None and (fits is None or fits(r))}
        rtt, own = self.node.membership.rtt, self.node.node_id

        def link_cost(a: str | None, b: str) -> float:
            # From here (the asker's side) the RTT SWIM measured (smoothed there); between stages the
            # bound from this node's RTTs to both (their noise is inside the kept route's margin).
            if a is None or a == own:
                return rtt(b) or 0.0
            return stage_hop_seconds(rtt(a), rtt(b))

        options = stage_options(records.values(), model, assigned=self._assigned(model), speeds=self.speeds, own=own)
        tries = self._timed_first(options)
        # a failover's route keeps each range it replaces on the numerics it was computed with, where it can
        # (the answer so far is theirs): first the options of the routed-around members' numerics on their layers
        around = [r for n in exclude if (r := self.node.membership.record_of(n)) is not None]
        kept = [same for offered in tries if (same := same_numerics(offered, around, records, model)) is not None]
        reply, found = route_reply(info, records, [*kept, *tries], link_cost, {*exclude, *self.liars},
                                   self._routes.get(model), address_of, self.coverage_reason)
        if not exclude:
            # a failover's route (or a spot check's replica) is that asker's: the one in use stays
            self._routes.pop(model, None)
            if len(self._routes) >= MAX_KEPT_ROUTES:
                del self._routes[next(iter(self._routes))]
            self._routes[model] = route_key(found)
        return reply

    def _timed_first(self, options: list[StageOption]) -> list[list[StageOption]]:
        """The stage options to plan from, in turn: as tracker, first only the stages it timed (and
        its own), then all. A member that keeps out of its probes (refusing them, looking busy, gone
        quiet) and so has only its word and the floor is routed only where no timed chain covers."""
        if self.prober is None or not self.is_tracker:
            return [options]
        timed = [o for o in options if o.node_id == self.node_id or self.speeds.measured(o.node_id) is not None]
        return [timed, options] if len(timed) < len(options) else [options]

    def _assigned(self, model: str) -> dict[str, set[Range]] | None:
        """As tracker, the ranges it placed for `model`, now and before its last move (a volunteer
        serves its old range until the new one loads): routes go only over those. None where this
        node holds no placement (not the tracker, or not placed yet): routes follow the records."""
        placed = self.assignments.get(model)
        if not self.is_tracker or placed is None:
            return None
        out: dict[str, set[Range]] = {}
        for assignment in (placed, self._placed_before.get(model)):
            for node_id, rng in (assignment.ranges() if assignment is not None else {}).items():
                out.setdefault(node_id, set()).add(rng)
        return out

    def status(self, address_fits: Callable[[str], bool] | None = None, offset: int = 0) -> StatusReply:
        """The status view from member `offset` on; `address_fits` says which addresses the asker may
        be told (None: all)."""
        membership = self.node.membership
        return status_view(self.node.node_id, membership.members(), membership.live_records(), self.node.tracker,
                           address_fits, self.coverage_reason, offset)

    def speed_view(self) -> SpeedsReply:
        """The seconds per layer this node's routes count for each served range, and where each figure
        came from (as tracker, its probes'; elsewhere only defaults and members' words against themselves)."""
        return SpeedsReply(by=self.node_id, speeds=stage_speeds(self.node.membership.live_records(), self.speeds,
                                                                 self.node_id, self._assigned))

    def coverage_reason(self, info: ModelInfo) -> str:
        """Why the live members cannot cover `info` ("" when they can: it is then only loading or fetching)."""
        live = self.node.membership.live_records()
        unheld = unheld_layers(live, info.digest, info.n_layers)
        if unheld:
            return _unheld_reason(unheld)
        nodes, spec = capacities(live, info.digest), self._spec(live, info)
        # The search behind the reason runs assignment a few dozen times: once per change of its inputs.
        key = (tuple(nodes), spec)
        cached = self._reasons.get(info.digest)
        if cached is None or cached[0] != key:
            cached = (key, (coverage_shortfall(nodes, spec, self.config.policy) or "")[:1024])
            self._reasons[info.digest] = cached
        return cached[1]

    def _spec(self, live: list[CapabilityRecord], info: ModelInfo) -> ModelSpec:
        # the volunteers' own session budgets decide the KV each stage holds, not the tracker's
        kv_tokens = max((r.kv_tokens for r in live if r.model(info.digest) is not None), default=0) \
            or self.config.kv_tokens
        return ModelSpec.from_info(info, kv_tokens)

    # ----- credit

    def credit_weights(self, now: float, extra: dict[str, int]) -> None:
        """Each member's extra votes for its credit (meshd.mesh.credit.extra_votes), from the node's ledger."""
        self.node.election.credit(now, extra)
        self._credit = dict(extra)
        self._settle(now)

    # ----- what real asks saw

    def traffic_report(self, now: float, reporter: str, report: TrafficReport) -> TrafficTaken:
        """As tracker, takes what `reporter`'s ask saw of a route (meshd.mesh.traffic): counted only from a
        member with weight (this node itself, one it placed, or one with credit), within its rate, and
        only for a route of ranges this tracker placed, over enough tokens to time a decode."""
        if not self.is_tracker:
            return TrafficTaken(taken=False, reason="this node is not the tracker")
        if not self._weighs(reporter):
            return TrafficTaken(taken=False, reason="the reporter is neither placed nor credited")
        if not self.traffic.admit(now, reporter):
            return TrafficTaken(taken=False, reason="the reporter reports faster than the rate kept")
        if report.tokens < MIN_TRAFFIC_TOKENS:
            return TrafficTaken(taken=False, reason=f"fewer than {MIN_TRAFFIC_TOKENS} tokens time no decode")
        placed = self.assignments.get(report.model)
        nodes = [s.node_id for s in report.stages]
        # the others are weighed at what this tracker timed (or believes) of them, never at traffic
        records = {r.node_id: r.seconds_per_layer for r in self.node.membership.live_records()}
        base = believe({n: records.get(n, 0.0) for n in nodes}, self.speeds, own=self.node_id, traffic=False)
        rtt = self.node.membership.rtt

        def hop(a: str, b: str) -> float:
            return stage_hop_seconds(*(0.0 if n == self.node_id else rtt(n) for n in (a, b)))

        figures = route_charges(report, self._assigned(report.model), placed.n_layers if placed else 0, hop,
                                lambda n: base[n].seconds_per_layer)
        if figures is None:
            return TrafficTaken(taken=False, reason="not a route of ranges this tracker placed")
        for node_id, figure in figures.items():
            self.traffic.observe(now, reporter, node_id, figure)
        return TrafficTaken(taken=True)

    def _weighs(self, reporter: str) -> bool:
        """Whether a member's word on traffic weighs: this node's own, a member this tracker placed
        (whose capacity it timed), or one with credit for verified work served."""
        return reporter == self.node_id or self._credit.get(reporter, 0) > 0 or \
            any(reporter in a.ranges() for a in self.assignments.values())

    # ----- proven liars

    def accept_proof(self, now: float, proof: Proof) -> str | None:
        """Checks ``proof`` against this node's view (each witness must be placed on the range: as the
        tracker placed it, or elsewhere by the tracker's signed placement in the witness's record,
        never by the witness's own word) and keeps its culprit out of placements and routes for an
        hour (meshd.mesh.authority); returns the culprit if it is news (a new exclusion, or a renewal:
        the shell passes the proof on), None if already known. ProofAgainstSelf for a proof against
        this node, InvalidProof if it does not hold; OVERLOADED past ``MAX_LIARS``."""
        if proof.culprit.node_id == self.node_id:
            raise ProofAgainstSelf("a node never takes a proof against itself")
        live = {r.node_id: r for r in self.node.membership.live_records()}
        followed = self.node.election.followed

        def serves(node_id: str, model: str, begin: int, end: int) -> bool:
            # the tracker counts only ranges it placed: a record's own claim is free to make
            assigned = self._assigned(model)
            if assigned is not None:
                return (begin, end) in assigned.get(node_id, set())
            record = live.get(node_id)
            return record is not None and placed_on(record, followed, model, begin, end)

        def weight(node_id: str) -> int:
            return 1 + self.node.election.extra_votes(node_id)

        culprit = check_proof(proof, serves, weight)
        try:
            news = self.exclusions.add(now, culprit, proof)
        except Exclusions.Full:
            raise ProtocolError(ErrorCode.OVERLOADED, "this node holds as many proven liars as it keeps") from None
        if news:
            self.node.election.disown(now, self.liars)  # a placement it still carries gives it no vote
            if self.is_tracker:
                self._place_at = now
        return culprit if news else None

    # ----- the tracker's duty

    def _probe(self, now: float) -> None:
        """As tracker, starts the stage probes that are due (see meshd.mesh.probes). The stages are
        worked out from the records only when they may have changed or a probe is due, not at each
        timer: a newly placed stage is timed at once, and a quiet mesh costs nothing."""
        if self.prober is None or not self.is_tracker or self._left:
            return
        due = self.prober.next_timer()
        if not self._stages_news and (due is None or now < due):
            return
        self._stages_news = False
        self._events.extend(self.prober.due(now, self._probed_stages()))

    def _probed_stages(self) -> list[StageProbe]:
        """The stages this tracker times: every range of its current placement that a live member
        serves, but its own (this node is no stranger to itself) and proven liars'. Not a range
        from before the last move: it is retiring, with the sessions it still holds, and a node
        answers a metrics request (whether it is busy) for its newest range."""
        live = self.node.membership.live_records()
        stages: list[StageProbe] = []
        for model, assignment in self.assignments.items():
            placed = assignment.ranges()
            for record in live:
                if record.node_id == self.node_id or record.node_id in self.liars or record.leaving:
                    continue
                stages.extend(StageProbe(record.node_id, model, s.start, s.end) for s in record.served
                              if s.model == model and (s.start, s.end) == placed.get(record.node_id))
        return stages

    def _place(self, now: float) -> None:
        if not self.is_tracker or self._left:
            return
        live = [r for r in self.node.membership.live_records() if r.node_id not in self.liars]
        changed = False
        self._placed_speeds = {}  # of the live members only, refilled model by model
        held = held_models(live)
        for digest in set(self._placers) - set(held):
            del self._placers[digest]  # no live member holds it: nothing to come back to
        for digest, info in held.items():
            before = self.assignments.get(digest)
            spec = self._spec(live, info)
            placer = self._placers.get(digest)
            if placer is None:
                # a new tracker starts from what the placed members serve: a change of tracker moves nothing
                placer = self._placers[digest] = Placer(self.config.policy)
                placer.current = served_assignment(self._placed_serving(live, digest), spec)
            try:
                unheld = unheld_layers(live, digest, info.n_layers)
                if unheld:
                    raise CoverageError(_unheld_reason(unheld))
                placed = placer.place(now, self._believed(capacities(live, digest)), spec)
            except CoverageError as exc:
                if before is not None or self.uncovered.get(digest) != str(exc):
                    self.assignments.pop(digest, None)
                    self.uncovered[digest] = str(exc)
                    self._events.append(AssignmentChanged(digest, None, str(exc)))
                    changed = True
                continue
            self.uncovered.pop(digest, None)
            if placed != before:
                if before is not None:
                    self._placed_before[digest] = before
                self.assignments[digest] = placed
                self._events.append(AssignmentChanged(digest, placed))
                changed = True
        if changed:
            self._stages_news = True
            self.node.update_record(now, assignment_version=self.node.record.assignment_version + 1)

    def _placed_serving(self, live: list[CapabilityRecord], digest: str) -> dict[str, Range]:
        """The range of `digest` each live member serves where a tracker this node followed placed it
        there: a member's own word that it serves a range places nothing."""
        followed = self.node.election.followed
        return {r.node_id: (s.start, s.end) for r in live if not r.leaving for s in r.served
                if s.model == digest and placed_on(r, followed, digest, s.start, s.end)}

    def _believed(self, nodes: list[NodeCapacity]) -> list[NodeCapacity]:
        """The nodes with the speeds routes count (`believe`: what this tracker timed, the conservative
        default before that), not their own word: a member saying 1e-9 s/layer must not draw every
        layer to itself."""
        # (not what asks saw: routes follow that at once, and a placement that followed the asks' noise
        # would reload engines for it)
        figures = believe({n.node_id: n.seconds_per_layer for n in nodes}, self.speeds, own=self.node_id,
                          traffic=False)
        # Timings only replace what members say here: one that says nothing counts at the default, timed
        # or not, so a placement weighs stages and hops as it always did, and timing noise moves nothing.
        believed = {n.node_id: figures[n.node_id].seconds_per_layer if n.seconds_per_layer
                    else DEFAULT_SECONDS_PER_LAYER for n in nodes}
        self._placed_speeds.update(believed)
        return [replace(n, seconds_per_layer=believed[n.node_id]) for n in nodes]

    def _news(self, now: float, events: list[MemberEvent | TrackerChanged]) -> None:
        """Schedule a placement when some news can change it."""
        news = False
        if any(isinstance(e, TrackerChanged) or e.kind in _PLACEMENT_NEWS for e in events):
            self._stages_news = True  # a tracker now, a stage served anew, or one gone
        for event in events:
            if isinstance(event, TrackerChanged):
                news = True
                if not self.is_tracker:
                    self._placers.clear()  # another's placement now: this node's memory of its own is stale
                self._ask_at, self._failures = None, 0
                continue
            if event.kind not in _PLACEMENT_NEWS:
                continue
            if event.kind in ("dead", "left"):
                self._capacity_seen.pop(event.node_id, None)
                news = True
                continue
            key = _capacity_key(event.record)
            if self._capacity_seen.get(event.node_id) != key:
                self._capacity_seen[event.node_id] = key
                news = True
        if news and self.is_tracker and self._place_at is None:
            self._place_at = now + self.config.settle

    # ----- the volunteer's duty

    def _current_ask(self) -> tuple[Tracker, int] | None:
        tracker = self.node.tracker
        if tracker is None or self.config.volunteer is None or self.node.record.leaving:
            return None
        record = self.node.membership.record_of(tracker.node_id)
        return tracker, record.assignment_version if record is not None else 0

    def _ask_pending(self) -> bool:
        current = self._current_ask()
        return current is not None and current != self._answered and self._asking is None

    def _maybe_ask(self, now: float) -> None:
        current = self._current_ask()
        if current is None or not self._ask_pending():
            return
        if self._ask_at is not None and now < self._ask_at:
            return
        self._ask_at = None
        tracker = current[0]
        if tracker.node_id == self.node.node_id:
            self._answered = current
            self._take(now, self.assignment_for(self.node.node_id))
            return
        self._asking = current
        self._events.append(AskAssignment(tracker))

    def _failed(self, now: float) -> None:
        self._failures += 1
        self._ask_at = now + min(self.config.retry * 2 ** (self._failures - 1), self.config.retry_max)

    def _take(self, now: float, reply: AssignmentReply) -> None:
        """Loads the range `reply` places this node on, if it can, and carries the tracker's signed
        placement of it in this node's record (none where it refuses the range or the placement is not
        the tracker's; the one it has where the tracker has no range for it)."""
        if reply.model is None:
            # no range for this node (yet): it keeps serving what it serves, and the placement that put it
            # there. A tracker just elected answers so until it has placed, and a placement dropped here
            # would leave it no member placed to start from (`_placed_serving`): it cut the model afresh,
            # swapping ranges between members and routing over none of the old ones until they loaded
            return
        placement = reply.placement if self._load(reply) else None
        tracker = self.node.tracker
        if placement is not None and (tracker is None or (
                placement.tracker, placement.term, placement.node_id, placement.model, placement.start, placement.end)
                != (tracker.node_id, reply.term, self.node_id, reply.model, reply.start, reply.end)):
            placement = None  # not the range it gave, or not by the tracker followed: it would weigh nowhere
        if placement != self.node.record.placement and not self._left:
            self.node.update_record(now, placement=placement)

    def _load(self, reply: AssignmentReply) -> bool:
        """Asks for the range `reply` places this node on to be loaded; False where there is none or
        this node refuses it."""
        info = self.config.volunteer
        if info is None or reply.model is None:
            return False  # no range for us (yet): keep serving what we serve
        start, end = reply.start, reply.end
        own = self.node.record
        refused = range_refusal(info, reply.model, start, end, own, own.kv_tokens or self.config.kv_tokens,
                                self.config.disk_bytes)
        if refused is not None:
            self._events.append(RangeRefused(start, end, refused))
            return False
        self.wanted = (start, end)
        self._load_wanted()
        return True

    def _publish(self, now: float) -> None:
        assert self.config.volunteer is not None and self.serving is not None
        start, end = self.serving
        self.node.update_record(now, served=[ServedRange(model=self.config.volunteer.digest, start=start, end=end)])

    def _load_wanted(self) -> None:
        if self.loading is None and self.wanted is not None and self.wanted != self.serving:
            self.loading = self.wanted
            assert self.config.volunteer is not None
            self._events.append(LoadRange(self.config.volunteer.digest, *self.wanted))

    # -----

    def _settle(self, now: float) -> None:
        events = self.node.events()
        if events:
            self._events.extend(events)
            self._news(now, events)
        self._maybe_ask(now)


def _unheld_reason(unheld: list[Range]) -> str:
    layers = ", ".join(f"[{start}, {end})" for start, end in unheld[:8]) + (", ..." if len(unheld) > 8 else "")
    return f"no member holds layers {layers} on disk, so nobody can serve or fetch them"
