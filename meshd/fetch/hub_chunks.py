"""A volunteer's own chunks of a hub model, read from the hub with HTTP ``Range`` in runs of adjacent chunks,
each checked against the manifest before it is written and recorded."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence

import trio

from meshd.fetch.fetcher import FetchConfig, FetchFailed, FetchProgress, FetchReport
from meshd.fetch.hub import HubError, HubReader, RangeBody
from meshd.store.manifest import Chunk
from meshd.store.plan import MIN_RATE
from meshd.store.sparse import BadChunk, SparseFile

# Requests to the hub at once by one fetch: 4 connections keep a link busy while each waits on its first
# byte.
HUB_CONCURRENCY = 4
# A fetch asks for the chunks it lacks in runs: those one after another in the manifest and a file, apart from
# at most _GAP_BYTES between (GGUF aligns each tensor to 32 bytes, or general.alignment), in one request of at most
# _RUN_BYTES, read and checked a chunk at a time (``_Run``), where it asked for each 4 MiB chunk on its own.
_RUN_BYTES = 32 << 20
_GAP_BYTES = 64 << 10

def _runs(chunks: Sequence[Chunk]) -> list[list[Chunk]]:
    """``chunks`` in runs a request each: those that follow one another in the manifest and in a file (but for at
    most _GAP_BYTES between, the alignment between tensors: never a chunk held already), spanning at most
    _RUN_BYTES (one chunk at least)."""
    runs: list[list[Chunk]] = []
    for chunk in chunks:
        if runs:
            run, last = runs[-1], runs[-1][-1]
            gap = chunk.part_offset - (last.part_offset + last.size)
            if chunk.index == last.index + 1 and chunk.part == last.part and 0 <= gap <= _GAP_BYTES and \
                    chunk.part_offset + chunk.size - run[0].part_offset <= _RUN_BYTES:
                run.append(chunk)
                continue
        runs.append([chunk])
    return runs


class _Stop:
    """Keeps the threads of a fetch that has returned from writing: one it gave up on (past its chunk's
    deadline, or cancelled) may still be reading, and the sparse file's descriptors may since be closed and
    another file's. A thread writes holding the lock, and only while the fetch goes on."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stopped = False

    def stop(self) -> None:
        with self.lock:
            self.stopped = True


class _Run:
    """One run of chunks: one request, read a chunk at a time (``store_next``, in whichever worker thread trio
    gives). Each piece is hashed and written at its offset as it comes, while it is in the cache (a chunk
    gathered in a buffer first, then hashed and written, read it from memory twice more: the client took 2.1-2.6
    ns of CPU a byte that way, 2.0-2.3 this one); a chunk is recorded only once its hash matches, as a member's
    pieces are (``SparseFile.write_piece``), and what was written of one that does not is freed."""

    def __init__(self, reader: HubReader, target: SparseFile, chunks: list[Chunk], stop: _Stop) -> None:
        self.reader, self.target, self.chunks, self.stop = reader, target, chunks, stop
        self._body: RangeBody | None = None
        # a thread given up on may still be reading when the worker is done with the run: it closes the body
        self._lock = threading.Lock()
        self._busy = self._closed = False

    def store_next(self, chunk: Chunk) -> None:
        """Read ``chunk`` (the run's next) and write it: BadChunk if its bytes do not match the manifest (what
        was written of them freed), HubError if the server sends anything but the run's range."""
        with self._lock:
            if self._closed:
                raise HubError("the fetch has stopped")
            self._busy = True
        try:
            if self._body is None:
                first, last = self.chunks[0], self.chunks[-1]
                self._body = self.reader.open(first.part, first.part_offset, last.part_offset + last.size)
            self._body.skip(chunk.part_offset - self._body.pos)
            digest, at = hashlib.sha256(), 0
            for piece in self._body.take(chunk.size):
                # hashlib and pwrite let the GIL go: the workers' pieces are hashed and written at once
                digest.update(piece)
                self._write(chunk, at, piece)
                at += len(piece)
            if chunk is self.chunks[-1]:
                self._body.finish()
            if digest.digest() != chunk.sha256:
                with self.stop.lock:
                    if not self.stop.stopped:
                        self.target.discard(chunk)
                raise BadChunk(f"bytes at {chunk.offset} do not match chunk {chunk.index} of the manifest")
        finally:
            with self._lock:
                self._busy, closed = False, self._closed
            if closed:
                self._close_body()

    def _write(self, chunk: Chunk, at: int, piece: memoryview) -> None:
        with self.stop.lock:
            if self.stop.stopped:
                raise HubError("the fetch has stopped")
            self.target.write_piece(chunk, at, piece)

    def close(self) -> None:
        with self._lock:
            self._closed, busy = True, self._busy
        if not busy:
            self._close_body()

    def _close_body(self) -> None:
        if self._body is not None:
            self._body.close()


