"""The stage's prefix cache, sans-IO: which idle sequences hold which asker's prompt prefixes.

A session that ends cleanly leaves its sequence's KV behind as an *entry*: the
prompt's whole blocks (``wire.stage.PREFIX_BLOCK`` token ids each), named by the
chained keys its asker sent in ``CacheLookup``. A later session of the same
asker whose keys begin with an entry's gets that entry's cells copied into its
own sequence and runs only the rest. The engine is batch-invariant, so the
copied cells are the bytes the session would have computed itself, and the
answer is the one without the cache.

Entries are per asker (the node that opened the session): the keys are the
asker's word, not something this stage can check against the rows it ran, so
an asker that lies about them fills only its own entries with wrong KV, and
only its own answers read them.

Entries live in sequences no session holds. They are bounded by
``limit`` tokens in all and go least recently used first; a session that needs a
sequence takes an entry's before anyone's live session is evicted (the books
ask ``take_slot``), so the cache never costs a live session anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wire.stage import PREFIX_BLOCK


@dataclass(eq=False)
class Entry:
    owner: str
    slot: int
    keys: tuple[bytes, ...]
    last_used: float

    @property
    def tokens(self) -> int:
        return len(self.keys) * PREFIX_BLOCK


@dataclass
class CacheCounts:
    lookups: int = 0
    hits: int = 0
    # prompt tokens that lookups asked about (whole blocks), and those an entry held
    looked_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0


@dataclass
class PrefixCache:
    """Entries by asker, within ``limit`` tokens (0: the cache is off)."""

    limit: int = 0
    entries: list[Entry] = field(default_factory=list)
    counts: CacheCounts = field(default_factory=CacheCounts)
    # sequences of entries whose cells are being copied: no session takes them meanwhile
    pinned: set[int] = field(default_factory=set)

    @property
    def tokens(self) -> int:
        return sum(e.tokens for e in self.entries)

    def find(self, owner: str, keys: list[bytes] | tuple[bytes, ...], now: float) -> tuple[Entry | None, int]:
        """The entry of ``owner`` sharing the most leading keys with ``keys``, and how many it shares."""
        self.counts.lookups += 1
        self.counts.looked_tokens += len(keys) * PREFIX_BLOCK
        best, shared = None, 0
        for entry in self.entries:
            if entry.owner != owner:
                continue
            n = _common(entry.keys, keys)
            if n > shared:
                best, shared = entry, n
        if best is not None:
            best.last_used = max(best.last_used, now)
            self.counts.hits += 1
            self.counts.hit_tokens += shared * PREFIX_BLOCK
        return best, shared

    def add(self, owner: str, slot: int, keys: list[bytes] | tuple[bytes, ...], now: float) -> list[int]:
        """Keeps ``slot``'s KV as ``owner``'s entry for ``keys``; returns the sequences this frees (entries
        it covers or that the limit evicts, least recently used first; ``slot`` itself if the entry would
        add nothing or cannot fit)."""
        keys = tuple(keys)
        if not keys or len(keys) * PREFIX_BLOCK > self.limit:
            return [slot]
        mine = [e for e in self.entries if e.owner == owner]
        covering = next((e for e in mine if _common(e.keys, keys) == len(keys)), None)
        if covering is not None:
            # an entry holds this prefix already (and maybe more): it is the one kept
            covering.last_used = max(covering.last_used, now)
            return [slot]
        # entries that this one's prefix covers hold nothing it does not
        freed = [e.slot for e in mine if _common(e.keys, keys) == len(e.keys)]
        self.entries = [e for e in self.entries if e.slot not in freed]
        self.entries.append(Entry(owner, slot, keys, now))
        while self.tokens > self.limit and any(e.slot not in self.pinned for e in self.entries):
            freed.append(self._drop_oldest())
        return freed

    def take_slot(self) -> int | None:
        """A sequence for a live session: the least recently used entry's (None: there is none)."""
        return self._drop_oldest() if any(e.slot not in self.pinned for e in self.entries) else None

    def pin(self, entry: Entry) -> None:
        self.pinned.add(entry.slot)

    def unpin(self, entry: Entry) -> None:
        self.pinned.discard(entry.slot)

    def clear(self) -> list[int]:
        """Forgets every entry (the engine's KV is gone); returns their sequences."""
        slots = [e.slot for e in self.entries]
        self.entries = []
        self.pinned.clear()
        return slots

    def _drop_oldest(self) -> int:
        oldest = min((e for e in self.entries if e.slot not in self.pinned), key=lambda e: e.last_used)
        self.entries.remove(oldest)
        self.counts.evictions += 1
        return oldest.slot


def _common(a: tuple[bytes, ...], b: list[bytes] | tuple[bytes, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
