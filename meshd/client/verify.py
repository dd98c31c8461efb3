"""The asker's output verification: the route's receipts checked step by step, and spot checks on replicas.

With receipts on, the tail hands the asker each step's chain (every stage's
signed receipt) before the step's token. ``Audit`` checks each chain as it
comes: signatures, layers, positions, each stage's input the one before's
output, the head's input the prompt or the token the asker saw last, the
tail's output the token that follows. A chain that fails is the tail's doing
(every honest stage checks the chain it forwards), a token that is not the one
signed is the tail's, and a stage that says its input was corrupt blames its
upstream. Either way a ``StageLied`` names the culprit, and failover routes
around it.

Spot checks catch a stage that computes wrongly but signs what it sent. For a
random 1 in N steps the asker runs a range's steps so far again on a replica
(another node serving the same layers of the same model) and compares output
hashes. The replica needs the same KV, so it gets every input of the range
from the first position: for the head, the token ids (the asker has them);
further on, the rows the stage under check received, which it keeps while
receipts are on and hands over on request. Asking the stage under check costs
no other node anything, and it cannot hand over other rows than it took in:
its own signed receipts fix their hashes. A mismatch is settled by a third
node serving the range (two signed receipts against one make a ``Proof``);
without a third the asker still routes around the stage under check, but has
no proof to pass on.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import trio

from meshd.client.audit import Audit, StageLied
from meshd.client.check_session import CheckSession, open_check_session
from meshd.client.route import Stage, check_opened
from meshd.net.peers import Peers
from meshd.net.stream import Stream
from wire.errors import ErrorCode, ProtocolError
from wire.message import ErrorMessage, error_from_message
from wire.receipt import (
    Proof,
    Receipt,
    Receipts,
    history_next,
    history_start,
    row_hash,
    sampling_bytes,
    unpack_chain,
)
from wire.sketch import PICK_K, ROW_K, ROW_TOLERANCE, Sketches, rows_differ, tokens_differ
from wire.stage import (
    Inputs,
    InputsRequest,
    Sampling,
    StageInfo,
    StepInput,
)
from wire.tensors import encode_activation

log = logging.getLogger(__name__)

DEFAULT_VERIFY = 16
# replicas looked for per range: one to check on, and a third node to settle a mismatch
REPLICAS_WANTED = 2
MAX_PROOFS = 16
# A stage under check hands over the inputs asked of it within this many seconds, plus their rows'
# bytes at INPUTS_RATE (bytes/s, a slow volunteer's uplink), or has failed the check
INPUTS_SECONDS = 10.0
INPUTS_RATE = 1 << 20
# a replay's activations go to its replica in writes of about this size
REPLAY_WRITE_BYTES = 1 << 20


# ----- spot checks


@dataclass
class CheckPlan:
    """How often to check (1 in ``every`` steps; 0: never), and the nodes to check on: any of them
    that serves exactly a range of the route is that range's replica."""

    every: int = DEFAULT_VERIFY
    candidates: list[Stage] = field(default_factory=list)
    rng: random.Random = field(default_factory=random.Random)
    inputs_seconds: float = INPUTS_SECONDS
    # figures for the asker: steps compared on replicas, and checks run
    compared: int = 0
    checks: int = 0
    # of those compared, how many on a replica of other numerics, within a tolerance (wire.sketch)
    across: int = 0


def replicas_of(route: Sequence[Stage], candidates: Sequence[Stage]) -> dict[int, list[Stage]]:
    """The candidates that serve exactly a range of ``route`` (same model), other than its own node."""
    out: dict[int, list[Stage]] = {}
    for i, stage in enumerate(route):
        for c in candidates:
            if (c.layers is not None and c.layers == stage.layers and c.model_digest == stage.model_digest
                    and c.node_id != stage.node_id and c.address != stage.address):
                out.setdefault(i, []).append(c)
    return out


