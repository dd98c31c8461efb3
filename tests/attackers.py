"""Attacking members: meshd's own daemon, in-process, with its records, election, SWIM and RPC
answers patched to lie, and its peer code driven to do what an honest node never does.

Each attacker is a real `MeshDaemon` (real links, Noise, signed records) joined to a real mesh
on loopback; only what it says about itself, or sends, is forged. The honest side never knows
it is under test.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TypeVar

import trio
from hosted import together

from meshd.daemon import MeshDaemon
from meshd.daemon.config import NodeConfig
from meshd.mesh.election import Election, Tracker
from meshd.mesh.membership import Dead, Gossip, Sync, SyncEntry
from meshd.mesh.node import MeshNode
from meshd.mesh.records import CapabilityRecord, ModelInfo, ServedRange
from meshd.net import rpc as net_rpc
from meshd.net.peers import Peers, PeersConfig
from meshd.net.rpc import answer_typed
from meshd.net.stream import Stream
from meshd.stage.receipts import SessionReceipts, Signer
from wire.errors import ProtocolError
from wire.identity import NodeIdentity
from wire.meshrpc import SWIM_PROTOCOL, AssignmentReply, AssignmentRequest, RouteStage
from wire.message import Message
from wire.receipt import Proof, Receipt, Receipts, pack_chain, row_hash, unpack_chain
from wire.stage import STAGE_PROTOCOL, Hop, Metrics, MetricsRequest, Open, Opened, PeerRef, StageInfo, new_session_id
from wire.tensors import Activation, encode_activation

LAST_TERM = 2**63 - 1


class HijackingElection(Election):
    """The attacker's election: its record claims whatever term `term_of` says and votes for
    itself, whatever anyone else does."""

    def __init__(self, node: MeshNode, term_of: Callable[[MeshNode], int], now: float) -> None:
        super().__init__(node.node_id, now)
        self._attacker = node
        self._term_of = term_of

    @property
    def claim(self) -> int:
        return self._term_of(self._attacker)

    @property
    def vote(self) -> Tracker | None:
        return Tracker(self.claim, self._attacker.node_id)


class VotingElection(Election):
    """A sybil's election: its record votes for whatever `vote_of` names, whatever anyone else does,
    and never claims."""

    def __init__(self, node: MeshNode, vote_of: Callable[[], Tracker], now: float) -> None:
        super().__init__(node.node_id, now)
        self._vote_of = vote_of

    @property
    def claim(self) -> int:
        return 0

    @property
    def vote(self) -> Tracker | None:
        return self._vote_of()


class AttackerDaemon(MeshDaemon):
    """An in-process daemon whose behaviour the test patches (see the methods); with no model it
    serves no layers, it only lies."""

    # a range it tells any node asking it for an assignment to load (as a hijacked tracker would)
    assignment_bomb: tuple[str, int, int] | None = None
    # set: it answers stage streams as a stage of the range its record serves that sleeps this long
    # at every step (and signs made-up output); None: stage streams go to a sink
    step_sleep: float | None = None
    # set: that stage says it holds a session whenever asked its metrics, so the tracker's probes
    # (which never take a user's slot) never time it
    looks_busy = False

    def __init__(self, identity: NodeIdentity, config: NodeConfig) -> None:
        super().__init__(identity, config)
        # the control stream of each session its slow stage opened: where that session's receipts go
        self._controls: dict[str, Stream] = {}

    def hijack_election(self, term_of: Callable[[MeshNode], int], **record: object) -> None:
        """Claims the tracker role at the terms `term_of` gives (e.g. always the last one), with
        any record fields it likes (e.g. `started_at=0.0`, to look like the oldest member)."""
        now = trio.current_time()
        self.mesh.election = HijackingElection(self.mesh, term_of, now)
        self.mesh.election.observe(now, self.mesh.record, live=True)
        self.forge(**record)

    def vote_for(self, claim: Callable[[], Tracker]) -> None:
        """Votes for the claim `claim` names (asked anew at each record it signs) from now on, whatever
        the mesh does: a sybil backing its master's bid."""
        now = trio.current_time()
        self.mesh.election = VotingElection(self.mesh, claim, now)
        self.mesh.election.observe(now, self.mesh.record, live=True)
        self.forge()

    def witness(self, against: Receipt, says: bytes) -> Receipt:
        """A receipt of the very step `against` speaks of (model, range, position, rows in, history),
        signed by this attacker, with output rows hashing as `says`: a witness against it."""
        ledger = SessionReceipts(Signer(self.identity), new_session_id(), 0, against.model, against.layer_begin,
                                 against.layer_end)
        mine = ledger.sign(against.pos, against.n_tokens, against.h_in, row_hash(says))
        assert mine.same_step(against)
        return mine

    def forge(self, **record: object) -> CapabilityRecord:
        """Signs and gossips a record saying whatever `record` says (served ranges, speeds, models)."""
        signed = self.mesh.update_record(trio.current_time(), **record)
        self._flush()
        return signed

    def send_swim(self, dest: str, message: Message) -> None:
        """A SWIM message of its own making, sent to `dest` over a real link."""
        self._send(dest, message)  # type: ignore[arg-type]

    async def send_swim_whole(self, dest: str, message: Message, timeout: float = 30.0) -> None:
        """A big SWIM message sent to its end (the daemon's own sends give up after a second)."""
        address = self.address_of(dest)
        with trio.fail_after(timeout):
            stream = await self.peers.open_stream(address, SWIM_PROTOCOL, node_id=dest)
            async with stream:
                await stream.send_message(message)

    async def spam_dead(self, victim: str, to: list[str], every: float, until: float) -> int:
        """Signed `Dead(victim)` at the victim's current incarnation (as this node last saw it: a
        refutation only moves the target) to every node of `to`, every `every` s until `until`."""
        sent = 0
        while trio.current_time() < until:
            record = self.mesh.membership.record_of(victim)
            incarnation = record.version if record is not None else 0
            accusation = Dead(node=victim, incarnation=incarnation, accuser=self.mesh.node_id).signed(self.identity)
            for dest in to:
                self.send_swim(dest, Gossip(version=self.mesh.record.version, gossip=[accusation]))
                sent += 1
            await trio.sleep(every)
        return sent

    async def _on_stage(self, stream: Stream) -> None:
        # a sink: whatever a stage sends it as its next hop or ring is read and dropped
        with contextlib.suppress(ProtocolError, trio.EndOfChannel, trio.BrokenResourceError,
                                 trio.ClosedResourceError):
            if self.step_sleep is not None:
                await answer_typed(stream, self._slow_stage)
            while True:
                await stream.receive_message()

    async def _slow_stage(self, stream: Stream, first: Message) -> None:
        """A stage that is not as fast as its record says: every step sleeps `step_sleep` first."""
        served = self.mesh.record.served[0]
        model = self.mesh.record.model(served.model)
        assert model is not None and self.step_sleep is not None
        if isinstance(first, MetricsRequest):
            await stream.send_message(Metrics(values={"sessions": 1.0 if self.looks_busy else 0.0}))
        elif isinstance(first, Open):
            self._controls[first.session] = stream
            await stream.send_message(Opened(session=first.session, epoch=first.epoch, info=StageInfo(
                node_id=self.mesh.node_id, model_digest=served.model, model_name=model.name,
                layer_begin=served.start, layer_end=served.end, n_layer=model.n_layers, stage_width=8, ready=True)))
        elif isinstance(first, Hop):
            control = self._controls[first.session]
            ledger = SessionReceipts(Signer(self.identity), first.session, first.epoch, served.model,
                                     served.start, served.end)
            while True:
                step = await stream.receive_message()
                if isinstance(step, Activation):
                    await trio.sleep(self.step_sleep)
                    receipt = ledger.sign(step.pos, step.n_tokens, row_hash(b"in"), row_hash(b"made up"))
                    await control.send_message(Receipts(session=first.session, epoch=first.epoch,
                                                        chain=pack_chain([receipt])))

    @property
    def ref(self) -> PeerRef:
        """This attacker as a stage would dial it: a live member at the address its record names."""
        return PeerRef(address=self.address, node_id=self.mesh.node_id)

    async def _answer(self, stream: Stream, request: Message) -> None:
        if isinstance(request, AssignmentRequest) and self.assignment_bomb is not None:
            model, start, end = self.assignment_bomb
            await stream.send_message(AssignmentReply(term=self.mesh.record.tracker_term, model=model,
                                                      start=start, end=end))
            return
        await super()._answer(stream, request)


