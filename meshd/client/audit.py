"""The asker's audit of a session's receipts: each stage's signed account of its steps, checked as it comes.

On the daemons' path (``Audit``) the tail hands the asker each step's chain
(every stage's signed receipt) before the step's token. Each chain is checked
as it comes: signatures, layers, positions, each stage's input the one
before's output, the head's input the prompt or the token the asker saw last,
the tail's output the token that follows. A chain that fails is the tail's
doing (every honest stage checks the chain it forwards), a token that is not
the one signed is the tail's, and a stage that says its input was corrupt
blames its upstream. Either way a ``StageLied`` names the culprit, and
failover routes around it.

On the fast path (``SpanAudit``) rows go worker to worker and no chain rides
with them: each stage's daemon signs a receipt per span of positions
(``wire.receipt.SPAN``, meshd.engine.spans) and sends it to the asker itself,
off the rows' path (``wire.receipt.span_end`` cuts the spans). A span is
checked once every stage's receipt of it is in:
the head's input is the tokens the asker has, each stage's input the one
before's output (else the upstream is blamed, as a stage on the daemons' path
blames the upstream whose rows it refused), the tail's output the tokens the
asker got. What the spot checks compare (meshd.client.verify) is the same either way:
a range's receipts by position.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import trio

from meshd.client.ask import AskResult, StageError
from meshd.mesh.proofs import BrokenChain, Step, check_chain, check_signatures
from wire.errors import ErrorCode, ProtocolError
from wire.receipt import Link, PackedChain, Proof, Receipt, read_chain, row_hash, span_end
from wire.stage import Grammar

NO_TOKENS = row_hash(b"")


class Draws(Protocol):
    """Who hears of each checked step: a range's spot checks (``meshd.client.verify.Draws``)."""

    def send_nowait(self, pos: int, n: int) -> None: ...

    def close(self) -> None: ...

class StageLied(StageError):
    """A stage of the route lied (or forwarded what an honest stage would not): always worth a retry
    on a route without ``culprit`` (a node id). ``proof`` is set where anyone can check it; ``pos``
    is the first position whose rows the lie touched: tokens sampled from there on are not trusted."""

    def __init__(self, index: int, culprit: str, reason: str, proof: Proof | None = None, pos: int | None = None):
        super().__init__(index, ProtocolError(ErrorCode.PAYLOAD_CORRUPT, f"node {culprit[:16]} lied: {reason}"))
        self.culprit: str = culprit
        self.proof = proof
        self.untrusted_from = pos

    @property
    def retryable(self) -> bool:
        return True


def blamed(exc: StageError, node_ids: Sequence[str | None]) -> StageError:
    """A stage that refused its input as corrupt (a broken receipt chain, rows that are not the
    ones signed) got it from its upstream over an authenticated link, so either the upstream sent
    it or the stage lies that it did to frame it: its word is no evidence the asker can check. As
    on the fast path (``SpanAudit``), both are routed around for the ask and neither is named to the
    mesh."""
    if isinstance(exc, StageLied) or exc.code is not ErrorCode.PAYLOAD_CORRUPT or len(node_ids) < 2:
        return exc
    up = (exc.index - 1) % len(node_ids)
    culprit, reporter = node_ids[up], node_ids[exc.index]
    if culprit is None:
        return exc
    lie = StageLied(up, culprit, f"stage {exc.index} refused its input: {exc.message}")
    lie.also = reporter
    return lie


class Signed(Mapping[int, Receipt]):
    """One stage's receipts by position, kept as the chains they came in: each becomes a ``Receipt``
    only when a spot check or a proof asks for it (and is kept as one from then on)."""

    def __init__(self) -> None:
        self._at: dict[int, tuple[PackedChain, int] | Receipt] = {}

    def put(self, pos: int, chain: PackedChain, k: int) -> None:
        self._at[pos] = (chain, k)

    def __getitem__(self, pos: int) -> Receipt:
        kept = self._at[pos]
        if isinstance(kept, tuple):
            kept = self._at[pos] = kept[0].receipt(kept[1])
        return kept

    def wire(self, pos: int) -> bytes:
        """The receipt at ``pos`` as it travelled."""
        kept = self._at[pos]
        return kept[0].wire(kept[1]) if isinstance(kept, tuple) else kept.wire

    def __iter__(self) -> Iterator[int]:
        return iter(self._at)

    def __len__(self) -> int:
        return len(self._at)


