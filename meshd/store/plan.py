"""The fetch planner (sans-IO): which source fetches which chunk, and what to do when one fails.

Fed what happens (a source added with the chunks it holds, a chunk verified,
a bad chunk, a chunk the source lacks, a source lost) and the time, it answers
which requests to send next (``assign``) and when its next timeout falls due
(``next_timer``); the trio shell moves the bytes. The rules:

* each source has at most ``in_flight`` requests outstanding, and takes the
  lowest-offset pending chunk it holds (so several sources share one range);
* a source that is lost (its link died, or it sent nothing for
  ``request_timeout`` seconds while owing chunks: a slow uplink is not a dead
  one, as long as frames keep coming) has its in-flight chunks re-queued for
  the others; it may be added again later;
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
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshd.store.holding import bit_set
from meshd.store.manifest import Chunk


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
    # When the source is lost unless it makes progress: set while it has requests in flight.
    deadline: float | None = None
    lacks: set[int] = field(default_factory=set)

    def holds(self, index: int) -> bool:
        return index not in self.lacks and (self.have is None or bit_set(self.have, index))


class FetchPlan:
    def __init__(self, chunks: Sequence[Chunk], *, in_flight: int = 4, request_timeout: float = 60.0) -> None:
        if in_flight < 1 or request_timeout <= 0:
            raise ValueError("in_flight is at least 1 and request_timeout positive")
        self._chunks = {c.index: c for c in chunks}
        self._pending: set[int] = set(self._chunks)
        self._verified: set[int] = set()
        self._owner: dict[int, str] = {}  # in-flight chunk -> source
        self._sources: dict[str, _Source] = {}
        self.excluded: dict[str, str] = {}
        self.lost: dict[str, str] = {}
        self._limit = in_flight
        self._timeout = request_timeout

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
        back = [self._chunks[i] for i in entry.in_flight]
        for i in entry.in_flight:
            del self._owner[i]
            self._requeue(i)
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

    def _finish(self, source: str, chunk: Chunk) -> _Source | None:
        if self._owner.get(chunk.index) != source:
            return None
        del self._owner[chunk.index]
        entry = self._sources[source]
        del entry.in_flight[chunk.index]
        if not entry.in_flight:
            entry.deadline = None
        return entry

    def chunk_verified(self, source: str, chunk: Chunk) -> bool:
        """A chunk verified and written; True unless it was already. A lost source's late but
        verified answer counts too: the chunk is not fetched again."""
        self._finish(source, chunk)
        if chunk.index not in self._chunks or chunk.index in self._verified:
            return False
        self._pending.discard(chunk.index)
        self._verified.add(chunk.index)
        return True

    def chunk_missing(self, source: str, chunk: Chunk) -> None:
        """The source does not hold this chunk (NOT_FOUND): asked elsewhere, never of it again."""
        entry = self._finish(source, chunk)
        if entry is not None:
            entry.lacks.add(chunk.index)
            self._requeue(chunk.index)

    def chunk_bad(self, source: str, chunk: Chunk, reason: str) -> list[Chunk]:
        """The source sent bytes that do not match the manifest: excluded, its chunks re-queued."""
        return self.exclude(source, f"chunk {chunk.index} at {chunk.offset}: {reason}")

    # ----- decisions

    def assign(self, now: float) -> list[Assign]:
        """The requests to send now: each source filled up to its in-flight limit, round robin."""
        out: list[Assign] = []
        progress = True
        while progress and self._pending:
            progress = False
            for name, entry in self._sources.items():
                if len(entry.in_flight) >= self._limit:
                    continue
                index = self._next_for(entry)
                if index is None:
                    continue
                self._pending.discard(index)
                self._owner[index] = name
                if not entry.in_flight:
                    entry.deadline = now + self._timeout
                entry.in_flight[index] = None
                out.append(Assign(name, self._chunks[index]))
                progress = True
        return out

    def _next_for(self, entry: _Source) -> int | None:
        heap = entry.heap
        while heap:
            index = heapq.heappop(heap)
            if index in self._pending and entry.holds(index):
                return index
        return None

    def progressed(self, source: str, now: float) -> None:
        """The source sent something (a frame): it has ``request_timeout`` again to send the next."""
        entry = self._sources.get(source)
        if entry is not None and entry.in_flight:
            entry.deadline = now + self._timeout

    def next_timer(self) -> float | None:
        deadlines = [e.deadline for e in self._sources.values() if e.deadline is not None]
        return min(deadlines) if deadlines else None

    def handle_timer(self, now: float) -> list[str]:
        """Sources silent past their deadline while owing answers: lost (their chunks re-queued).
        The shell drops their streams."""
        late = [name for name, e in self._sources.items() if e.deadline is not None and e.deadline <= now]
        for name in late:
            self.source_lost(name, f"sent nothing for {self._timeout:g} s while owing chunks")
        return late

    # ----- state

    @property
    def done(self) -> bool:
        return len(self._verified) == len(self._chunks)

    @property
    def stuck(self) -> list[Chunk]:
        """Pending chunks no usable source holds, once nothing is in flight (the fetch cannot finish)."""
        if self._owner:
            return []
        return [self._chunks[i] for i in sorted(self._pending)
                if not any(e.holds(i) for e in self._sources.values())]

    @property
    def verified(self) -> int:
        return len(self._verified)