D = TypeVar("D", bound=MeshDaemon)


@asynccontextmanager
async def running(daemon: D) -> AsyncIterator[D]:
    """``daemon`` started in this process, stopped (its links cut, no goodbye) on exit."""
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        try:
            yield daemon
        finally:
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def attacker(seed: str, config: NodeConfig | None = None) -> AsyncIterator[AttackerDaemon]:
    """An attacker joined to the mesh through `seed`, stopped (its links cut, no goodbye) on exit."""
    base = config or NodeConfig(limits=NodeConfig().limits, peers=PeersConfig())
    async with running(AttackerDaemon(NodeIdentity.generate(), replace(base, seeds=(seed,)))) as daemon:
        yield daemon


def planted_sync(count: int) -> Sync:
    """One Sync carrying `count` members nobody ever heard from (fresh keys, validly signed records
    at loopback addresses nothing listens on): the Sybil flood. CPU-heavy: build it in a thread."""
    now_ms = int(time.time() * 1000)
    entries = []
    for i in range(count):
        record = CapabilityRecord.create(NodeIdentity.generate(), now_ms, addresses=[f"127.0.0.1:{1 + i % 60000}"],
                                         reachability="public", memory_bytes=1 << 30)
        entries.append(SyncEntry(record=record, state="alive"))
    return Sync(reply=False, entries=entries)