@dataclass
class Audit:
    """Checks one epoch's chains of receipts as the tail hands them over."""

    session: str
    epoch: int
    node_ids: list[str]
    n_layer: int
    result: AskResult
    # where this epoch's prompt ends (prompt and tokens re-prefilled after a failover); None until known
    prompt_len: int | None = None
    next_pos: int = 0
    steps: int = 0
    # where the tail's last receipt is (the ring's next chain starts with it; None: none yet)
    last_tail_pos: int | None = None
    awaiting_token: Link | None = None
    # chains that came before the head's tokens of the prompt did
    pending: list[PackedChain] = field(default_factory=list)
    # every stage's receipts by position, for the spot checks
    by_stage: list[Signed] = field(default_factory=list)
    on_step: list[Draws] = field(default_factory=list)
    # the route's model: the receipts' own, which the chains do not carry (``unpack_chain``)
    model: str = ""
    # the grammar the tail's sampler obeys and how many of the prompt's last ids it read first (a
    # re-prefilled answer): a replica of the tail replays its picks under the same
    grammar: Grammar | None = None
    generated: int = 0
    # where the rows began, past a prefix the stages took from their caches (0: none)
    cached: int = 0

    def __post_init__(self) -> None:
        self.by_stage = [Signed() for _ in self.node_ids]

    @property
    def tail(self) -> int:
        return len(self.node_ids) - 1

    def _lie(self, index: int, reason: str, proof: Proof | None = None, pos: int | None = None) -> StageLied:
        return StageLied(index, self.node_ids[index], reason, proof, self.next_pos if pos is None else pos)

    def prompt_known(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        pending, self.pending = self.pending, []
        for chain in pending:
            self.on_chain(chain)

    def _broken(self, exc: BrokenChain, decode: bool, pos: int | None = None) -> StageLied:
        # a stage that signed over a forged receipt is the liar; otherwise the tail handed it over
        index = self.tail if exc.culprit is None else exc.culprit - (1 if decode else 0)
        return self._lie(index, f"its chain of receipts: {exc}", pos=pos)

    def answerable(self, index: int, pos: int) -> int:
        """Who answers for stage ``index``'s receipt of the step at ``pos``: that stage where its
        signature holds; else the first stage after it whose own holds, which signed over a forgery
        (an honest one checks its sender's); none holding, the tail, which handed them over.

        Signatures are checked only here, where a receipt becomes evidence against its signer (a
        lie, a proof): the answer's correctness rests on the hashes they sign, whose links are
        checked as each chain comes and whose outputs spot checks compare."""
        for k in range(index, len(self.node_ids)):
            if self.by_stage[k][pos].verify():
                return k
        return self.tail

    def lie_about(self, index: int, pos: int, reason: str, proof: Proof | None = None) -> StageLied:
        """The lie stage ``index``'s receipt at ``pos`` shows, laid at whoever answers for the receipt."""
        who = self.answerable(index, pos)
        if who != index:
            return self._lie(who, f"it signed over a forged receipt of stage {index}", pos=pos)
        return self._lie(index, reason, proof, pos)

    def on_packed(self, session: str, epoch: int, packed: bytes) -> None:
        """A chain as the tail hands it over (``on_chain``): one that does not unpack is its doing."""
        try:
            chain = read_chain(packed, session, epoch, self.model)
        except ProtocolError as exc:
            raise self._lie(self.tail, f"its chain of receipts: {exc.message}") from None
        self.on_chain(chain)

    def on_chain(self, chain: PackedChain) -> None:
        if self.awaiting_token is not None:
            raise self._lie(self.tail, "a sampled step's token never came")
        if self.prompt_len is None:
            if len(self.pending) >= 4096:
                raise self._lie(self.tail, "receipts far ahead of the prompt")
            self.pending.append(chain)
            return
        links = chain.links
        pos = self.next_pos
        decode = pos >= self.prompt_len
        if (chain.session, chain.epoch) != (self.session, self.epoch):
            raise self._lie(self.tail, "receipts of another session")
        try:
            # links by hash; signatures where a receipt becomes evidence (``answerable``)
            check_chain(chain, Step(self.session, self.epoch, pos, links[-1].n_tokens, self.n_layer,
                                    self.node_ids[-1], links[-1].h_out, decode), signatures="later")
        except BrokenChain as exc:
            raise self._broken(exc, decode) from None
        first = 1 if decode else 0
        if decode and (self.last_tail_pos is None
                       or chain.wire(0) != self.by_stage[self.tail].wire(self.last_tail_pos)):
            # a proof is built from receipts whose signatures hold
            try:
                check_signatures(chain)
            except BrokenChain as exc:
                raise self._broken(exc, decode) from None
            ring, proof = chain.receipt(0), None
            if self.last_tail_pos is not None:
                last = self.by_stage[self.tail][self.last_tail_pos]
                if ring.same_step(last) and ring.h_out != last.h_out:
                    proof = Proof(kind="equivocation", culprit=ring, witnesses=[last])
            raise self._lie(self.tail, "it gave the head another token than the asker", proof)
        if [links[k].node_id for k in range(first, len(links))] != self.node_ids:
            raise self._lie(self.tail, "receipts of nodes not on the route")
        head, last_link = links[first], links[-1]
        n = head.n_tokens
        for k in range(first, len(links)):
            self.by_stage[k - first].put(pos, chain, k)
        if not decode:
            known = self.result.prompt_tokens + self.result.tokens
            if len(known) >= pos + n and head.h_in != row_hash(np.asarray(known[pos:pos + n], np.int32).tobytes()):
                raise self.lie_about(0, pos, "the head signed another prompt than it tokenized")
        sampled = pos + n >= self.prompt_len
        if sampled == (last_link.h_out == NO_TOKENS):
            raise self._lie(self.tail, "the tail's receipt says it sampled where it cannot have")
        self.awaiting_token = last_link if sampled else None
        self.last_tail_pos = pos
        self._stepped(pos, n)

    def _stepped(self, pos: int, n: int) -> None:
        """Positions ``[pos, pos + n)`` are checked: each range's spot checks may draw them."""
        self.next_pos = pos + n
        self.steps += 1
        for channel in list(self.on_step):
            try:
                channel.send_nowait(self.next_pos, n)
            except trio.BrokenResourceError:
                # that range's checks have ended (no replica left that answers)
                self.on_step.remove(channel)

    def on_token(self, token: int) -> None:
        expected, self.awaiting_token = self.awaiting_token, None
        if self.prompt_len is None:
            return
        if expected is None:
            raise self._lie(self.tail, "a token without a receipt")
        if expected.h_out != row_hash(np.asarray([token], np.int32).tobytes()):
            raise self._lie(self.tail, "a token other than the one its receipt signs")

    def finish(self, reason: str) -> None:
        if self.pending:
            raise self._lie(self.tail, "receipts that no prompt explains")
        if self.awaiting_token is not None and reason != "eog":
            raise self._lie(self.tail, "a sampled step's token never came")




# receipts a stage may send ahead of the slowest stage's (spans): a whole context's worth at 16 a span
MAX_HELD_SPANS = 1 << 12


@dataclass
class SpanAudit(Audit):
    """Checks a fast session's receipts span by span, as each stage sends its own (on its authenticated
    control stream: a receipt that comes on it is its sender's word, so a lie it shows is its sender's)."""

    # each stage's receipts not yet checked, by position, and where its next one must start
    held: list[dict[int, tuple[PackedChain, int]]] = field(default_factory=list)
    sent_until: list[int] = field(default_factory=list)
    # where the asker sealed the session (None: not yet): a stage's last span ends there, short of its end
    sealed_at: int | None = None
    # receipts that came before the prompt's length was known (it cuts the spans), by stage
    early: list[tuple[int, str, int, bytes]] = field(default_factory=list)
    # the answer's tokens before this epoch's (its prompt re-prefills them)
    tokens_before: int = 0
    # set (and replaced) each time spans are checked: the seal waits on it
    progress: trio.Event = field(default_factory=trio.Event)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.held = [{} for _ in self.node_ids]
        self.sent_until = [0] * len(self.node_ids)
        self.tokens_before = len(self.result.tokens)
        self.result.own_seconds = [0.0] * len(self.node_ids)
        self.result.own_rows = 0

    def answerable(self, index: int, pos: int) -> int:
        return index

    def start_at(self, pos: int) -> None:
        """The rows begin at ``pos`` (a cached prefix): so do every stage's spans, and the checks."""
        self.sent_until = [pos] * len(self.node_ids)
        self.next_pos = self.cached = pos

    def on_packed(self, session: str, epoch: int, packed: bytes) -> None:
        raise self._lie(self.tail, "a chain of receipts on the fast path, where each stage sends its own")

    def on_stage(self, index: int, session: str, epoch: int, packed: bytes) -> None:
        """Receipts of stage ``index``'s spans, from that stage."""
        if self.prompt_len is None:
            if len(self.early) >= len(self.node_ids) * 4:
                raise self._lie(index, "receipts before the prompt was read")
            self.early.append((index, session, epoch, packed))
            return
        try:
            chain = read_chain(packed, session, epoch, self.model)
        except ProtocolError as exc:
            raise self._lie(index, f"its receipts: {exc.message}") from None
        if (session, epoch) != (self.session, self.epoch):
            raise self._lie(index, "receipts of another session")
        info = self.result.route[index]
        for k, link in enumerate(chain.links):
            pos = self.sent_until[index]
            boundary = span_end(pos, self.prompt_len)
            end = link.pos + link.n_tokens
            if link.node_id != self.node_ids[index] or (link.layer_begin, link.layer_end) != (
                    info.layer_begin, info.layer_end):
                raise self._lie(index, "receipts of another node or range than its own")
            if link.pos != pos or end > boundary or end < boundary and end != self.sealed_at:
                raise self._lie(index, f"a receipt of [{link.pos}, {end}) where [{pos}, {boundary}) was due")
            if len(self.held[index]) >= MAX_HELD_SPANS:
                raise self._lie(index, "receipts far ahead of the route's")
            if not chain.verify(k):
                # checked as each comes (one per stage and span: some 13 µs a token): a receipt is evidence
                # only with its signature, and this one is its sender's word
                raise self._lie(index, "a receipt with a bad signature (or of another session)")
            self.held[index][pos] = (chain, k)
            self.sent_until[index] = end
        self._advance()

    def on_token(self, token: int) -> None:
        """A token came (the answer's ``result.tokens`` has it): the spans that waited on it are checked."""
        self._advance()

    def prompt_known(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        early, self.early = self.early, []
        for receipts in early:
            self.on_stage(*receipts)
        self._advance()

    def seal(self, until: int) -> None:
        """The answer is in: the rows end at ``until``, so every stage's last span ends there."""
        self.sealed_at = until

    @property
    def sealed(self) -> bool:
        """Every span up to the seal is checked."""
        return self.sealed_at is not None and self.next_pos >= self.sealed_at

    def _advance(self) -> None:
        prompt_len = self.prompt_len
        while prompt_len is not None and all(self.next_pos in held for held in self.held):
            pos = self.next_pos
            got = [held[pos] for held in self.held]
            links = [chain.links[k] for chain, k in got]
            n = links[0].n_tokens
            known = self.result.prompt_tokens + self.result.tokens
            # the head's input is the ids at the span's positions; the tail's output the ids sampled from them
            if len(known) < pos + n + (pos + n >= prompt_len):
                return
            for index, held in enumerate(self.held):
                del held[pos]
                self.by_stage[index].put(pos, *got[index])
            for index, link in enumerate(links):
                if link.n_tokens != n:
                    raise self._lie(index, f"its span at {pos} is {link.n_tokens} rows, the head's {n}", pos=pos)
            if links[0].h_in != row_hash(np.asarray(known[pos:pos + n], np.int32).tobytes()):
                raise self._lie(0, "it signed other input than the answer's tokens", pos=pos)
            for index in range(self.tail):
                if links[index].h_out != links[index + 1].h_in:
                    # Two signed words against each other, on rows only the two of them saw (worker to worker
                    # over the hop's sealed connection): either could be lying to frame the other, so both
                    # are routed around, neither is called a liar before the mesh, and the answer starts again
                    lie = self._lie(index + 1, f"it signed other rows in at {pos} than stage {index} signed out",
                                    pos=pos)
                    lie.also = self.node_ids[index]
                    raise lie
            sampled = known[max(pos, prompt_len - 1) + 1:pos + n + 1]
            if links[-1].h_out != row_hash(np.asarray(sampled, np.int32).tobytes()):
                raise self._lie(self.tail, "tokens other than the ones its receipt signs", pos=pos)
            if pos >= prompt_len:
                # the decode's spans: what each stage signed it spent on them, for the tracker
                for index, link in enumerate(links):
                    self.result.own_seconds[index] += link.t_us / 1e6
                self.result.own_rows += n
            self._stepped(pos, n)
            self.progress.set()
            self.progress = trio.Event()

    def finish(self, reason: str) -> None:
        """The tail's word that the answer ended: its last spans come once the asker seals it."""
