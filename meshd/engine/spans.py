"""A fast session's receipt spans at one stage: which rows are final, and each span's hashes (sans-IO).

On the fast path the engine worker hashes what its stage took in and put out,
and its daemon signs (meshd.stage.signing): the rows never wait for a
signature. One receipt covers a span of positions (``wire.receipt.span_end``
cuts them: up to ``SPAN`` long, a short one where the prompt ends; the last
ends where the answer does, when the asker seals the session), not an engine step, so every stage of a route signs
the same spans whatever steps it ran them in, and a replica replays a span as
one step: the engine is batch-invariant, so a span's rows are the same bytes
however its steps were cut, and its hashes (``row_hash`` of the span's rows in
order, as a step's on the daemons' path) the same.

A row that is not a draft is final once computed. Speculation's drafted rows
may be dropped (the next step starts where the drafts went wrong, and every
stage drops the KV from there on), so a drafted row is final once a step starts
after it, or once the asker seals the session. A span is hashed once its rows
are final: the asker hands its client the tokens of a span only once every
stage's receipt of it is in and agrees, so a span must not wait on a later step
when nothing in it can change. At the tail a row's output is the token
sampled from it (none for the prompt's rows before its last), so its span's
``h_out`` signs the tokens the asker got.

Each span also carries the stage's own time on its rows (``us``): each step's, from its rows coming
whole to its output's send, summed into the span open when the step ran (a step across a span's end
counts in the first). The tracker reads it against what the asker waited (meshd.mesh.traffic).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from wire.receipt import row_hash, span_end


class SpanError(ValueError):
    """A step that does not follow the rows before it (a peer's fault: the worker fails its session)."""


@dataclass(frozen=True)
class Span:
    """One closed span: its positions, its hashes, and (kept for spot checks) its input as it came."""

    pos: int
    n: int
    h_in: bytes
    h_out: bytes
    rows_in: bytes = b""
    # the token ids that came with the rows (a stage whose layers route by token id), else empty
    ids: bytes = b""
    # the stage's own time on the span's steps, µs
    us: int = 0


@dataclass
class SpanBook:
    """One session's rows at one stage, hashed span by span once final."""

    span: int
    # where the prompt ends (a span is cut there: ``span_end``)
    prompt_len: int = 0
    # whether closed spans' inputs are kept until the asker takes them (every stage but the head, whose
    # input is token ids the asker has)
    keep: bool = False
    # the first position of the open span: rows before it are in closed spans
    start: int = 0
    ins: list[bytes] = field(default_factory=list)
    outs: list[bytes] = field(default_factory=list)
    ids: list[bytes] = field(default_factory=list)
    kept: list[Span] = field(default_factory=list)
    # the stage's own time on the open span's steps so far, seconds
    held: float = 0.0

    def step(self, pos: int, ins: Sequence[bytes], outs: Sequence[bytes], ids: Sequence[bytes] = (),
             drafts: int = 0, held: float = 0.0) -> list[Span]:
        """A step ran rows ``[pos, pos + len(ins))``, its last ``drafts`` rows drafts, in ``held``
        seconds of this stage's: the rows before ``pos`` are final (those from it on were drafts,
        dropped), and so are the step's own but its drafts; returns the spans that closed."""
        if len(outs) != len(ins) or ids and len(ids) != len(ins) or not 0 <= drafts <= len(ins):
            raise SpanError("a step's rows, outputs, ids and drafts differ in count")
        closed = self._settle(pos)
        self.held += max(0.0, held)
        self.ins += ins
        self.outs += outs
        self.ids += ids or [b""] * len(ins)
        return closed + self._close_until(pos + len(ins) - drafts)

    def seal(self, until: int) -> list[Span]:
        """The session ends at ``until``: the rows before it are final, the open span closes there."""
        closed = self._settle(until)
        if self.ins:
            closed.append(self._close(len(self.ins)))
        return closed

    def take(self, until: int) -> list[Span]:
        """The kept spans that start before ``until``, in order; forgotten once taken."""
        n = 0
        while n < len(self.kept) and self.kept[n].pos < until:
            n += 1
        taken, self.kept = self.kept[:n], self.kept[n:]
        return taken

    def _settle(self, pos: int) -> list[Span]:
        held = pos - self.start
        if held < 0 or held > len(self.ins):
            raise SpanError(f"a step at {pos}, the rows held run [{self.start}, {self.start + len(self.ins)})")
        del self.ins[held:], self.outs[held:], self.ids[held:]
        return self._close_until(pos)

    def _close_until(self, final: int) -> list[Span]:
        """Closes the spans whose rows are all final: those that end at or before ``final``."""
        closed = []
        while self.ins and (end := span_end(self.start, self.prompt_len, self.span)) <= final:
            closed.append(self._close(end - self.start))
        return closed

    def _close(self, n: int) -> Span:
        rows_in = b"".join(self.ins[:n])
        span = Span(self.start, n, row_hash(rows_in), row_hash(b"".join(self.outs[:n])),
                    rows_in if self.keep else b"", b"".join(self.ids[:n]) if self.keep else b"",
                    round(self.held * 1e6))
        self.held = 0.0
        del self.ins[:n], self.outs[:n], self.ids[:n]
        self.start += n
        if self.keep:
            self.kept.append(span)
        return span