async def fetch_from_hub(reader: HubReader, target: SparseFile, chunks: Sequence[Chunk], *,
                         progress: Callable[[FetchProgress], None] | None = None,
                         concurrency: int = HUB_CONCURRENCY, first_byte: float = 30.0,
                         min_rate: float = MIN_RATE, flush_interval: float = FetchConfig.flush_interval
                         ) -> FetchReport:
    """Fetch the chunks ``target`` lacks from the hub, each verified against the manifest before it is
    written and recorded (served, journalled): runs of adjacent chunks a request each, a few requests at once.
    FetchFailed, naming the first chunk, when the hub's bytes do not match the manifest (a lying mirror, or a
    lying manifest), it cannot be read, or it does not deliver a chunk within ``first_byte`` seconds plus its
    size at ``min_rate`` of the last (a server dribbling bytes keeps a read's own timeout from ever firing: the
    deadline is the chunk's, as for members). What is verified is journalled every ``flush_interval`` seconds,
    as a fetch from members is."""
    key = f"hub {reader.model.endpoint}"
    missing = target.missing(chunks)
    total = sum(c.size for c in chunks)
    report = FetchReport(chunks=len(chunks), reused_bytes=total - sum(c.size for c in missing))
    queue = iter(_runs(missing))
    stop = _Stop()
    # chunks being written and not yet recorded: what a fetch that fails leaves of them is freed
    unrecorded: set[Chunk] = set()
    failures: list[str] = []
    started = trio.current_time()

    async def worker() -> None:
        for chunks in queue:
            run = _Run(reader, target, chunks, stop)
            try:
                for chunk in chunks:
                    if failures:
                        return
                    deadline = first_byte + chunk.size / min_rate
                    unrecorded.add(chunk)
                    with trio.fail_after(deadline):
                        # abandoned on the deadline: its thread ends at the read's own timeout, writing nothing
                        # once the fetch has returned
                        await trio.to_thread.run_sync(run.store_next, chunk, abandon_on_cancel=True)
                    target.record(chunk)
                    unrecorded.discard(chunk)
                    report.fetched_chunks += 1
                    report.fetched_bytes += chunk.size
                    report.by_source[key] = report.by_source.get(key, 0) + chunk.size
                    if progress is not None:
                        elapsed = max(trio.current_time() - started, 1e-9)
                        done = report.reused_bytes + report.fetched_bytes
                        rate = report.fetched_bytes / elapsed
                        progress(FetchProgress(total, done, report.fetched_bytes, rate,
                                               (total - done) / rate if rate > 0 else None, 1))
            except BadChunk:
                failures.append(f"the bytes {reader.model.endpoint} serves at {chunk.part_offset} of "
                                f"{reader.model.files[chunk.part].path} do not match the manifest (chunk "
                                f"{chunk.index}): a lying mirror, or a manifest not of {reader.model.where}")
                return
            except HubError as exc:
                failures.append(str(exc))
                return
            except trio.TooSlowError:
                failures.append(f"{reader.model.endpoint} did not deliver {chunk.size} bytes of "
                                f"{reader.model.files[chunk.part].path} within {deadline:.0f} s")
                return
            finally:
                run.close()

    def finish() -> None:
        stop.stop()
        for chunk in unrecorded:
            target.discard(chunk)
        target.flush()

    async def flusher() -> None:
        # the data synced as it comes, not all at the end: with tools/bench_hub.py's three ranges fetched at
        # once here, the last flush of each waited 0.27-0.63 s on the disk (~12% of a 767 MB range's fetch),
        # 0.11-0.30 s this way; and a fetch killed mid-way keeps what it verified, as a fetch from members does
        while True:
            await trio.sleep(flush_interval)
            await trio.to_thread.run_sync(target.flush)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flusher)
            async with trio.open_nursery() as workers:
                for _ in range(max(1, concurrency)):
                    workers.start_soon(worker)
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(finish)
    if failures:
        report.excluded[key] = failures[0]
        raise FetchFailed(failures[0], report)
    return report