def fake_model(real: ModelInfo) -> ModelInfo:
    """A model named like `real`, of its shape, under a digest no file has."""
    return real.model_copy(update={"digest": "sha256:" + "f" * 64})


def every_layer(model: ModelInfo) -> list[ServedRange]:
    return [ServedRange(model=model.digest, start=0, end=model.n_layers)]


@asynccontextmanager
async def sybils(seed: str, n: int) -> AsyncIterator[list[AttackerDaemon]]:
    """`n` attackers joined through `seed` (each a real link and identity), started side by side and
    stopped together on exit (one after another, six stops took some 10 s)."""
    async with together([attacker(seed) for _ in range(n)]) as crowd:
        yield crowd


async def genuine_receipt(peers: Peers, head: RouteStage, model: str) -> Receipt:
    """A receipt the honest head stage `head` really signs: one made-up step of a check session opened on
    it as an asker's spot check (or the tracker's probe) opens one. Anyone may get one."""
    session = new_session_id()
    control = await peers.open_stream(head.address, STAGE_PROTOCOL, node_id=head.node_id)
    async with control:
        opened = await net_rpc.request(control, Open(
            session=session, epoch=0, model_digest=model, layer_begin=head.start, layer_end=head.end,
            upstream=peers.node_id, max_tokens=2, receipts=True, check=True), Opened, "a check session")
        assert opened.info.layer_begin == 0, "the head takes token ids: the only stage this asks"
        hop = await peers.open_stream(head.address, STAGE_PROTOCOL, node_id=head.node_id)
        async with hop:
            await hop.send_message(Hop(session=session, epoch=0, ring=True, prompt_tokens=1,
                                       carry_tokens=int(opened.info.needs_tokens)))
            await hop.send_all(encode_activation(session=session, epoch=0, step=0, pos=0, n_tokens=1, tensors=[],
                                                 tokens=[1]))
            with trio.fail_after(30):
                while not isinstance(message := await control.receive_message(), Receipts):
                    pass
    (receipt,) = unpack_chain(message.chain, session, 0, model)
    assert receipt.verify() and receipt.node_id == head.node_id
    return receipt


def framing(victim: Receipt, witnesses: list[AttackerDaemon]) -> Proof:
    """A divergence "proof" against the honest `victim` receipt: the witnesses sign another output."""
    return Proof(kind="divergence", culprit=victim, witnesses=[w.witness(victim, b"framed") for w in witnesses])