async def run_drawn(steps: trio.MemoryReceiveChannel[int], check: Callable[[int], Awaitable[bool]],
                    checked_until: Callable[[], int], answer_end: Callable[[], int]) -> None:
    """Runs ``check`` up to each position drawn (``Draws``) until it returns False, at most one check
    in flight: later draws wait for (and join) the next. Once the answer is in (the draws end), the
    positions since the last check are checked too: a replica replays every position anyway (it
    needs the KV), so this last one costs a round trip, and no lie goes unchecked because no draw
    came after it."""
    async with steps:
        async for until in steps:
            while True:
                try:
                    until = max(until, steps.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            if not await check(until):
                return
    if checked_until() < answer_end():
        await check(answer_end())


@dataclass
class Draws:
    """A range's draws of the steps to check (1 in ``plan.every``), made as each step comes: only a
    drawn step wakes the range's check (``RangeCheck.run``), not every step of the answer."""

    channel: trio.MemorySendChannel[int]
    plan: CheckPlan

    def send_nowait(self, pos: int, n: int = 1) -> None:
        """Positions up to ``pos`` are in, the last ``n`` of them new (a step's decode row, or a fast
        session's span): each new one is drawn 1 in ``plan.every``, so a span weighs its rows."""
        # one draw a step and range: 0.53 µs (timeit, this box) on a token of tens of milliseconds
        if self.plan.rng.randrange(self.plan.every) < n:
            self.channel.send_nowait(pos)

    def close(self) -> None:
        self.channel.close()


class Inbox:
    """What a stage's control stream brings besides errors: the kept inputs the asker asked for."""

    def __init__(self) -> None:
        self.send, self.receive = trio.open_memory_channel[Inputs](64)


class KeptInputs:
    """The inputs a stage past the head kept of its steps, fetched from it as checks need them, each
    checked against its own signed h_in: the inputs of its range's check, and across numerics the
    outputs of the range before it (the rows it took in are the ones that range signed out). A stage
    forgets what it hands over, so every check that reads them reads them here."""

    def __init__(self, audit: Audit, index: int, stage_stream: Stream, inbox: Inbox, plan: CheckPlan) -> None:
        self.audit = audit
        self.index = index
        self.stage_stream = stage_stream
        self.inbox = inbox
        self.plan = plan
        self.inputs: list[StepInput] = []
        self._at: dict[int, StepInput] = {}
        self.fed_until = 0
        self._lock = trio.Lock()

    def _original(self, pos: int) -> Receipt:
        return self.audit.by_stage[self.index][pos]

    async def fetch(self, until: int, checked_until: int) -> bool:
        """The stage's inputs up to ``until``; False if it ended the session first (its stream's watcher
        says so while the answer still streams: here the check just ends). A stage that withholds them
        is not trusted from ``checked_until`` on (the check's last position that held)."""
        async with self._lock:
            if self.fed_until >= until:
                return True
            return await self._fetch(until, checked_until)

    async def _fetch(self, until: int, checked_until: int) -> bool:
        audit = self.audit
        # the steps the stage signed receipts of and has not handed over yet: exactly these must come
        wanted = sorted(p for p in audit.by_stage[self.index] if self.fed_until <= p < until)
        # the request too: a stage that grants no credit for it stalls the check as surely as one that never answers
        with trio.move_on_after(self._deadline(wanted)) as late:
            try:
                await self.stage_stream.send_message(InputsRequest(session=audit.session, epoch=audit.epoch,
                                                                   until=until))
            except (ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
                return False
            more = True
            while more:
                try:
                    reply = await self.inbox.receive.receive()
                except trio.EndOfChannel:
                    return False
                more = reply.more
                for step in reply.steps:
                    original = audit.by_stage[self.index].get(step.pos)
                    if (original is None or step.tensor is None or step.pos != self._expected_pos()
                            or step.pos >= until):
                        raise self._withheld("it handed over inputs of steps its receipts do not sign, or out "
                                             "of order", checked_until)
                    if step.n_tokens != original.n_tokens or row_hash(step.tensor.data) != original.h_in:
                        raise audit.lie_about(self.index, step.pos, "it handed over other inputs than its receipts sign")
                    self.inputs.append(step)
                    self._at[step.pos] = step
        if late.cancelled_caught:
            raise self._withheld(f"it did not hand over the inputs to check within {self._deadline(wanted):.3g} s",
                                 checked_until)
        if self._expected_pos() < until:
            # an empty or short answer: steps it signed receipts of are kept from the check
            missing = sum(p >= self._expected_pos() for p in wanted)
            raise self._withheld(f"it withheld the inputs of {missing} step(s) its receipts sign", checked_until)
        self.fed_until = until
        return True

    def rows(self, pos: int) -> np.ndarray | None:
        """The rows the stage took in at the step at ``pos`` (the range before it signed them out), if fetched."""
        step = self._at.get(pos)
        if step is None or step.tensor is None:
            return None
        return np.asarray(step.tensor.to_array()).reshape(step.n_tokens, -1)

    def _deadline(self, steps: Sequence[int]) -> float:
        """How long the stage may take to hand over ``steps``' inputs: a round trip's allowance, and their
        rows at a slow link's rate."""
        rows = sum(self._original(p).n_tokens for p in steps)
        width = self.audit.result.route[self.index - 1].stage_width if self.audit.result.route else 0
        return self.plan.inputs_seconds + rows * width * 4 / INPUTS_RATE

    def _withheld(self, reason: str, since: int) -> StageLied:
        """A stage that keeps a check from its inputs has failed it: what it computed since the check's
        last position that held is not trusted (no proof: what it withheld is not evidence anyone can check)."""
        return StageLied(self.index, self.audit.node_ids[self.index], reason, pos=since)

    def _expected_pos(self) -> int:
        return 0 if not self.inputs else self.inputs[-1].pos + self.inputs[-1].n_tokens


class RangeCheck:
    """Spot checks of one range of the route on its replicas: inputs from the stage under check,
    replayed on a replica's check session, receipts compared step by step (across numerics, the
    replica's sketches with the route's outputs: the next stage's kept inputs, ``downstream``)."""

    def __init__(self, peers: Peers, audit: Audit, index: int, source: KeptInputs | None, replicas: list[Stage],
                 sampling: Sampling, plan: CheckPlan, downstream: KeptInputs | None = None) -> None:
        self.peers = peers
        self.audit = audit
        self.index = index
        self.source = source
        self.downstream = downstream
        self.replicas = list(replicas)
        self.sampling = sampling
        self.plan = plan
        # every input of the range fetched so far, in order: a third opinion replays them all
        self.inputs: list[StepInput] = []
        self.fed_until = 0
        # the position up to which a replica's outputs matched the stage's
        self.checked_until = 0
        self.opened: list[_Replay] = []
        self.replica: _Replay | None = None
        # the history hash the stage's receipts must carry, worked out from their inputs
        self.hist = b""
        # why the last replica tried failed, and why the range's checks ended before the answer did
        self.failure = ""
        self.stopped: str | None = None

    @property
    def ranges(self) -> set[int]:
        """The ranges it checks: its own."""
        return {self.index}

    def _original(self, pos: int) -> Receipt:
        return self.audit.by_stage[self.index][pos]

    async def fetch(self, until: int) -> bool:
        """The range's inputs up to ``until``, each checked against the stage's own signed h_in;
        False if the stage ended the session first."""
        audit = self.audit
        if self.index == 0:
            known = audit.result.prompt_tokens + audit.result.tokens
            for pos in sorted(p for p in audit.by_stage[0] if self.fed_until <= p < until):
                r = audit.by_stage[0][pos]
                self._take(StepInput(pos=pos, n_tokens=r.n_tokens, tokens=known[pos:pos + r.n_tokens]))
            self.fed_until = until
            return True
        assert self.source is not None
        if not await self.source.fetch(until, self.checked_until):
            return False
        for step in self.source.inputs[len(self.inputs):]:
            if step.pos < until:
                self._take(step)
        self.fed_until = until
        return True

    def _take(self, step: StepInput) -> None:
        """One more input of the range; the stage's receipt of it must carry the history so far."""
        original = self._original(step.pos)
        if not self.hist:
            tail = self.index == len(self.audit.node_ids) - 1
            assert self.audit.prompt_len is not None
            self.hist = history_start(original.model, original.layer_begin, original.layer_end,
                                      sampling_bytes(self.sampling, self.audit.prompt_len) if tail else b"")
        self.hist = history_next(self.hist, step.pos, step.n_tokens, original.h_in)
        if original.h_hist != self.hist:
            raise self.audit.lie_about(self.index, step.pos, "its receipt's history is not that of its inputs")
        self.inputs.append(step)

    def _expected_pos(self) -> int:
        return 0 if not self.inputs else self.inputs[-1].pos + self.inputs[-1].n_tokens

    async def run(self, steps: trio.MemoryReceiveChannel[int]) -> None:
        try:
            await self._run(steps)
        finally:
            for r in self.opened:
                await r.aclose()

    async def _run(self, steps: trio.MemoryReceiveChannel[int]) -> None:
        await run_drawn(steps, self.check, lambda: self.checked_until, lambda: self.audit.next_pos)

    async def check(self, until: int) -> bool:
        """Replays the range's steps up to ``until`` on a replica; False once no replica answers."""
        self.plan.checks += 1
        if not await self.fetch(until):
            self.stopped = "its stage ended the session before it handed over the inputs to check"
            return False
        while self.replicas:
            if self.replica is None:
                self.replica = await self._start(self.replicas[0])
                if self.replica is None:
                    self.replicas.pop(0)
                    continue
            replica = self.replica
            if replica.cross is not None and self.index != self.audit.tail:
                # the route's outputs to compare the replica's sketches with: the next stage's inputs
                assert self.downstream is not None
                if not await self.downstream.fetch(until, self.checked_until):
                    self.stopped = "the next stage ended the session before it handed over the rows to check"
                    return False
            # a replica that took over from one that failed replays the range from its first step
            fed = replica.sent
            try:
                verdict = await replica.feed(self.inputs[fed:], self._original)
            except (ProtocolError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
                    trio.EndOfChannel) as exc:
                # the replica's failure is not the route's: the next replica checks instead
                log.info("replica %s for a spot check failed: %s", replica.stage.address, exc)
                self.failure = f"{replica.stage.address}: {failure_of(exc)}"
                self.replica = None
                self.replicas.pop(0)
                continue
            self.plan.compared += len(self.inputs) - fed
            if replica.cross:
                self.plan.across += len(self.inputs) - fed
            if verdict is not None:
                if replica.cross:
                    await self.settle_across(replica.stage, replica.why, verdict)
                else:
                    await self.settle(replica.stage, verdict)
                return False
            self.checked_until = until
            return True
        self.stopped = f"every replica failed, the last at {self.failure}"
        return False

    async def _start(self, stage: Stage) -> _Replay | None:
        try:
            replay = await _Replay.open(self.peers, stage, self.audit, self.index, self.sampling, self.downstream)
        except (ProtocolError, trio.BrokenResourceError, trio.EndOfChannel) as exc:
            log.info("replica %s for a spot check: %s", stage.address, exc)
            self.failure = f"{stage.address}: {failure_of(exc)}"
            return None
        self.opened.append(replay)
        return replay

    async def _third_opinion(self, third_stage: Stage, mismatch: Receipt) -> Receipt | None:
        """A third node's receipt of the mismatched step, fed the inputs fetched so far; None if it
        could not give one."""
        third = await self._start(third_stage)
        if third is None:
            return None
        try:
            await third.feed([s for s in self.inputs if s.pos <= mismatch.pos], self._original, stop_at=mismatch.pos)
        except (ProtocolError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
                trio.EndOfChannel) as exc:
            log.info("third node %s for a spot check failed: %s", third_stage.address, exc)
            return None
        return third.at.get(mismatch.pos)

    async def settle(self, replica: Stage, mismatch: Receipt) -> None:
        """``replica``'s output differs from the stage's at one step: a third node's decides, fed the
        inputs fetched so far (up to the step, at least)."""
        original = self._original(mismatch.pos)
        for third_stage in self.replicas[1:]:
            opinion = await self._third_opinion(third_stage, mismatch)
            if opinion is None:
                continue
            if opinion.h_out == mismatch.h_out:
                proof = Proof(kind="divergence", culprit=original, witnesses=[mismatch, opinion])
                raise self.audit.lie_about(self.index, mismatch.pos, f"its output at position {mismatch.pos} "
                                                                     f"differs from two replicas'", proof)
            log.info("replica %s disagreed with the route and a third node: not trusted for checks", replica.address)
            self.stopped = f"its replica {replica.address} disagreed with the route and a third node"
            return
        raise self.audit.lie_about(self.index, mismatch.pos, f"its output at position {mismatch.pos} differs from a "
                                                             f"replica's (no third node to settle it)")

    async def settle_across(self, replica: Stage, why: str, mismatch: Receipt) -> None:
        """A replica of other numerics found the stage's output at one step beyond the tolerance (``why``):
        a third node of the stage's own numerics, fed the inputs fetched so far, decides by bytes. Either
        way no proof: a tolerance across numerics is the asker's judgement, not bytes any node can check."""
        mine = self.audit.result.route[self.index].numerics
        original = self._original(mismatch.pos)
        for third_stage in self.replicas:
            if third_stage is replica or third_stage.numerics not in ("", mine):
                continue
            opinion = await self._third_opinion(third_stage, mismatch)
            if opinion is None:
                continue
            if opinion.h_out == original.h_out:
                log.info("replica %s of other numerics disagreed with the route and a third node: not trusted for "
                         "checks", replica.address)
                self.stopped = f"its replica {replica.address} of other numerics disagreed with the route and a third node"
                return
            raise self.audit.lie_about(self.index, mismatch.pos, f"{why}, and a third node's output differs too")
        raise self.audit.lie_about(self.index, mismatch.pos, f"{why} (no third node of its numerics to settle it)")


def check_numerics(mine: str, info: StageInfo) -> None:
    """A replica computes the bytes of the stage under check (numerics ``mine``; "": not known) only on its
    build and backend: another computes other last bits, and a mismatch would blame an honest stage."""
    if mine and info.numerics and info.numerics != mine:
        raise ProtocolError(ErrorCode.MODEL_MISMATCH, f"it computes with other numerics ({info.numerics}) "
                                                      f"than the stage under check ({mine})")


def failure_of(exc: BaseException) -> str:
    """A replica's failure in words (a timeout or a lost stream says nothing of itself)."""
    if isinstance(exc, trio.TooSlowError):
        return "it stalled"
    if isinstance(exc, ProtocolError):
        return str(exc)
    return "lost its stream"


class _Replay:
    """A check session on one replica: the asker feeds it, it answers each step with its receipt."""

    def __init__(self, stage: Stage, check: CheckSession, hop: Stream, with_ids: bool) -> None:
        self.stage = stage
        self.check = check
        self.session = check.session
        # the model its receipts sign (they do not carry it)
        self.model = check.info.model_digest
        self.control = check.control
        self.hop = hop
        self.node_id = check.info.node_id
        self.at: dict[int, Receipt] = {}
        self.sent = 0
        # the replica gets the token ids with the rows only where the route's stage did: the head,
        # or layers that route by token id
        self.with_ids = with_ids
        # a replica of other numerics than the route's stage (the audit whose outputs it checks within a
        # tolerance, wire.sketch: the next stage's inputs before the tail, ``downstream``, the tokens at it),
        # its sketches by position, and why it disagreed
        self.cross: Audit | None = None
        self.downstream: KeptInputs | None = None
        self.sketches: dict[int, bytes] = {}
        self.why = ""

    @classmethod
    async def open(cls, peers: Peers, stage: Stage, audit: Audit, index: int, sampling: Sampling,
                   downstream: KeptInputs | None = None) -> _Replay:
        assert audit.prompt_len is not None
        mine = audit.result.route[index].numerics
        tail = index == audit.tail
        # the planner names a replica's numerics where they are not the stage's: the asker then compares
        # its sketches within a tolerance (before the tail with the next stage's inputs), only then
        cross = (tail or downstream is not None) and bool(mine) and stage.numerics not in ("", mine)

        def comparable(info: StageInfo) -> None:
            check_opened(stage, info)
            if not cross:
                check_numerics(mine, info)

        known = audit.result.prompt_tokens + audit.result.tokens
        opened = await open_check_session(peers, stage.address, stage.node_id, stage.model_digest, stage.layers,
                                          sampling, 1 << 20, known[:audit.prompt_len],
                                          f"replica {stage.address} opening a check session", comparable,
                                          grammar=audit.grammar if tail else None, generated=audit.generated,
                                          sketch=0 if not cross else PICK_K if tail else ROW_K)
        assert opened.hop is not None, "the asker feeds a replica it opened alone"
        replay = cls(stage, opened, opened.hop, index == 0 or opened.info.needs_tokens)
        if cross and opened.info.numerics != mine:
            replay.cross, replay.downstream = audit, None if tail else downstream
        return replay

    async def feed(self, steps: Sequence[StepInput], original: Callable[[int], Receipt],
                   stop_at: int | None = None) -> Receipt | None:
        """Sends ``steps`` and reads the replica's receipts of them; the first whose output differs
        from the route's (``original(pos)``), or None."""
        batch: list[bytes] = []
        size = 0
        for step in steps:
            # the entry's own field map (it packs as the model does), not a serialized copy per step
            tensors = [] if step.tensor is None else [step.tensor.__dict__]
            batch.append(encode_activation(session=self.session, epoch=0, step=self.sent, pos=step.pos,
                                           n_tokens=step.n_tokens, tensors=tensors,
                                           tokens=step.tokens if self.with_ids else None))
            size += len(batch[-1])
            self.sent += 1
            if size >= REPLAY_WRITE_BYTES:
                await self.hop.send_all(b"".join(batch))
                batch, size = [], 0
        if batch:
            # the steps of a check in one write, not a frame (and its wake-ups) each
            await self.hop.send_all(b"".join(batch))
        # the replica answers the steps fed together in one message, a receipt each, in order
        answered: list[Receipt] = []
        for step in steps:
            if not answered:
                msg, sketches = await self._next_receipt()
                try:
                    answered = list(unpack_chain(msg.chain, self.session, 0, self.model))
                except ProtocolError:
                    answered = []
                if not answered or msg.session != self.session or (
                        self.cross is not None and len(sketches) != len(answered)):
                    raise ProtocolError(ErrorCode.BAD_REQUEST, f"replica {self.stage.address} sent a bad receipt")
                if self.cross is not None:
                    self.sketches.update((a.pos, sketch) for a, sketch in zip(answered, sketches, strict=True))
            r = answered.pop(0)
            if r.node_id != self.node_id or r.pos != step.pos:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"replica {self.stage.address} sent a bad receipt")
            mine = original(r.pos)
            if not r.same_step(mine):
                # the route's receipt carries the history of its inputs (checked): the replica's does not
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"replica {self.stage.address} ran another history")
            if r.h_out != mine.h_out:
                # a replica's receipt counts only against the route (as a witness): its signature is
                # checked there, not for each step it agrees on
                if not r.verify():
                    raise ProtocolError(ErrorCode.BAD_REQUEST, f"replica {self.stage.address} sent a bad receipt")
                self.at[r.pos] = r
                # across numerics, other bits are no lie: only a token beyond the tolerance is
                if self.cross is None or self._disallowed(r):
                    return r
            self.at[r.pos] = r
            if stop_at is not None and r.pos >= stop_at:
                return None
        return None

    def _disallowed(self, r: Receipt) -> bool:
        """Across numerics: whether the route's output at ``r``'s step is beyond what this replica's sketch
        allows (wire.sketch); ``why`` then says how."""
        audit = self.cross
        assert audit is not None and audit.prompt_len is not None
        sketch = self.sketches.get(r.pos, b"")
        if self.downstream is not None:
            rows = self.downstream.rows(r.pos)
            assert rows is not None, "the next stage's inputs are fetched before the replica's are compared"
            try:
                differs = rows_differ(rows, sketch)
            except ProtocolError:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"replica {self.stage.address} sent a bad sketch") from None
            if differs is None:
                return False
            row, error = differs
            self.why = (f"its output at position {r.pos + row} is {error:.3g} from a replica of other numerics' "
                        f"({self.check.info.numerics}; tolerance {ROW_TOLERANCE:g})")
            return True
        known = audit.result.prompt_tokens + audit.result.tokens
        first = max(r.pos, audit.prompt_len - 1) + 1
        verdict = tokens_differ(known[first:r.pos + r.n_tokens + 1], sketch)
        if verdict is None:
            return False
        row, why = verdict
        self.why = (f"its token after position {first - 1 + row} is not what a replica of other numerics "
                    f"({self.check.info.numerics}) allows: {why}")
        return True

    async def _next_receipt(self) -> tuple[Receipts, list[bytes]]:
        """The replica's next receipts, and (across numerics) the sketches that came just before them."""
        sketches: list[bytes] = []
        while True:
            with trio.fail_after(60):
                msg = await self.control.receive_message()
            if isinstance(msg, Sketches) and self.cross is not None and msg.session == self.session:
                sketches = msg.sketches
            if isinstance(msg, Receipts):
                return msg, sketches
            if isinstance(msg, ErrorMessage):
                raise error_from_message(msg)

    async def aclose(self) -> None:
        await self.check.aclose()
