"""The fetcher: a model's manifest and a set of its chunks, from several sources at once, verified.

::

    sources = [SourceRef("10.0.0.2:7000", node_id), SourceRef(None, other_node_id)]
    manifest = await fetch_manifest(peers, sources, model_id)
    report = await fetch_range(peers, sources, manifest, Path("model.gguf"), (0, 15))

The planner (``meshd.store.plan``) decides which source gets which chunk,
scores sources by delivered rate, keeps every request's deadline and plays the
end game; this shell moves the bytes: one stream per source with up to
``in_flight_per_source`` requests pipelined on it, each chunk's frames
checked as they come (offset exactly where the last frame ended, never past
the chunk), hashed and written at their offsets; the chunk counts (is
recorded, served, journalled) only once its hash matches the manifest's, and
a chunk that does not is punched out again. In the end game a chunk is asked
of two sources: the first to deliver a frame of it writes it in place, the
other's answer is held in memory (one chunk, bounded by the manifest) and
written only if it is verified first; an answer verified second is dropped. A
source that sends a bad chunk, an oversize or out-of-place frame or a
malformed message is excluded for the rest of the fetch; one that dies or
misses a deadline has its in-flight chunks re-queued elsewhere. Verified
chunks are journalled, so a fetch resumed after a crash (or started again
with other sources) fetches only what is missing.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from meshd.net.peers import Peers
from meshd.net.rpc import request, within
from meshd.net.stream import Stream, StreamBroken
from meshd.store.gguf_header import GGUFError, read_layout
from meshd.store.manifest import Chunk, Manifest, ManifestError
from meshd.store.plan import MIN_RATE, FetchPlan
from meshd.store.ranges import range_chunks
from meshd.store.sparse import BadChunk, SparseFile
from wire.errors import ErrorCode, ProtocolError
from wire.fetch import FETCH_PROTOCOL, FRAME_BYTES, ChunkData, ChunkRequest, Have, HaveRequest, ManifestPiece, ManifestRequest
from wire.message import ErrorMessage, error_from_message

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceRef:
    """A member to fetch from: by address, by node id (a link already up, or one the peers can dial), or both."""

    address: str | None
    node_id: str | None = None

    @property
    def key(self) -> str:
        return self.node_id or self.address or "?"


@dataclass(frozen=True)
class FetchConfig:
    in_flight_per_source: int = 4
    # A source owing chunks that sends nothing for this long is lost (its chunks re-queued elsewhere),
    # and so is one that does not deliver the chunk it answers within this long plus its size at
    # min_rate (bytes a second): a frame now and then is not progress, delivered bytes are.
    request_timeout: float = 30.0
    min_rate: float = MIN_RATE
    # Seconds a dial and the have/manifest exchanges may take.
    connect_timeout: float = 10.0
    # Journal the verified chunks at least this often (seconds) and at the end.
    flush_interval: float = 1.0


@dataclass
class FetchProgress:
    total_bytes: int  # of the chunks asked for
    done_bytes: int  # verified, whether fetched now or before
    fetched_bytes: int  # over the network in this fetch
    rate: float  # bytes a second, this fetch so far
    eta: float | None  # seconds, None until a rate is known
    sources: int  # usable now
    excluded: list[str] = field(default_factory=list)


@dataclass
class FetchReport:
    chunks: int  # asked for
    fetched_chunks: int = 0
    fetched_bytes: int = 0
    reused_bytes: int = 0  # already verified before this fetch
    by_source: dict[str, int] = field(default_factory=dict)  # bytes verified from each source
    excluded: dict[str, str] = field(default_factory=dict)  # source -> why
    lost: dict[str, str] = field(default_factory=dict)  # source -> why (died or timed out; not blamed)

    def add(self, other: FetchReport) -> None:
        self.chunks += other.chunks
        self.fetched_chunks += other.fetched_chunks
        self.fetched_bytes += other.fetched_bytes
        self.reused_bytes += other.reused_bytes
        for k, v in other.by_source.items():
            self.by_source[k] = self.by_source.get(k, 0) + v
        self.excluded.update(other.excluded)
        self.lost.update(other.lost)


class FetchFailed(Exception):
    """Some chunks could not be fetched from any source (the report says what was)."""

    def __init__(self, message: str, report: FetchReport) -> None:
        super().__init__(message)
        self.report = report


Progress = Callable[[FetchProgress], None]


class _Liar(Exception):
    """The source broke the protocol or the manifest: it is excluded."""


class _Lost(Exception):
    """The source cannot go on (gone, overloaded, timed out): its chunks go elsewhere, no blame."""


# ----- the manifest


async def fetch_manifest(peers: Peers, sources: Sequence[SourceRef], model_id: str, *, timeout: float = 30.0) -> Manifest:
    """The manifest of ``model_id`` from the first source that has it and whose bytes hash to the id.

    ProtocolError (NOT_FOUND) when none does."""
    failures = []
    for ref in sources:
        try:
            with within(timeout, f"the manifest from {ref.key[:16]}"):
                stream = await peers.open_stream(ref.address, FETCH_PROTOCOL, node_id=ref.node_id)
                async with stream:
                    data = await _read_manifest(stream, model_id)
            return Manifest.decode(data, expected_id=model_id)
        except (ProtocolError, ManifestError) as exc:
            failures.append(f"{ref.key[:16]}: {exc}")
    raise ProtocolError(ErrorCode.NOT_FOUND, f"no source gave the manifest of {model_id[:16]}"
                        + (f" ({'; '.join(failures[:3])})" if failures else " (no sources)"))


async def _read_manifest(stream: Stream, model_id: str) -> bytes:
    data = bytearray()
    total: int | None = None
    # Each piece is a whole frame but the last, so this ends within total / FRAME_BYTES round trips.
    while total is None or len(data) < total:
        piece = await request(stream, ManifestRequest(model=model_id, offset=len(data)), ManifestPiece, "manifest")
        if total is None:
            total = piece.total
        if (piece.model != model_id or piece.total != total or piece.offset != len(data)
                or len(piece.data) != min(FRAME_BYTES, total - len(data))):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the source's manifest pieces do not fit together")
        data += piece.data
    return bytes(data)


# ----- chunks


class _Worker:
    """One source's stream: requests sent in order, answers read in the same order, by one task."""

    def __init__(self, key: str, stream: Stream) -> None:
        self.key = key
        self.stream = stream
        self.scope = trio.CancelScope()
        self.assigned: deque[Chunk] = deque()
        self.outstanding: deque[Chunk] = deque()
        self.wake = trio.Event()

    def give(self, chunk: Chunk) -> None:
        self.assigned.append(chunk)
        self.wake.set()

    async def next_chunk(self, model: str) -> Chunk:
        """Send every request assigned so far (pipelined), then the oldest one still to read."""
        while True:
            while self.assigned:
                chunk = self.assigned.popleft()
                self.outstanding.append(chunk)
                await self.stream.send_message(ChunkRequest(model=model, offset=chunk.offset, size=chunk.size))
            if self.outstanding:
                return self.outstanding.popleft()
            self.wake = trio.Event()
            await self.wake.wait()


