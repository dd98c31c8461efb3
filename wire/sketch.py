"""Sketches of a step's output, for spot checks across numerics fingerprints.

A replica of another build or backend (CPU against Vulkan, x86 against ARM) computes other last bits
than the stage under check, so comparing hashes would blame an honest stage. Across fingerprints a
check session's replica sends, with its receipts, a sketch of its own output, and the asker compares
the route's output with it under a measured tolerance (as TOPLOC does), never bytes:

* rows (a range before the tail): the ``k`` entries of each row largest in magnitude, their indices
  and values; the route's row must hold each of those values within ``ROW_TOLERANCE`` of it
  (relative: the error a backend makes grows with the value);
* picks (the tail): each sampled token, the ``k`` likeliest tokens' log-probabilities and the row's
  logit scale (standard deviation); the route's token must be the replica's, or one of its likeliest
  within ``TOKEN_TOLERANCE`` logit scales of the likeliest (an honest near tie falls either way on
  other hardware; a liar can do no more than pick among such near ties).

Only a check across fingerprints asks for sketches (``Open.sketch``): they add nothing to the bytes
every verified token costs (the receipts'), and a check within one fingerprint still compares bytes.

The tolerances, measured with tools/numerics_gap.py: one range (half the model's layers) fed the same
input rows on the CPU and on lavapipe (Mesa 22.3.6, llvmpipe, the Vulkan build's engine for both),
a 12-row prompt and then decode steps, 60 rows of each tiny model (f16 and f32 llama, qwen2, qwen3)
and 36 of SmolLM2-135M Q4_1:
* rows, the largest relative error at a row's 16 largest entries: honest at most 0.0036 (tiny) and
  0.053 (SmolLM2); lies at the least: a negated row 2.0, the row of a changed input token 1.16,
  another position's row (rows one off) 0.54; noise of 10% of the row's norm 0.063 (tiny), 0.048
  (SmolLM2, whose few huge entries, 500x the median, are most of its norm);
* picks, the greedy token's gap below the replica's likeliest: on the tiny models no token differed
  (logits at most 0.0027 of their standard deviation apart); SmolLM2's tail range picked another token
  in 4 of 25 sampled rows, at most 0.044 standard deviations below the likeliest (single logits up to
  0.46 apart: lavapipe sums its Q4_1 matmuls otherwise); the next token id instead of the pick lay
  0.25 (tiny) and 0.68 (SmolLM2) standard deviations below it at the least.
So ``ROW_TOLERANCE`` is 3.8x the largest honest error and 2.7x below the smallest lie (noise is caught
from 25-42% of the row's norm, about the distance to another position's row); ``TOKEN_TOLERANCE`` is 4.5x
SmolLM2's largest honest gap and below every next-token lie measured.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
from pydantic import Field

from wire.errors import ErrorCode, ProtocolError
from wire.message import Message
from wire.types import MAX_TOKENS, Epoch, SessionId

ROW_TOLERANCE = 0.2
TOKEN_TOLERANCE = 0.2
# entries a row's sketch keeps, and likeliest tokens a pick's (the engine reports up to 20)
ROW_K = 16
PICK_K = 8
MAX_SKETCH_K = 64
# receipts a check session sends in one message at most (wire.receipt.MAX_CHAIN)
_MAX_RECEIPTS = 32


class Sketches(Message, tag="sketches"):
    """From a check session across numerics (``Open.sketch``) to its opener, just before each ``Receipts``
    message: a sketch of each of its receipts' outputs, in order (``row_sketch``; at the tail one
    ``pick_sketch`` a sampled row). The stream's message cap bounds them all."""

    session: SessionId
    epoch: Epoch
    sketches: list[Annotated[bytes, Field(max_length=MAX_TOKENS * (MAX_SKETCH_K * 8 + 8))]] = Field(
        max_length=_MAX_RECEIPTS)


