"""SWIM membership with Lifeguard suspicion, as a sans-IO state machine.

The daemon feeds it messages and timer ticks with the current time and sends
what it asks to send; nothing here reads a clock or touches a socket.
Destinations and sources are node ids: the daemon's links are authenticated,
so `src` is who really sent a message, and it dials a member through the
addresses in the member's signed capability record.

Membership updates ride on probes, acks and a periodic gossip fan-out, and a
full push-pull state exchange runs now and then and on join. Every "alive"
update carries the member's signed record; its version is the incarnation, so
only a node itself can refute a suspicion of itself. Every message also names
its sender's version, so a node that missed an update pulls it at once.

Its parts: what it says of members and how it is tuned (meshd.mesh.swim_config), the suspicions it
holds, each confirmation weighed by its accuser's authority (meshd.mesh.suspicion), and the queues
and sets it runs on (meshd.mesh.swim_sets).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from meshd.mesh.records import RecordStore, StoreStats, Verdict
from meshd.mesh.suspicion import Suspicions, Weigh, everyone_once
from meshd.mesh.swim_config import EventKind, MemberEvent, MemberInfo, MemberState, SwimConfig, advance, push_pull_scale
from meshd.mesh.swim_sets import BroadcastQueue, Buckets, RandomSet, made
from wire.identity import NodeIdentity
from wire.swim import (
    MAX_SYNC_ENTRIES,
    MAX_UPDATES_PER_MESSAGE,
    SWIM_MESSAGES,
    Ack,
    Alive,
    CapabilityRecord,
    Dead,
    Gossip,
    Ping,
    PingReq,
    Suspect,
    SwimMessage,
    Sync,
    SyncEntry,
    Update,
)

__all__ = [
    "MAX_SYNC_ENTRIES", "MAX_UPDATES_PER_MESSAGE", "SWIM_MESSAGES", "Ack", "Alive", "Dead", "Gossip", "MemberEvent",
    "MemberInfo", "MemberState", "Membership", "Ping", "PingReq", "Suspect", "SwimConfig", "SwimMessage", "Sync",
    "SyncEntry", "Update",
]


_ALIVE, _SUSPECT, _DEAD, _LEFT = MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD, MemberState.LEFT
_LIVE = (_ALIVE, _SUSPECT)
_ACCEPTED = Verdict.ACCEPTED


# ---- internal state ---------------------------------------------------------------------------


@dataclass
class _Member:
    state: MemberState
    incarnation: int
    since: float
    rtt: float | None = None


@dataclass
class _Probe:
    target: str
    seq: int
    sent: float
    acked: bool = False
    helpers: tuple[str, ...] = ()
    indirect_sent: bool = False


# ---- the state machine ------------------------------------------------------------------------


class Membership:
    """One node's SWIM view of the mesh.

    Drive it with `handle_message` for every membership message received and
    `handle_timer` whenever `next_timer()` has passed; after either, send
    `messages_to_send()` and consume `events()`. `refutations` counts the
    suspicions of this node it has refuted.
    """

    def __init__(self, identity: NodeIdentity, record: CapabilityRecord, now: float, config: SwimConfig = SwimConfig(),
                 rng: random.Random | None = None, weigh: Weigh = everyone_once) -> None:
        if record.node_id != identity.node_id or not record.verify():
            raise ValueError("the node's own record must be signed by its identity")
        self._identity = identity
        self._node_id = record.node_id
        self._record = record
        self._config = config
        self._rng = rng or random.Random()
        self._store = RecordStore()
        self._members: dict[str, _Member] = {}
        self._live = RandomSet()
        self._dead: dict[str, None] = {}  # ordered, for reproducible picks
        self._recently_dead: deque[tuple[float, str]] = deque()
        self._gossip_pool_dead: list[str] | None = None  # recently dead and still dead; None: stale
        # by (accuser, accused): the accusations each accuser may still make count; a confirmation
        # counts by its accuser's weight (`weigh`: meshd.mesh.suspicion)
        self.suspicions = Suspicions(self._node_id, config.accusations,
                                     1 / (config.suspicion_mult * config.probe_interval), 4 * config.max_members, weigh)
        self._broadcasts = BroadcastQueue()
        self._outbox: list[tuple[str, SwimMessage]] = []
        self._events: list[MemberEvent] = []
        self._seq = 0
        self._probe: _Probe | None = None
        self._probe_order: list[str] = []
        self._probe_index = 0
        self._relayed: dict[int, tuple[str, int, float]] = {}
        # live members heard from first-hand, and those not yet, in the order they became live
        self._first_hand: set[str] = set()
        self._unconfirmed: deque[str] = deque(maxlen=config.max_members)
        self._introductions = Buckets(config.introductions, config.introductions_per_second, 2 * config.max_members)
        # when this node last refuted a suspicion of itself, and (when, of which version) the next
        # refutation is due that accusations within `refute_interval` of it asked for
        self._refuted = -math.inf
        self._refute_due: tuple[float, int] | None = None
        self._seeds: tuple[str, ...] = ()
        self._joined = True
        self._left = False
        self.refutations = 0
        # Random phases, so a mesh started at once does not tick in lockstep.
        self._next_probe = now + self._rng.random() * config.probe_interval
        self._next_gossip = now + self._rng.random() * config.gossip_interval
        self._next_push_pull = now + self._rng.random() * config.push_pull_interval
        self._next_reconnect = now + self._rng.random() * config.reconnect_interval
        self._next_join = math.inf
        self._next_pull = now

    # ---- queries ----

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def record(self) -> CapabilityRecord:
        return self._record

    @property
    def joined(self) -> bool:
        """True once a push-pull with the mesh has completed (or when started without seeds)."""
        return self._joined

    @property
    def leave_announced(self) -> bool:
        """After `leave`: the last record has gone out as often as any update does, or nobody is left
        to tell. A departing daemon drives the machine until then."""
        return self._left and (self._node_id not in self._broadcasts or not self._live)

    @property
    def record_stats(self) -> StoreStats:
        return self._store.stats

    def state(self, node_id: str) -> MemberState | None:
        if node_id == self._node_id:
            return self._own_state()
        member = self._members.get(node_id)
        return member.state if member else None

    def first_hand(self, node_id: str) -> bool:
        """Whether a live member has sent this node a message over its own authenticated link (since
        it last became live): proof that someone holding its key answers at its address, which a
        record that another member's Sync planted is not."""
        return node_id in self._first_hand

    def record_of(self, node_id: str) -> CapabilityRecord | None:
        return self._record if node_id == self._node_id else self._store.get(node_id)

    def rtt(self, node_id: str) -> float | None:
        """Smoothed round-trip time of direct probes to a member, in seconds."""
        member = self._members.get(node_id)
        return member.rtt if member else None

    def live_count(self) -> int:
        """Members believed alive (suspects included), this node included."""
        return len(self._live) + 1

    def live_records(self) -> list[CapabilityRecord]:
        """Records of this node and of every member believed alive, suspects included."""
        records = [self._record]
        for node_id in self._live:
            # a live member's record is always held: it became live by its record
            record = self._store.get(node_id)
            if record is not None:
                records.append(record)
        return records

    def members(self) -> list[MemberInfo]:
        """Every member this node believes in the mesh (alive or suspect), itself first: what status
        and the console list. A dead or departed member is left out from the moment this node holds
        it so (the table keeps it a while longer for the reconnect loop: `SwimConfig.reap_after`)."""
        own = MemberInfo(self._node_id, self._own_state(), self._record.version, self._record, None)
        out = [own]
        for node_id, member in self._members.items():
            record = self._store.get(node_id)
            if record is not None and member.state in _LIVE:
                out.append(MemberInfo(node_id, member.state, member.incarnation, record, member.rtt))
        return out

    # ---- inputs ----

    def join(self, now: float, seeds: Iterable[str]) -> None:
        """Push-pull with `seeds` (node ids the daemon has links to), again until one answers."""
        self._seeds = tuple(seed for seed in seeds if seed != self._node_id)
        if not self._seeds:
            return
        self._joined = False
        self._send_join(now)

    def leave(self, now: float) -> None:
        """Leave gracefully: sign a last record saying so and spread it. Keep driving the machine
        for a few gossip intervals afterwards so the news gets out."""
        if self._left:
            return
        self._left = True
        self._probe = None
        self._record = self._record.evolve(self._identity, leaving=True)
        update = made(Alive, record=self._record)
        self._broadcasts.put(self._node_id, update)
        for node_id in self._live.sample(self._rng, self._config.gossip_nodes):
            self._send(node_id, made(Gossip, version=self._record.version, gossip=[update]))

    def update_record(self, now: float, **changes: object) -> CapabilityRecord:
        """Publish a new version of this node's record with `changes` (served ranges, load, ...)."""
        if self._left:
            raise RuntimeError("this node has left the mesh")
        self._record = self._record.evolve(self._identity, None, **changes)
        self._broadcasts.put(self._node_id, made(Alive, record=self._record))
        return self._record

    def handle_message(self, now: float, src: str, message: SwimMessage) -> None:
        """A message from `src`, the authenticated node id of the link it came over."""
        if src == self._node_id:
            return
        self._receive(now, src, message)
        if src in self._live:
            self._first_hand.add(src)

    def _receive(self, now: float, src: str, message: SwimMessage) -> None:
        if isinstance(message, Sync):
            self._handle_sync(now, src, message)
            return
        duplicates = 0
        for update in message.gossip:
            if type(update) is Alive and self._held_already(update.record):
                duplicates += 1
                continue
            self._apply(now, update, src)
        self._store.stats.duplicate += duplicates
        held = self._store.version(src)
        if (held is None or held < message.version) and now >= self._next_pull and self._joined:
            # We missed news of the sender: ask for its view (its reply carries its record).
            self._next_pull = now + self._config.probe_interval
            own = made(SyncEntry, record=self._record, state=self._own_state().value)
            self._send(src, made(Sync, reply=True, entries=[own]))
        if isinstance(message, Ping):
            self._send(src, made(Ack, version=self._record.version, seq=message.seq, gossip=self._piggyback()))
        elif isinstance(message, Ack):
            self._handle_ack(now, src, message)
        elif isinstance(message, PingReq):
            self._handle_ping_req(now, src, message)

    def handle_timer(self, now: float) -> None:
        """Run whatever is due by `now`; calling it early or often is harmless."""
        config = self._config
        if not self._left and now >= self._next_probe:
            self._probe_tick(now)
            self._confirm()
            self._next_probe = advance(self._next_probe, config.probe_interval, now)
        probe = self._probe
        if probe and not probe.acked and not probe.indirect_sent and now >= probe.sent + config.probe_timeout:
            self._send_ping_reqs(probe)
        for node_id, incarnation in self.suspicions.due(now):
            self._apply(now, self._accuse(Dead, node_id, incarnation))
        due = self._refute_due
        if due is not None and now >= due[0]:
            self._refute_due = None
            # a record published since supersedes the accused version: nothing is left to refute
            if not self._left and due[1] == self._record.version:
                self._refuted = now
                self._refute()
        if now >= self._next_gossip:
            self._gossip_round(now)
            self._next_gossip = advance(self._next_gossip, config.gossip_interval, now)
        if now >= self._next_push_pull:
            self._push_pull_round(now)
            scaled = push_pull_scale(config.push_pull_interval, self.live_count())
            self._next_push_pull = advance(self._next_push_pull, scaled, now)
        if now >= self._next_reconnect:
            self._reconnect_round(now)
            self._next_reconnect = advance(self._next_reconnect, config.reconnect_interval, now)
        if not self._joined and now >= self._next_join:
            self._send_join(now)

    def next_timer(self) -> float | None:
        """When `handle_timer` next has something to do (never None: push-pull always comes round)."""
        deadline = min(self._next_push_pull, self._next_reconnect)
        if self._broadcasts:
            # An idle gossip tick would send nothing, so it is only a deadline while updates wait.
            deadline = min(deadline, self._next_gossip)
        if not self._left:
            deadline = min(deadline, self._next_probe)
        probe = self._probe
        if probe and not probe.acked and not probe.indirect_sent:
            deadline = min(deadline, probe.sent + self._config.probe_timeout)
        suspected = self.suspicions.next_timer()
        if suspected is not None:
            deadline = min(deadline, suspected)
        if not self._joined:
            deadline = min(deadline, self._next_join)
        if self._refute_due is not None:
            deadline = min(deadline, self._refute_due[0])
        return deadline

    # ---- outputs ----

    def messages_to_send(self) -> list[tuple[str, SwimMessage]]:
        """(destination node id, message) pairs queued since the last call."""
        out, self._outbox = self._outbox, []
        return out

    def events(self) -> list[MemberEvent]:
        out, self._events = self._events, []
        return out

    # ---- probing ----

    def _probe_tick(self, now: float) -> None:
        probe = self._probe
        if probe is not None and not probe.acked:
            member = self._members.get(probe.target)
            if member is not None and member.state in _LIVE:
                self._apply(now, self._accuse(Suspect, probe.target, member.incarnation))
        self._probe = None
        self._prune_relayed(now)
        target = self._next_probe_target()
        if target is None:
            return
        self._seq += 1
        gossip = self._piggyback()
        member = self._members[target]
        if member.state is _SUSPECT:
            # Tell a suspect straight away, so it can refute before the suspicion runs out.
            gossip.insert(0, self._accuse(Suspect, target, member.incarnation))
        self._send(target, made(Ping, version=self._record.version, seq=self._seq, gossip=gossip))
        self._probe = _Probe(target=target, seq=self._seq, sent=now)

    def _confirm(self) -> None:
        """Ping the next live members not heard from first-hand; their ack is what counts (the probe
        round would get to each of them only after a round of every member)."""
        sent = 0
        while self._unconfirmed and sent < self._config.confirmations:
            node_id = self._unconfirmed.popleft()
            if node_id in self._live and node_id not in self._first_hand:
                self._seq += 1
                # No piggybacked news: a planted member would only waste its retransmissions.
                self._send(node_id, made(Ping, version=self._record.version, seq=self._seq, gossip=[]))
                sent += 1

    def _next_probe_target(self) -> str | None:
        # Round robin over a shuffled list, as SWIM does, so every member is probed within a round.
        for _ in range(2):
            while self._probe_index < len(self._probe_order):
                node_id = self._probe_order[self._probe_index]
                self._probe_index += 1
                if node_id in self._live:
                    return node_id
            self._probe_order = list(self._live)
            self._rng.shuffle(self._probe_order)
            self._probe_index = 0
        return None

    def _send_ping_reqs(self, probe: _Probe) -> None:
        probe.indirect_sent = True
        probe.helpers = tuple(self._live.sample(self._rng, self._config.indirect_checks, exclude=(probe.target,)))
        for helper in probe.helpers:
            self._send(helper, made(PingReq, version=self._record.version, seq=probe.seq, target=probe.target,
                                     gossip=self._piggyback()))

    def _handle_ack(self, now: float, src: str, ack: Ack) -> None:
        probe = self._probe
        if probe is not None and ack.seq == probe.seq and (src == probe.target or src in probe.helpers):
            if not probe.acked and src == probe.target:
                member = self._members.get(src)
                if member is not None:
                    sample = now - probe.sent
                    member.rtt = sample if member.rtt is None else 0.8 * member.rtt + 0.2 * sample
            probe.acked = True
            return
        relayed = self._relayed.pop(ack.seq, None)
        if relayed is not None:
            requester, their_seq, _ = relayed
            self._send(requester, made(Ack, version=self._record.version, seq=their_seq, gossip=self._piggyback()))

    def _handle_ping_req(self, now: float, src: str, request: PingReq) -> None:
        if self._store.get(request.target) is None:
            return  # we could not dial it
        self._seq += 1
        self._relayed[self._seq] = (src, request.seq, now + self._config.probe_timeout)
        self._send(request.target, made(Ping, version=self._record.version, seq=self._seq, gossip=self._piggyback()))

    def _prune_relayed(self, now: float) -> None:
        expired = [seq for seq, (_, _, expiry) in self._relayed.items() if expiry <= now]
        for seq in expired:
            del self._relayed[seq]

    # ---- dissemination ----

    def _retransmit_limit(self) -> int:
        return self._config.retransmit_mult * math.ceil(math.log10(self.live_count() + 1))

    def _piggyback(self) -> list[Update]:
        if not self._broadcasts:
            return []
        return self._broadcasts.take(self._config.max_piggyback, self._retransmit_limit())

    def _gossip_round(self, now: float) -> None:
        if not self._broadcasts:
            return
        config = self._config
        sent: list[Update] = []
        for target in self._live.sample(self._rng, config.gossip_nodes):
            updates = self._piggyback()
            if not updates:
                break
            self._send(target, made(Gossip, version=self._record.version, gossip=updates))
            sent = sent or updates
        # One recently dead member also hears the news, so a falsely declared node learns it
        # must refute. It gets a copy that spends no retransmissions: after a partition most
        # of the dead are unreachable, and counting sends to them would starve the living.
        while self._recently_dead and self._recently_dead[0][0] + config.gossip_to_dead <= now:
            self._recently_dead.popleft()
            self._gossip_pool_dead = None
        if self._gossip_pool_dead is None:
            self._gossip_pool_dead = [node_id for _, node_id in self._recently_dead if node_id in self._dead]
        if self._gossip_pool_dead:
            updates = sent or self._piggyback()
            if updates:
                self._send(self._rng.choice(self._gossip_pool_dead),
                           made(Gossip, version=self._record.version, gossip=updates))

    def _sync_state(self) -> list[SyncEntry]:
        entries = [made(SyncEntry, record=self._record, state=self._own_state().value)]
        for node_id, member in self._members.items():
            entries.append(made(SyncEntry, record=self._store.get(node_id), state=member.state.value))
        return entries

    def _send_join(self, now: float) -> None:
        state = self._sync_state()
        for seed in self._seeds:
            self._send(seed, made(Sync, reply=True, entries=state))
        self._next_join = now + self._config.join_retry_interval

    def _push_pull_round(self, now: float) -> None:
        self._reap(now)
        targets = self._live.sample(self._rng, 1)
        if targets:
            self._send(targets[0], made(Sync, reply=True, entries=self._sync_state()))

    def _reconnect_round(self, now: float) -> None:
        if self._dead:
            target = self._rng.choice(list(self._dead))
            self._send(target, made(Sync, reply=True, entries=self._sync_state()))

    def _held_already(self, record: CapabilityRecord) -> bool:
        """Another's record at the version held: most a message brings are, dropped before ``_apply`` as
        ``_apply_alive`` would drop them (1.4M of 1.6M updates in the 200-node simulation)."""
        return self._store.versions.get(record.node_id) == record.version and record.node_id != self._node_id

    def _handle_sync(self, now: float, src: str, sync: Sync) -> None:
        duplicates = 0
        for entry in sync.entries:
            node_id = entry.record.node_id
            if entry.state == "alive" and self._held_already(entry.record):
                duplicates += 1
                continue
            if entry.state == "dead" and node_id not in self._members and node_id != self._node_id:
                self._learn_dead(now, src, entry)
                continue
            self._apply_alive(now, entry.record, src=src)
            # As memberlist does, a remote "dead" about a member we know only makes us suspect it:
            # we may know better. It is the sender's accusation, unsigned: counted as the sender's.
            if entry.state in ("suspect", "dead"):
                self._apply(now, made(Suspect, node=node_id, incarnation=entry.record.version, accuser=src), src)
        self._store.stats.duplicate += duplicates
        self._joined = True
        if sync.reply:
            self._send(src, made(Sync, reply=False, entries=self._sync_state()))

    def _learn_dead(self, now: float, src: str, entry: SyncEntry) -> None:
        # Nothing contradicts the sender about a node we never knew; keep it only so that the
        # reconnect loop can try it, as it would after a partition. A full table keeps no dead.
        if len(self._members) >= self._config.max_members or not self._introduce(now, src):
            return
        if self._store.offer(entry.record) is not _ACCEPTED:
            return
        self._members[entry.record.node_id] = _Member(_DEAD, entry.record.version, now)
        self._dead[entry.record.node_id] = None

    def _reap(self, now: float) -> None:
        expired = [node_id for node_id, member in self._members.items()
                   if member.state in (_DEAD, _LEFT) and member.since + self._config.reap_after <= now]
        for node_id in expired:
            del self._members[node_id]
            self._dead.pop(node_id, None)
            self._store.forget(node_id)

    # ---- applying updates ----

    def _apply(self, now: float, update: Update, src: str | None = None) -> None:
        """`src`: the authenticated sender it came from; None for this node's own updates."""
        if isinstance(update, Alive):
            self._apply_alive(now, update.record, update, src)
        elif update.node == self._node_id:
            # Only our current version can be suspected: a higher one was never signed, it is forged.
            if not self._left and update.incarnation == self._record.version:
                self._refute_accusation(now)
        elif isinstance(update, Suspect):
            self._apply_suspect(now, update, self._accuser(update, src))
        elif src is None:
            self._apply_dead(now, update)
        else:
            # Lifeguard: someone else's "dead" is a suspicion (one more accuser) until our own
            # suspicion times out, sooner the more independent accusers confirm it.
            self._apply_suspect(now, update, self._accuser(update, src))

    def _accuse(self, kind: type[Suspect] | type[Dead], node_id: str, incarnation: int) -> Suspect | Dead:
        return made(kind, node=node_id, incarnation=incarnation, accuser=self._node_id).signed(self._identity)

    def _accuser(self, update: Suspect | Dead, src: str | None) -> str:
        """Who an accusation counts for: its named accuser when that member signed it, else the
        authenticated sender it came from (one peer's word counts once, whatever it names)."""
        if src is None:
            return self._node_id
        if update.accuser == src:
            return src
        record = self._store.get(update.accuser)
        return update.accuser if record is not None and update.verify(record.public_key) else src

    def _introduce(self, now: float, src: str) -> bool:
        """Whether `src` may introduce one more member now (a token bucket per sender)."""
        return self._introductions.take(src, now)

    def _make_room(self, now: float, src: str | None, node_id: str) -> bool:
        """Whether a member we hold no entry for may be added: within `src`'s introductions (its own
        record always is) and the table's cap, for which the longest dead member makes way."""
        if src is not None and src != node_id and not self._introduce(now, src):
            return False
        if len(self._members) < self._config.max_members:
            return True
        if not self._dead:
            return False
        oldest = next(iter(self._dead))
        del self._members[oldest]
        del self._dead[oldest]
        self._store.forget(oldest)
        self._gossip_pool_dead = None
        return True

    def _apply_alive(self, now: float, record: CapabilityRecord, update: Alive | None = None,
                     src: str | None = None) -> None:
        node_id = record.node_id
        if node_id == self._node_id:
            # A record of ours newer than the one we hold: from a previous run. Supersede it.
            if not self._left and record.version > self._record.version and record.verify():
                self._refute(record.version)
            return
        if node_id not in self._members:
            # Checked before the signature: a flood of fresh records costs no verification.
            held = self._store.version(node_id)
            if (held is None or record.version > held) and not self._make_room(now, src, node_id):
                return
        if self._store.offer(record) is not _ACCEPTED:
            return
        self._broadcasts.put(node_id, update or made(Alive, record=record))
        # Accusations name a version we hold (see _accusable), so a newer record beats any of them.
        member = self._members.get(node_id)
        previous = member.state if member else None
        if member is None:
            member = self._members[node_id] = _Member(_DEAD, record.version, now)
        member.incarnation = record.version
        self._end_suspicion(node_id)
        if record.leaving:
            self._set_state(now, node_id, member, _LEFT)
            if previous is not None and previous is not _LEFT:
                self._events.append(MemberEvent("left", node_id, record))
            return
        self._set_state(now, node_id, member, _ALIVE)
        kind: EventKind
        if previous is None or previous is _LEFT:
            kind = "joined"
        elif previous is _ALIVE:
            kind = "updated"
        else:
            kind = "alive"
        self._events.append(MemberEvent(kind, node_id, record))

    def _accusable(self, update: Suspect | Dead) -> _Member | None:
        """The live member an accusation is about, if it names the version we hold.

        One naming a version its node never published would force that node to refute
        above it, so it is dropped rather than believed."""
        member = self._members.get(update.node)
        if member is None or member.state not in _LIVE or update.incarnation != member.incarnation:
            return None
        return member

    def _apply_suspect(self, now: float, update: Suspect | Dead, accuser: str) -> None:
        node_id = update.node
        member = self._accusable(update)
        if member is None:
            return
        n = self.live_count()
        min_timeout = self._config.suspicion_mult * max(1.0, math.log10(n)) * self._config.probe_interval
        # Lifeguard expects suspicion_mult - 2 confirmations, when there are enough others to give them.
        expected = int(self._config.suspicion_mult) - 2
        if n - 2 < expected:
            expected = 0
        news = self.suspicions.accuse(now, node_id, update.incarnation, accuser,
                                      (min_timeout, self._config.suspicion_max_mult * min_timeout, expected))
        if news is None:
            return
        self._broadcasts.put(node_id, update)
        if news == "confirmed":
            return
        self._set_state(now, node_id, member, _SUSPECT)
        self._event("suspect", node_id)

    def _apply_dead(self, now: float, update: Dead) -> None:
        node_id = update.node
        member = self._accusable(update)
        if member is None:
            return
        self._end_suspicion(node_id)
        self._set_state(now, node_id, member, _DEAD)
        self._broadcasts.put(node_id, update)
        self._event("dead", node_id)

    def _event(self, kind: EventKind, node_id: str) -> None:
        # an accused member is one we hold a record of (see _accusable)
        record = self._store.get(node_id)
        if record is not None:
            self._events.append(MemberEvent(kind, node_id, record))

    def _refute_accusation(self, now: float) -> None:
        """Refutes an accusation of this node's current version now, or at the end of
        `refute_interval` after the last refutation (one for every accusation until then)."""
        if now >= self._refuted + self._config.refute_interval:
            self._refuted = now
            self._refute()
        elif self._refute_due is None:
            self._refute_due = (self._refuted + self._config.refute_interval, self._record.version)

    def _refute(self, superseded: int | None = None) -> None:
        """Sign a record newer than our current one (and than `superseded`, a previous life's)."""
        self.refutations += 1
        version = max(superseded or 0, self._record.version) + 1
        self._record = self._record.evolve(self._identity, version=version)
        self._broadcasts.put(self._node_id, made(Alive, record=self._record))

    def _end_suspicion(self, node_id: str) -> None:
        self.suspicions.end(node_id)

    def _set_state(self, now: float, node_id: str, member: _Member, state: MemberState) -> None:
        if member.state is state:
            return
        member.state = state
        member.since = now
        if state in _LIVE:
            if node_id not in self._live:
                self._live.add(node_id)
                # Into the rest of this probe round at random, as memberlist does, so a newcomer
                # is probed as soon as everyone else rather than after a whole round.
                position = self._rng.randint(self._probe_index, len(self._probe_order))
                self._probe_order.insert(position, node_id)
                self._unconfirmed.append(node_id)
            self._dead.pop(node_id, None)
        else:
            self._live.discard(node_id)
            # One that comes back must be heard from again.
            self._first_hand.discard(node_id)
            if state is _DEAD:
                self._dead[node_id] = None
                self._recently_dead.append((now, node_id))
            else:
                self._dead.pop(node_id, None)
        self._gossip_pool_dead = None

    def _own_state(self) -> MemberState:
        return _LEFT if self._left else _ALIVE

    def _send(self, dest: str, message: SwimMessage) -> None:
        self._outbox.append((dest, message))

