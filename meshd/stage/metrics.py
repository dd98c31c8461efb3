"""A stage's counts for the console and ``meshd status``: its own engine calls and the fast path's."""

from __future__ import annotations

import collections
import math
from typing import Any

from meshd.engine.supervisor import EngineSupervisor
from meshd.stage.books import StageBooks


class StageMetrics:
    def __init__(self) -> None:
        self.engine_calls = 0
        self.rows = 0
        # rows past their session's prompt: one per generated token, the console's live tok/s
        self.decode_rows = 0
        self.session_slots = 0
        self.multi_session_calls = 0
        self.max_sessions_per_call = 0
        self.step_ms: collections.deque[float] = collections.deque(maxlen=512)
        # the engine worker's own counts of the fast sessions' batches (meshd.engine.fastpath), as
        # it last told them, and those of the workers before it (the counts only grow: the console's
        # live figures are their differences)
        self.fast: dict[str, int] = {}
        self.fast_before: collections.Counter[str] = collections.Counter()

    def fast_count(self, key: str) -> int:
        """The workers' counts of ``key`` as one: a maximum stays a maximum, a count adds up."""
        before, now = self.fast_before[key], self.fast.get(key, 0)
        return max(before, now) if key == "max_sessions_per_call" else before + now

    def worker_gone(self) -> None:
        """The worker and its counts are gone: what it last told is kept."""
        for key in self.fast:
            self.fast_before[key] = self.fast_count(key)
        self.fast = {}

    def record_call(self, sessions: int, rows: int, seconds: float, decode_rows: int) -> None:
        self.engine_calls += 1
        self.rows += rows
        self.decode_rows += decode_rows
        self.session_slots += sessions
        self.multi_session_calls += sessions > 1
        self.max_sessions_per_call = max(self.max_sessions_per_call, sessions)
        self.step_ms.append(seconds * 1000.0)

    def values(self, books: StageBooks[Any], engine: EngineSupervisor) -> dict[str, float]:
        """The figures a ``Metrics`` reply carries: these counts with the books' and the worker's."""
        counts = books.counts
        steps = sorted(self.step_ms)
        # the slow path's engine calls (the daemon's) and the fast path's (the worker's), together
        fast = self.fast_count
        calls = self.engine_calls + fast("engine_calls")
        slots = self.session_slots + fast("session_slots")
        return {
            "sessions": float(len(books.sessions)),
            "kv_tokens": float(books.total_tokens),
            "engine_calls": float(calls),
            "rows": float(self.rows + fast("rows")),
            "decode_rows": float(self.decode_rows + fast("decode_rows")),
            "sessions_per_call": slots / calls if calls else 0.0,
            "max_sessions_per_call": float(max(self.max_sessions_per_call, fast("max_sessions_per_call"))),
            "multi_session_calls": float(self.multi_session_calls + fast("multi_session_calls")),
            "step_ms_p50": steps[len(steps) // 2] if steps else 0.0,
            "step_ms_p99": steps[min(len(steps) - 1, math.ceil(len(steps) * 0.99) - 1)] if steps else 0.0,
            "evictions": float(counts.evictions),
            "expirations": float(counts.expirations),
            "overloaded": float(counts.overloaded),
            "released": float(counts.released),
            "draft_rewinds": float(counts.rewinds + fast("draft_rewinds")),
            # the worker's software on fast-path decode hops (totals: FastPlane.stats)
            "fast_decode_calls": float(fast("decode_calls")),
            "fast_hop_in_us": float(fast("hop_in_us")),
            "fast_hop_out_us": float(fast("hop_out_us")),
            # the prefix cache: tokens its entries hold, lookups and hits, prompt tokens asked for and found
            "cache_tokens": float(books.cache.tokens),
            "cache_lookups": float(books.cache.counts.lookups),
            "cache_hits": float(books.cache.counts.hits),
            "cache_looked_tokens": float(books.cache.counts.looked_tokens),
            "cache_hit_tokens": float(books.cache.counts.hit_tokens),
            "cache_evictions": float(books.cache.counts.evictions),
            "worker_restarts": float(engine.restarts),
            "worker_up": float(engine.is_up),
        }