def row_sketch(rows: np.ndarray, k: int = ROW_K) -> bytes:
    """Each row's ``k`` entries largest in magnitude: their indices (int32), then their values (f32)."""
    rows = np.asarray(rows, dtype=np.float32)
    k = min(k, rows.shape[1])
    idx = np.argpartition(-np.abs(rows), k - 1, axis=1)[:, :k].astype(np.int32)
    values = np.take_along_axis(rows, idx, 1)
    return b"".join(i.tobytes() + v.tobytes() for i, v in zip(idx, values, strict=True))


def rows_differ(rows: np.ndarray, sketch: bytes, tolerance: float = ROW_TOLERANCE) -> tuple[int, float] | None:
    """The first of ``rows`` (the route's) that a replica's ``sketch`` of its own disagrees with, and by how
    much (the largest relative error at its entries); None where every row agrees. A sketch that does
    not fit the rows is the replica's fault (a ProtocolError)."""
    rows = np.asarray(rows, dtype=np.float32)
    n_rows, width = rows.shape
    if n_rows <= 0 or len(sketch) % (8 * n_rows):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a sketch of another number of rows")
    k = len(sketch) // (8 * n_rows)
    if not 0 < k <= min(MAX_SKETCH_K, width):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a sketch of too many or too few entries a row")
    raw = np.frombuffer(sketch, dtype=np.uint8).reshape(n_rows, 8 * k)
    idx = raw[:, :4 * k].copy().view(np.int32)
    values = raw[:, 4 * k:].copy().view(np.float32).astype(np.float64)
    if (idx < 0).any() or (idx >= width).any() or not np.isfinite(values).all():
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a sketch of entries outside the row")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        error = (np.abs(np.take_along_axis(rows, idx, 1) - values) / np.abs(values)).max(axis=1)
    # a NaN or an infinity in the route's rows is no agreement (nor is 0/0: a sketch of zeros is no sketch)
    bad = np.flatnonzero(~(error <= tolerance))
    return None if not len(bad) else (int(bad[0]), float(error[bad[0]]))


def pick_sketch(token: int, likeliest: list[tuple[int, float]], scale: float, k: int = PICK_K) -> bytes:
    """One sampled row's: its token, ``k`` of the likeliest tokens (missing ones are id -1), their
    log-probabilities, and the row's logit scale (standard deviation)."""
    pairs = list(likeliest[:k]) + [(-1, 0.0)] * (k - min(k, len(likeliest)))
    ids = np.asarray([token] + [t for t, _ in pairs], dtype=np.int32)
    floats = np.asarray([lp for _, lp in pairs] + [scale], dtype=np.float32)
    return ids.tobytes() + floats.tobytes()


def tokens_differ(tokens: list[int], sketch: bytes, tolerance: float = TOKEN_TOLERANCE) -> tuple[int, str] | None:
    """The first of ``tokens`` (the route's, one a sampled row) that a replica's picks (``pick_sketch``s,
    one a row) do not allow, and why; None where each is the replica's own or near enough to it."""
    if not tokens:
        return None if not sketch else (0, "picks of rows that sampled nothing")
    per = len(sketch) // len(tokens)
    k = (per - 8) // 8
    if len(sketch) != per * len(tokens) or per != 8 * k + 8 or not 0 < k <= MAX_SKETCH_K:
        return 0, "picks of another number of rows"
    for row, token in enumerate(tokens):
        part = sketch[row * per:(row + 1) * per]
        ids = np.frombuffer(part[:4 * (k + 1)], dtype=np.int32)
        floats = np.frombuffer(part[4 * (k + 1):], dtype=np.float32).astype(np.float64)
        lps, scale = floats[:k], floats[k]
        if int(ids[0]) == token:
            continue
        where = np.flatnonzero(ids[1:] == token)
        if not len(where):
            return row, f"token {token} is not among its {k} likeliest (it picked {int(ids[0])})"
        with np.errstate(divide="ignore", invalid="ignore"):
            gap = (lps[ids[1:] >= 0].max() - lps[where[0]]) / scale
        # (a scale of 0, a NaN or an infinity is no leave to differ)
        if not (np.isfinite(gap) and gap <= tolerance):
            return row, f"token {token} is {gap:.3g} logit scales below its likeliest (tolerance {tolerance:g})"
    return None
