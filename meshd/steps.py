"""The rules of a step, once for both data planes: the stage service's (rows through the daemons)
and the engine worker's fast path (rows worker to worker) check a peer's step and accept drafts
with these functions, so the two agree byte for byte on what they take and what they refuse.

Sans-IO: plain values in, a typed ``ProtocolError`` out (the same code and words on either plane),
nothing of the session's state kept here. Where it applies, each check runs before a byte of the
step's rows is decoded.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from wire.errors import ErrorCode, ProtocolError


def rewinds(pos: int, next_pos: int, draft_from: int | None) -> bool:
    """Whether a step at ``pos`` starts inside the drafted rows before it (``[draft_from, next_pos)``):
    the drafts from there on were rejected, and their KV goes before this step's rows take its place."""
    return draft_from is not None and draft_from <= pos < next_pos


def check_rows(pos: int, n: int, drafts: int, next_pos: int, may_rewind: bool, prompt_len: int | None,
               budget: int) -> None:
    """A step's position, row count and drafts against the session: it starts where the stage's KV
    ends (or, ``may_rewind``, inside the drafts before it), drafts follow a verified row after the
    prompt, and it ends within the session's ``budget`` of positions on this stage."""
    if pos != next_pos and not may_rewind:
        raise ProtocolError(ErrorCode.CACHE_MISS, f"activation at position {pos}, this stage holds "
                                                  f"positions up to {next_pos}")
    if n < 1:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "an activation carries at least one token")
    if drafts and (drafts >= n or prompt_len is None or pos < prompt_len):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{drafts} drafted rows of {n} at position {pos}: drafts "
                                                   f"follow a verified row, after the prompt")
    if pos + n > budget:
        raise ProtocolError(ErrorCode.OVERLOADED, f"session needs {pos + n} tokens, this stage's session "
                                                  f"budget is {budget}")


def check_ring(pos: int, n: int, drafts: int, sent_pos: int, sent_drafts: int) -> None:
    """The tail's step that comes back around the ring is the one it sent: its token at ``sent_pos``
    with the ``sent_drafts`` drafted after it."""
    if (pos, n, drafts) != (sent_pos, sent_drafts + 1, sent_drafts):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"a step of {n} rows ({drafts} drafted) at {pos}: the ring's "
                                                   f"token went at {sent_pos}, with {sent_drafts} drafts")


def check_kind(head: bool, has_ids: bool, has_rows: bool, n: int, drafts: int, gets_ids: bool,
               ring: bool = True) -> None:
    """What a step carries: the head takes token ids alone, and from the ring (``ring``: not a check
    session's replay, whose prompt comes in chunks) a token and its drafts a step; another stage
    takes rows, with the ids exactly where the session sends it them (a stage the ids need not
    reach must not see them)."""
    if head:
        if not has_ids or has_rows:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the head takes token ids, not hidden states")
        if ring and n != drafts + 1:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"the head takes a token and its drafts a step from the "
                                                       f"ring, not {n} ids with {drafts} drafted")
        return
    if not has_rows:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a stage after the head takes hidden states")
    if has_ids != gets_ids:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "token ids on rows of a session that sends this stage none"
                            if has_ids else "the session sends this stage the token ids: the activation must "
                                            "carry the token ids")


def check_ids(tokens: Sequence[int] | np.ndarray, n_vocab: int) -> None:
    """Every token id in the vocabulary [0, n_vocab)."""
    ids = np.asarray(tokens)
    bad = np.flatnonzero((ids < 0) | (ids >= n_vocab))
    if len(bad):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"token id {int(ids[bad[0]])} is outside the vocabulary "
                                                   f"[0, {n_vocab})")


def check_finite(hidden: np.ndarray) -> None:
    """Hidden states of finite floats: a NaN or an infinity spreads through every later layer."""
    if not np.isfinite(hidden).all():
        raise ProtocolError(ErrorCode.PAYLOAD_CORRUPT, "hidden states hold NaN or infinity")


def draft_holds(drafts: Sequence[int], i: int, pick: int) -> bool:
    """Whether the tail's ``i``-th pick of a step agrees with the draft after it: the picks up to and
    including the first that does not are the answer's (its sampler drew exactly what it would
    have without drafts), the rows after it are never sampled."""
    return i < len(drafts) and pick == drafts[i]


def accepted(picks: Sequence[int], drafts: Sequence[int]) -> int:
    """How many drafts the tail's picks agree with, in order (``draft_holds``)."""
    n = 0
    while n < len(picks) and draft_holds(drafts, n, picks[n]):
        n += 1
    return n


def ends(eog: bool, generated: int, max_tokens: int) -> bool:
    """Whether a sampled token ends the answer: the model ended its turn, or it is the last token asked
    for (``generated`` counts the answer's tokens with this one, an end-of-generation token not among them)."""
    return eog or generated >= max_tokens
