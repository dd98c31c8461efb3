"""Drafts for speculative decoding, sans-IO: prompt lookup over a session's own tokens, and k.

The tail drafts the tokens that followed the latest earlier occurrence of the
session's last n tokens (n from ``MAX_NGRAM`` down to 1): text that repeats
its prompt (rewriting, summarising, editing code) drafts well, and no second
model is needed. How many it drafts adapts to how many the sampler accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_NGRAM = 3


@dataclass
class NgramDrafter:
    """An index of every n-gram of the tokens so far to the position after its latest occurrence."""

    tokens: list[int] = field(default_factory=list)
    _after: dict[tuple[int, ...], int] = field(default_factory=dict)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            i = len(self.tokens)
            # the n-grams ending just before this token are now followed by it
            for n in range(1, min(MAX_NGRAM, i) + 1):
                self._after[tuple(self.tokens[i - n:i])] = i
            self.tokens.append(token)

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest suffix seen before; none if no suffix was."""
        if k < 1:
            return []
        for n in range(min(MAX_NGRAM, len(self.tokens)), 0, -1):
            at = self._after.get(tuple(self.tokens[-n:]))
            if at is not None:
                return self.tokens[at:at + k]
        return []


@dataclass
class DraftLength:
    """k for the next step: doubles while every draft is accepted, falls to one past the accepted ones."""

    max_k: int
    k: int = 4
    drafted: int = 0
    accepted: int = 0

    def __post_init__(self) -> None:
        self.k = max(1, min(self.k, self.max_k))

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        if accepted == drafted:
            self.k = min(self.max_k, self.k * 2)
        else:
            self.k = max(1, accepted + 1)