class _Fetch:
    def __init__(self, peers: Peers, target: SparseFile, chunks: Sequence[Chunk], config: FetchConfig,
                 progress: Progress | None) -> None:
        self.peers = peers
        self.target = target
        self.model = target.manifest.model_id
        self.config = config
        self.progress = progress
        missing = target.missing(chunks)
        self.total = sum(c.size for c in chunks)
        self.report = FetchReport(chunks=len(chunks), reused_bytes=self.total - sum(c.size for c in missing))
        self.plan = FetchPlan(missing, in_flight=config.in_flight_per_source, request_timeout=config.request_timeout,
                              min_rate=config.min_rate)
        self.workers: dict[str, _Worker] = {}
        self.connecting = 0
        self._changed = trio.Event()
        self.started = trio.current_time()
        # Chunks some of whose bytes were written here (verified or not).
        self._touched: set[int] = set()
        # Chunk -> the source writing its frames in place now (the end game's other copy is buffered).
        self._writing: dict[int, str] = {}

    def changed(self) -> None:
        self._changed.set()

    async def run(self, sources: Sequence[SourceRef]) -> FetchReport:
        try:
            if not self.plan.done:
                async with trio.open_nursery() as nursery:
                    self.connecting = len(sources)
                    for ref in sources:
                        nursery.start_soon(self._source, ref)
                    nursery.start_soon(self._flusher)
                    await self._coordinate()
                    nursery.cancel_scope.cancel()
        finally:
            # Cancelled or not, what was verified is journalled: a fetch started again skips it.
            # Chunks written in part and never verified (a source lost or lying mid-chunk) are
            # punched out now that no task writes any more: their blocks hold nothing trusted.
            with trio.CancelScope(shield=True):
                for index in self._touched:
                    if not self.target.has(index):
                        self.target.discard(self.target.manifest.chunks[index])
                await trio.to_thread.run_sync(self.target.flush)
        self.report.excluded = dict(self.plan.excluded)
        self.report.lost = dict(self.plan.lost)
        if not self.plan.done:
            stuck = self.plan.stuck
            raise FetchFailed(f"{len(stuck)} chunks ({sum(c.size for c in stuck)} bytes) are held by no usable source"
                              + _why(self.report), self.report)
        return self.report

    async def _coordinate(self) -> None:
        plan = self.plan
        while not plan.done:
            for a in plan.assign(trio.current_time()):
                self.workers[a.source].give(a.chunk)
            if not self.connecting and plan.stuck:
                return
            self._changed = trio.Event()
            deadline = plan.next_timer()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self._changed.wait()
            for key in plan.handle_timer(trio.current_time()):
                self._end(key)

    def _end(self, key: str) -> None:
        worker = self.workers.pop(key, None)
        if worker is not None:
            worker.scope.cancel()

    async def _flusher(self) -> None:
        while True:
            await trio.sleep(self.config.flush_interval)
            await trio.to_thread.run_sync(self.target.flush)

    async def _source(self, ref: SourceRef) -> None:
        key = ref.key
        worker: _Worker | None = None
        try:
            with within(self.config.connect_timeout, f"fetch stream to {key[:16]}"):
                stream = await self.peers.open_stream(ref.address, FETCH_PROTOCOL, node_id=ref.node_id)
            async with stream:
                key = stream.remote_node_id
                if key in self.workers or key in self.plan.excluded:
                    return
                have = await request(stream, HaveRequest(model=self.model), Have, "have", self.config.connect_timeout)
                chunks = len(self.target.manifest.chunks)
                if have.model != self.model or have.chunks != chunks or len(have.bitmap) != -(-chunks // 8):
                    raise _Liar(f"its have-map is not one of {chunks} chunks of this model")
                worker = self.workers[key] = _Worker(key, stream)
                self.plan.add_source(key, have.bitmap)
                self.connecting -= 1
                self.changed()
                with worker.scope:
                    await self._receive(worker)
        except (_Liar, BadChunk) as exc:
            log.warning("fetch source %s excluded: %s", key[:16], exc)
            self.plan.exclude(key, str(exc))
        except (StreamBroken, _Lost) as exc:
            self.plan.source_lost(key, str(exc))
        except ProtocolError as exc:
            # A malformed message once it serves is a lie; a refusal while connecting
            # (unreachable, overloaded, no such model) is not.
            if worker is not None and exc.code is ErrorCode.BAD_REQUEST:
                log.warning("fetch source %s excluded: %s", key[:16], exc)
                self.plan.exclude(key, str(exc))
            else:
                self.plan.source_lost(key, str(exc))
        finally:
            if worker is None:
                self.connecting -= 1
            elif self.workers.get(key) is worker:
                del self.workers[key]
            self.changed()

    async def _receive(self, worker: _Worker) -> None:
        # Ends by an exception of the source's, or by cancellation (a timeout, or the fetch done).
        while True:
            chunk = await worker.next_chunk(self.model)
            if not await self._read_chunk(worker, chunk):
                self.plan.chunk_missing(worker.key, chunk, trio.current_time())
                self.changed()
                continue
            if self.plan.chunk_verified(worker.key, chunk, trio.current_time()):
                self.report.fetched_chunks += 1
                self.report.fetched_bytes += chunk.size
                self.report.by_source[worker.key] = self.report.by_source.get(worker.key, 0) + chunk.size
            self.changed()
            if self.progress is not None:
                self.progress(self._progress())

    async def _read_chunk(self, worker: _Worker, chunk: Chunk) -> bool:
        """Receive the chunk, frames checked as they come and hashed; False if the source lacks it.

        The first source to deliver a frame of the chunk writes each frame at
        its offset as it arrives (a frame's worth of work on the event loop, no
        thread, no 4 MiB copy), and stops writing once the chunk is verified
        from another; a second copy (the end game) is held in memory and
        written whole if it is verified first. Either counts only once the whole
        hash matches (BadChunk otherwise, and bytes written are punched out
        again), and is recorded by whichever is verified first."""
        hasher = hashlib.sha256()
        got = 0
        buffer: bytearray | None = None
        try:
            # Every frame adds at least one byte, so this ends within chunk.size frames.
            while got < chunk.size:
                try:
                    message = await worker.stream.receive_message()
                except trio.EndOfChannel:
                    raise _Lost("the source ended its stream mid-chunk") from None
                if isinstance(message, ErrorMessage):
                    error = error_from_message(message)
                    if error.code is ErrorCode.NOT_FOUND and not got:
                        return False
                    raise _Lost(f"the source refused chunk {chunk.index}: {error}")
                if not isinstance(message, ChunkData):
                    raise _Liar(f"it answered a chunk request with {message.type!r}")
                if message.offset != chunk.offset + got:
                    raise _Liar(f"a frame at {message.offset} where chunk {chunk.index} continues at {chunk.offset + got}")
                data = message.data
                if got + len(data) > chunk.size:
                    raise _Liar(f"more than the {chunk.size} bytes of chunk {chunk.index}")
                self.plan.progressed(worker.key, trio.current_time(), len(data))
                hasher.update(data)
                if not got and self._writing.setdefault(chunk.index, worker.key) != worker.key:
                    buffer = bytearray()
                if buffer is not None:
                    buffer += data
                elif not self.target.has(chunk.index):
                    # Checked at each frame, with no checkpoint before the write: once another
                    # copy is recorded, nothing is written over it.
                    self._touched.add(chunk.index)
                    self.target.write_piece(chunk, got, data)
                got += len(data)
        finally:
            if self._writing.get(chunk.index) == worker.key:
                del self._writing[chunk.index]
        if hasher.digest() != chunk.sha256:
            raise BadChunk(f"the bytes of chunk {chunk.index} at {chunk.offset} do not match the manifest")
        if not self.target.has(chunk.index):
            if buffer is not None:
                self._touched.add(chunk.index)
                self.target.write_piece(chunk, 0, bytes(buffer))
            self.target.record(chunk)
        return True

    def _progress(self) -> FetchProgress:
        elapsed = max(trio.current_time() - self.started, 1e-9)
        done = self.report.reused_bytes + self.report.fetched_bytes
        rate = self.report.fetched_bytes / elapsed
        return FetchProgress(self.total, done, self.report.fetched_bytes, rate,
                             (self.total - done) / rate if rate > 0 else None, len(self.plan.sources),
                             list(self.plan.excluded))


def _why(report: FetchReport) -> str:
    reasons = [f"{k[:16]} excluded: {v}" for k, v in report.excluded.items()]
    reasons += [f"{k[:16]} lost: {v}" for k, v in report.lost.items()]
    return f" ({'; '.join(reasons[:4])})" if reasons else ""


async def fetch_chunks(
    peers: Peers,
    sources: Sequence[SourceRef],
    target: SparseFile,
    chunks: Sequence[Chunk],
    *,
    config: FetchConfig = FetchConfig(),
    progress: Progress | None = None,
) -> FetchReport:
    """Fetch every chunk of ``chunks`` that ``target`` lacks, verified, into it.

    FetchFailed if some remain that no usable source holds."""
    return await _Fetch(peers, target, chunks, config, progress).run(sources)


async def fetch_range(
    peers: Peers,
    sources: Sequence[SourceRef],
    manifest: Manifest,
    target: SparseFile | Path,
    layers: tuple[int, int],
    *,
    config: FetchConfig = FetchConfig(),
    progress: Progress | None = None,
    keep_unowned: bool = False,
) -> FetchReport:
    """Fetch the header and exactly the tensors ``layers`` (half-open) owns into the sparse file ``target``.

    ``target`` is an open ``SparseFile`` (which a ``ChunkSource`` may be
    serving meanwhile: each chunk is offered to others as soon as it is
    verified), or a path opened, resumed and closed here. The header comes first
    (it says how many layers the model has). Unless ``keep_unowned``, chunks of
    tensors the range does not own are punched out, so a re-assignment fetches
    only the difference and gives back what it dropped. RangeError if ``layers``
    is not a range of the model."""
    if isinstance(target, Path):
        sparse = await trio.to_thread.run_sync(SparseFile.open, target, manifest)
        try:
            return await fetch_range(peers, sources, manifest, sparse, layers, config=config, progress=progress,
                                     keep_unowned=keep_unowned)
        finally:
            await trio.to_thread.run_sync(sparse.close)
    if target.manifest.model_id != manifest.model_id:
        raise ValueError("the sparse file is of another model")
    report = await fetch_chunks(peers, sources, target, manifest.header_chunks_list(), config=config)
    n_layers = await trio.to_thread.run_sync(block_count, target.path)
    wanted = range_chunks(manifest, n_layers, *layers)
    if not keep_unowned:
        keep = {c.index for c in wanted}
        await trio.to_thread.run_sync(target.punch, [c for c in manifest.chunks if c.index not in keep])
    # The header's chunks are in hand already: the body is the rest (so the report counts none twice).
    body = [c for c in wanted if c.tensor is not None]
    report.add(await fetch_chunks(peers, sources, target, body, config=config, progress=progress))
    return report


def block_count(path: Path) -> int:
    """The layer count the GGUF header at ``path`` (as fetched, the body a hole) names."""
    try:
        with open(path, "rb") as f:
            layout = read_layout(f)
    except GGUFError as exc:
        raise ManifestError(f"the fetched header is not a usable GGUF ({exc})") from None
    if layout.block_count is None or layout.block_count < 1:
        raise ManifestError(f"the fetched header names no layer count for {layout.architecture!r}")
    return layout.block_count
