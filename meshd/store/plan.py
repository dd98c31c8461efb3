"""The fetch planner (sans-IO): which source fetches which chunk, and what to do when one fails.

Fed what happens (a source added with the chunks it holds, a frame's bytes, a
chunk verified, a bad chunk, a chunk the source lacks, a source lost) and the
time, it answers which requests to send next (``assign``) and when its next
timeout falls due (``next_timer``); the trio shell moves the bytes. The rules:

* sources are scored by delivered rate (bytes over the time they owed chunks):
  the fastest are filled first, each up to ``in_flight`` requests, and one
  ``SLOW_RATIO`` times slower than the best has one at a time, so a slow source
  holds at most one chunk back; each takes the lowest-offset pending chunk it
  holds (so several sources share one range);
* every request has a deadline: the chunk a source answers now (its head) must
  be whole within ``request_timeout`` plus its size at ``min_rate`` from when it
  became the head, and a frame must come within ``request_timeout`` of the last
  one. Progress is delivered bytes, not frames: a source sending a byte every
  20 s misses the first deadline, not the second. A source past either is lost:
  its in-flight chunks are re-queued for the others; it may be added again later;
* the end game: once a source has no pending chunk left to take, it is asked for
  chunks in flight at another (the slowest's first, each at most ``COPIES`` at
  once); the first verified answer counts, the other is dropped;
* a source that sent a bad chunk is excluded for good: its in-flight chunks are
  re-queued and it is never asked again;
* a source that says it lacks a chunk is not asked for that chunk again.

``done`` when every chunk is verified; ``stuck`` lists chunks that no usable
source holds while nothing is in flight, which ends a fetch.
Per source, candidate chunks sit in a heap with lazy deletion, so assigning
costs O(log n) a chunk however sparse a partial source is.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshd.store.holding import bit_set
from meshd.store.manifest import Chunk

# A source this many times slower than the best (delivered rate) has one request at a time: it
# still helps, and holds back one chunk at most, not a pipeline's worth.
SLOW_RATIO = 8.0
# A source's rate is known once it owed chunks this long (seconds) or delivered a byte: before,
# it is scored as the best, so every source gets a fair first try.
RATE_AFTER = 0.5
# Sources fetching one chunk at once in the end game: the owner and one more. A third copy would
# spend a third of the bandwidth to win a race two copies already win against one slow source.
COPIES = 2
# The delivered rate a source must keep (bytes a second) on the chunk it answers: a 4 MiB chunk
# may take 64 s past the first-byte grace. Far below any link a model is fetched over, and it
# ends the stall of a source dribbling a byte every 20 s, which any-frame-is-progress never did.
MIN_RATE = float(64 << 10)


def _score(rate: float | None) -> float:
    """A rate to rank by: an unknown one as the best."""
    return math.inf if rate is None else rate


@dataclass(frozen=True, slots=True)
class Assign:
    """Send a request for ``chunk`` to ``source``."""

    source: str
    chunk: Chunk


@dataclass
class _Source:
    have: bytes | None  # None: every chunk
    heap: list[int]
    in_flight: dict[int, None] = field(default_factory=dict)  # chunk indices, in request order
    lacks: set[int] = field(default_factory=set)
    # While it owes chunks: since when its head (the first in flight) is due, and its last frame.
    head_since: float = 0.0
    last_frame: float = 0.0
    # Its score: bytes delivered over the seconds it owed chunks (owed_time, and owing_since while it owes).
    delivered: int = 0
    owed_time: float = 0.0
    owing_since: float | None = None

    def holds(self, index: int) -> bool:
        return index not in self.lacks and (self.have is None or bit_set(self.have, index))

    def rate(self, now: float) -> float | None:
        """Bytes a second delivered while owing; None while too little is known."""
        owed = self.owed_time + (now - self.owing_since if self.owing_since is not None else 0.0)
        if not self.delivered and owed < RATE_AFTER:
            return None
        return self.delivered / max(owed, 1e-6)


class FetchPlan:
    def __init__(self, chunks: Sequence[Chunk], *, in_flight: int = 4, request_timeout: float = 60.0,
                 min_rate: float = MIN_RATE) -> None:
        if in_flight < 1 or request_timeout <= 0 or min_rate <= 0:
            raise ValueError("in_flight is at least 1, request_timeout and min_rate positive")
        self._chunks = {c.index: c for c in chunks}
        self._pending: set[int] = set(self._chunks)
        self._verified: set[int] = set()
        # in-flight chunk -> the sources asked for it (more than one only in the end game)
        self._owners: dict[int, list[str]] = {}
        self._sources: dict[str, _Source] = {}
        self.excluded: dict[str, str] = {}
        self.lost: dict[str, str] = {}
        self._limit = in_flight
        self._timeout = request_timeout
        self._min_rate = min_rate

    # ----- sources

    def add_source(self, source: str, have: bytes | None = None) -> None:
        """A source that holds the chunks set in ``have`` (None: all); an excluded one stays out."""
        if source in self.excluded or source in self._sources:
            return
        self.lost.pop(source, None)
        entry = _Source(have, [])
        entry.heap = [i for i in self._pending if entry.holds(i)]
        heapq.heapify(entry.heap)
        self._sources[source] = entry

    def source_lost(self, source: str, reason: str) -> list[Chunk]:
        """The source is gone (link lost, timed out): its in-flight chunks go back to the queue."""
        if source not in self.excluded:
            self.lost[source] = reason
        return self._drop(source)

    def exclude(self, source: str, reason: str) -> list[Chunk]:
        """The source lied (a bad chunk, a malformed answer): never asked again."""
        self.excluded[source] = reason
        self.lost.pop(source, None)
        return self._drop(source)

    def _drop(self, source: str) -> list[Chunk]:
        entry = self._sources.pop(source, None)
        if entry is None:
            return []
        back = []
        for i in entry.in_flight:
            owners = self._owners[i]
            owners.remove(source)
            if not owners:
                del self._owners[i]
                self._requeue(i)
                back.append(self._chunks[i])
        return back

    def _requeue(self, index: int) -> None:
        self._pending.add(index)
        for entry in self._sources.values():
            if entry.holds(index):
                heapq.heappush(entry.heap, index)

    @property
    def sources(self) -> list[str]:
        """Sources usable now."""
        return list(self._sources)

    def in_flight(self, source: str) -> list[Chunk]:
        entry = self._sources.get(source)
        return [] if entry is None else [self._chunks[i] for i in entry.in_flight]

    # ----- outcomes

    def _release(self, source: str, index: int, now: float) -> _Source | None:
        """``source`` no longer owes chunk ``index``; its entry if it did."""
        owners = self._owners.get(index)
        if owners is None or source not in owners:
            return None
        owners.remove(source)
        if not owners:
            del self._owners[index]
        entry = self._sources[source]
        head = next(iter(entry.in_flight)) == index
        del entry.in_flight[index]
        if not entry.in_flight:
            if entry.owing_since is not None:
                entry.owed_time += now - entry.owing_since
            entry.owing_since = None
        elif head:
            # the next chunk is answered from now on: its deadline runs from here
            entry.head_since = now
        return entry

    def chunk_verified(self, source: str, chunk: Chunk, now: float) -> bool:
        """A chunk verified and written; True unless it was already. A lost source's late but
        verified answer counts too: the chunk is not fetched again. Another source asked for it
        in the end game owes it no more (its answer, when it comes, is dropped)."""
        self._release(source, chunk.index, now)
        if chunk.index not in self._chunks or chunk.index in self._verified:
            return False
        self._pending.discard(chunk.index)
        self._verified.add(chunk.index)
        for other in list(self._owners.get(chunk.index, ())):
            self._release(other, chunk.index, now)
        return True

    def chunk_missing(self, source: str, chunk: Chunk, now: float) -> None:
        """The source does not hold this chunk (NOT_FOUND): asked elsewhere, never of it again."""
        entry = self._release(source, chunk.index, now)
        if entry is not None:
            entry.lacks.add(chunk.index)
            if chunk.index not in self._owners and chunk.index not in self._verified:
                self._requeue(chunk.index)

    def chunk_bad(self, source: str, chunk: Chunk, reason: str) -> list[Chunk]:
        """The source sent bytes that do not match the manifest: excluded, its chunks re-queued."""
        return self.exclude(source, f"chunk {chunk.index} at {chunk.offset}: {reason}")

    # ----- decisions

    def assign(self, now: float) -> list[Assign]:
        """The requests to send now: the fastest sources first, round robin, each filled up to its
        limit (one for a slow source); then the end game's second copies."""
        rates = {name: e.rate(now) for name, e in self._sources.items()}
        known = [r for r in rates.values() if r is not None]
        best = max(known, default=0.0)

        def limit(name: str) -> int:
            r = rates[name]
            return 1 if r is not None and r * SLOW_RATIO < best else self._limit

        # unknown rates first (a fair first try), then the fastest
        order = sorted(self._sources, key=lambda name: -_score(rates[name]))
        out: list[Assign] = []
        progress = True
        while progress and self._pending:
            progress = False
            for name in order:
                entry = self._sources[name]
                if len(entry.in_flight) >= limit(name):
                    continue
                index = self._next_for(entry)
                if index is None:
                    continue
                self._pending.discard(index)
                out.append(self._ask(name, entry, index, now))
                progress = True
        for name in order:
            entry = self._sources[name]
            while len(entry.in_flight) < limit(name):
                index = self._second_copy(name, entry, rates)
                if index is None:
                    break
                out.append(self._ask(name, entry, index, now))
        return out

    def _ask(self, name: str, entry: _Source, index: int, now: float) -> Assign:
        self._owners.setdefault(index, []).append(name)
        if not entry.in_flight:
            entry.head_since = entry.last_frame = now
            entry.owing_since = now
        entry.in_flight[index] = None
        return Assign(name, self._chunks[index])

    def _second_copy(self, name: str, entry: _Source, rates: dict[str, float | None]) -> int | None:
        """The end game: a chunk in flight elsewhere for a source with nothing pending to take, the
        slowest owner's first (unknown rates count as fast), then the lowest offset."""
        heap = entry.heap
        # lazy deletion, as in _next_for: what is left on top is a pending chunk it could take
        while heap and (heap[0] not in self._pending or not entry.holds(heap[0])):
            heapq.heappop(heap)
        if heap:
            return None
        candidates = [(min(_score(rates[o]) for o in owners), index) for index, owners in self._owners.items()
                      if len(owners) < COPIES and name not in owners and entry.holds(index)]
        return min(candidates)[1] if candidates else None

    def _next_for(self, entry: _Source) -> int | None:
        heap = entry.heap
        while heap:
            index = heapq.heappop(heap)
            if index in self._pending and entry.holds(index):
                return index
        return None

    def progressed(self, source: str, now: float, size: int = 0) -> None:
        """The source sent a frame of ``size`` bytes: its score grows, and the next frame has
        ``request_timeout`` again (the head's own deadline does not move)."""
        entry = self._sources.get(source)
        if entry is not None:
            entry.delivered += size
            if entry.in_flight:
                entry.last_frame = now

    def _deadline(self, entry: _Source) -> tuple[float, str] | None:
        """When the source is lost unless it delivers, and what it will then have failed to do."""
        if not entry.in_flight:
            return None
        head = self._chunks[next(iter(entry.in_flight))]
        whole = entry.head_since + self._timeout + head.size / self._min_rate
        silent = entry.last_frame + self._timeout
        if silent <= whole:
            return silent, f"sent nothing for {self._timeout:g} s while owing chunks"
        return whole, (f"did not deliver chunk {head.index} ({head.size} bytes) within {whole - entry.head_since:.3g} s "
                       f"(at least {self._min_rate / 1024:g} KiB/s after {self._timeout:g} s)")

    def next_timer(self) -> float | None:
        deadlines = [d[0] for d in map(self._deadline, self._sources.values()) if d is not None]
        return min(deadlines) if deadlines else None

    def handle_timer(self, now: float) -> list[str]:
        """Sources past their deadline while owing answers: lost (their chunks re-queued).
        The shell drops their streams."""
        late = {}
        for name, entry in self._sources.items():
            due = self._deadline(entry)
            if due is not None and due[0] <= now:
                late[name] = due[1]
        for name, why in late.items():
            self.source_lost(name, why)
        return list(late)

    # ----- state

    @property
    def done(self) -> bool:
        return len(self._verified) == len(self._chunks)

    @property
    def stuck(self) -> list[Chunk]:
        """Pending chunks no usable source holds, once nothing is in flight (the fetch cannot finish)."""
        if self._owners:
            return []
        return [self._chunks[i] for i in sorted(self._pending)
                if not any(e.holds(i) for e in self._sources.values())]

    @property
    def verified(self) -> int:
        return len(self._verified)
