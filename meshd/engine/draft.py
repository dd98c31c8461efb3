"""Drafts for speculative decoding, sans-IO: prompt lookup over a session's own tokens, and k.

The tail drafts the tokens that followed the latest earlier occurrence of the
session's last n tokens (n from ``MAX_NGRAM`` down to ``MIN_NGRAM``): text that repeats
its prompt (rewriting, summarising, editing code) drafts well, and no second
model is needed. How many it drafts adapts to how many the sampler accepted,
and after drafts that all fail it stops drafting for a while: each drafted row
costs every stage compute, which free-form text rarely pays back.

With a draft model (a small GGUF of the same vocabulary, run by the tail in an
engine worker of its own) the drafts are that model's greedy continuation;
``DraftModelKV`` keeps its KV in step with the session's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_NGRAM = 3
# a single token (" the") recurs too often to predict what follows it
MIN_NGRAM = 2
# the most steps drafting pauses after drafts that all failed
MAX_PAUSE = 32


@dataclass
class NgramDrafter:
    """An index of every n-gram of the tokens so far to the position after its latest occurrence."""

    tokens: list[int] = field(default_factory=list)
    _after: dict[tuple[int, ...], int] = field(default_factory=dict)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            i = len(self.tokens)
            # the n-grams ending just before this token are now followed by it
            for n in range(MIN_NGRAM, min(MAX_NGRAM, i) + 1):
                self._after[tuple(self.tokens[i - n:i])] = i
            self.tokens.append(token)

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest suffix seen before; none if no suffix was."""
        if k < 1:
            return []
        for n in range(min(MAX_NGRAM, len(self.tokens)), MIN_NGRAM - 1, -1):
            at = self._after.get(tuple(self.tokens[-n:]))
            if at is not None:
                return self.tokens[at:at + k]
        return []


@dataclass
class DraftLength:
    """k for the next step: doubles while every draft is accepted, falls to one past the accepted ones;
    0 for a pause (which doubles each time) after a step whose drafts all failed."""

    max_k: int
    k: int = 4
    drafted: int = 0
    accepted: int = 0
    pause: int = 0
    _paused: int = 0

    def __post_init__(self) -> None:
        self.k = max(1, min(self.k, self.max_k))

    def next_k(self) -> int:
        """How many to draft this step (0 while paused)."""
        if self._paused:
            self._paused -= 1
            return 0
        return self.k

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        if accepted == drafted:
            self.k = min(self.max_k, self.k * 2)
        else:
            self.k = max(1, accepted + 1)
        if accepted:
            self.pause = 0
        else:
            self.pause = min(MAX_PAUSE, max(1, self.pause * 2))
            self._paused = self.pause


@dataclass
class DraftModelKV:
    """What a draft model's KV holds of one session, and what it must be fed before it drafts.

    The draft model reads the session's tokens as the stages do; after a step, its KV
    holds the drafts it ran, of which the ring may have rejected some. The next step
    keeps the longest prefix it holds of the session's tokens, drops the rest and
    feeds the tokens from there (at least the last one: its logits give the first draft).
    """

    held: list[int] = field(default_factory=list)

    def plan(self, tokens: list[int]) -> tuple[int, list[int]]:
        """(the position to drop the KV from, the tokens to feed from that position)."""
        keep = 0
        most = min(len(self.held), len(tokens) - 1)
        while keep < most and self.held[keep] == tokens[keep]:
            keep += 1
        return keep, tokens[keep:]

    def ran(self, tokens: list[int], drafts: list[int]) -> None:
        """The model was fed ``tokens`` and drafted ``drafts`` (the last draft was never fed)."""
        self.held = tokens + drafts[:-1]
