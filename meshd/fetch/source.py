"""The chunk source: serves the manifests and verified chunks of the files this node holds.

Register it on a node's peers with one line::

    source = ChunkSource()
    register(peers, source)                     # peers.handle(FETCH_PROTOCOL, source.serve)
    source.offer(WholeFile(path, manifest))     # or a SparseFile being fetched: only its verified chunks

A stream carries requests one at a time (``wire.fetch``): the source reads the
next request only once the last is answered, so what one fetcher can make it
buffer is one chunk. Bounded everywhere a peer can push:

* at most ``max_streams`` fetch streams served at once, ``max_streams_per_peer``
  of them per peer and ``max_streams_per_address`` per source address (identities
  are free, addresses are not); more are refused OVERLOADED (with a retry hint);
* upload budgets, token buckets of bytes a second: ``upload_rate`` per peer
  (``upload_burst`` deep) and ``total_upload_rate`` for all peers together
  (``total_upload_burst`` deep); a peer past its budget waits, others do not, and
  sybils share the total;
* while the node is busy computing (a ``busy`` callable, e.g. ``activity`` of a
  stage's engine calls), all uploads together trickle at ``busy_upload_rate``;
* a stream that sends no request for ``idle_timeout`` seconds is ended, and so
  is one whose peer does not take a frame within ``send_timeout`` (a peer that
  asks and never reads would otherwise hold its slot for good);
* every offset and size is checked against the manifest: a request that is
  not exactly one chunk, or a chunk not held verified, is refused typed.

Low priority next to activation traffic on the same link: chunks go out in
``FRAME_BYTES`` frames with a checkpoint between frames, so a decode frame
queued meanwhile is written after at most one chunk frame, and file reads run
in a worker thread, never on the event loop.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import trio

from meshd.mesh.addresses import source_group
from meshd.mesh.records import host_of
from meshd.net.peers import Peers
from meshd.net.stream import Stream
from meshd.store.holding import Holding
from wire.errors import ErrorCode, ProtocolError
from wire.fetch import (
    FETCH_PROTOCOL,
    FRAME_BYTES,
    ChunkData,
    ChunkRequest,
    Have,
    HaveRequest,
    ManifestPiece,
    ManifestRequest,
)
from wire.message import Message, error_message

log = logging.getLogger(__name__)

# Peers whose upload counts and buckets are remembered (the oldest forgotten first).
_MAX_PEERS_KEPT = 4096


@dataclass(frozen=True)
class SourceConfig:
    max_streams: int = 16
    max_streams_per_peer: int = 4
    # Identities cost nothing to make: 16 never-read streams from 4 of them on one host held every
    # slot and shut an honest `meshd pull` out. A fetcher opens one stream per source, so 4 lets
    # a few volunteers behind one NAT fetch from this node at once, and one host take a quarter.
    max_streams_per_address: int = 4
    # Bytes a second each peer may download from this node, and how far it may burst; None: no
    # limit. 32 MiB/s (a quarter of a gigabit link) and a 64 MiB burst: one reading peer took
    # about 1 GiB from a holder in 8 s with none; a range of a big model still comes at link speed
    # from several holders at once.
    upload_rate: float | None = float(32 << 20)
    upload_burst: int = 64 << 20
    # Bytes a second all peers together may download (None: no limit): the per-peer budget alone
    # is multiplied by as many identities as someone makes. 96 MiB/s leaves a gigabit link room
    # for the activations and the mesh's own traffic.
    total_upload_rate: float | None = float(96 << 20)
    total_upload_burst: int = 128 << 20
    idle_timeout: float = 30.0
    # Seconds a peer has to take one frame (256 KiB: 13 KiB/s at least) before its stream is ended:
    # the idle timeout covers reads only, and a send blocked on a peer that never reads held its
    # slot for as long as the peer liked.
    send_timeout: float = 20.0
    # Bytes a second for all peers together while the node is busy computing (``busy``): chunks
    # then trickle instead of taking the CPU and the link from the activations of a decode.
    busy_upload_rate: float = float(4 << 20)

    def __post_init__(self) -> None:
        if min(self.max_streams, self.max_streams_per_peer, self.max_streams_per_address, self.upload_burst,
               self.total_upload_burst) < 1 or min(self.idle_timeout, self.send_timeout) <= 0:
            raise ValueError("stream bounds, the bursts and the timeouts are positive")
        if self.busy_upload_rate <= 0 or any(r is not None and r <= 0 for r in (self.upload_rate,
                                                                             self.total_upload_rate)):
            raise ValueError("upload rates are positive")


@dataclass
class Uploaded:
    """What one peer has taken from this node."""

    bytes: int = 0
    chunks: int = 0
    refused: int = 0


def source_address(stream: Stream) -> str:
    """Where a fetch stream comes from, as the per-address cap counts it (``source_group``): the host of
    a direct link, the whole name of any other (a relayed circuit names its source node)."""
    return source_group(host_of(stream.link.address))


def activity(counter: Callable[[], int], window: float = 1.0) -> Callable[[], bool]:
    """A ``busy`` for ``ChunkSource``: True while ``counter()`` (say, a stage's engine calls) changed
    within the last ``window`` seconds."""
    last = counter()
    changed_at = -math.inf

    def busy() -> bool:
        nonlocal last, changed_at
        now = counter()
        if now != last:
            last, changed_at = now, trio.current_time()
        return trio.current_time() - changed_at < window

    return busy


class UploadBucket:
    """A token bucket on trio's clock: ``take`` waits until the bytes are earned (debt allowed, paid by waiting)."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.stamp = trio.current_time()

    async def take(self, n: int) -> None:
        now = trio.current_time()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= n
        if self.tokens < 0:
            await trio.sleep(-self.tokens / self.rate)


class ChunkSource:
    """Serves every ``offer``ed holding to any peer that asks (see the module docstring)."""

    def __init__(self, config: SourceConfig = SourceConfig(), busy: Callable[[], bool] | None = None) -> None:
        """``busy()`` says whether the node is computing for someone now (see ``activity``)."""
        self.config = config
        self._busy = busy
        # A quarter second's worth at most goes out at once while busy (and never more than a frame).
        self._busy_bucket = UploadBucket(config.busy_upload_rate, min(FRAME_BYTES, int(config.busy_upload_rate / 4)))
        self._total_bucket = (UploadBucket(config.total_upload_rate, config.total_upload_burst)
                              if config.total_upload_rate is not None else None)
        self._holdings: dict[str, Holding] = {}
        self._streams = 0
        self._per_peer: dict[str, int] = {}
        self._per_address: dict[str, int] = {}
        self._uploaded: OrderedDict[str, Uploaded] = OrderedDict()
        self._buckets: OrderedDict[str, UploadBucket] = OrderedDict()

    def offer(self, holding: Holding) -> None:
        """Serve ``holding`` under its manifest's model id (replacing an earlier one of the same model)."""
        self._holdings[holding.manifest.model_id] = holding

    def withdraw(self, model_id: str) -> None:
        """Stop serving a model; streams reading it get NOT_FOUND from their next request."""
        self._holdings.pop(model_id, None)

    def models(self) -> list[str]:
        """The model ids offered."""
        return list(self._holdings)

    def uploaded(self) -> dict[str, Uploaded]:
        """Per peer node id: what it took."""
        return dict(self._uploaded)

    @property
    def streams(self) -> int:
        """Fetch streams being served now."""
        return self._streams

    def _account(self, peer: str) -> Uploaded:
        entry = self._uploaded.get(peer)
        if entry is None:
            entry = self._uploaded[peer] = Uploaded()
            while len(self._uploaded) > _MAX_PEERS_KEPT:
                self._uploaded.popitem(last=False)
        self._uploaded.move_to_end(peer)
        return entry

    def _bucket(self, peer: str) -> UploadBucket | None:
        if self.config.upload_rate is None:
            return None
        bucket = self._buckets.get(peer)
        if bucket is None:
            bucket = self._buckets[peer] = UploadBucket(self.config.upload_rate, self.config.upload_burst)
            while len(self._buckets) > _MAX_PEERS_KEPT:
                self._buckets.popitem(last=False)
        self._buckets.move_to_end(peer)
        return bucket

    async def serve(self, stream: Stream) -> None:
        """The handler of one fetch stream (``Peers.handle(FETCH_PROTOCOL, source.serve)``)."""
        peer, address = stream.remote_node_id, source_address(stream)
        config = self.config
        try:
            if (self._streams >= config.max_streams or self._per_peer.get(peer, 0) >= config.max_streams_per_peer
                    or self._per_address.get(address, 0) >= config.max_streams_per_address):
                self._account(peer).refused += 1
                await self._send(stream, error_message(ProtocolError(
                    ErrorCode.OVERLOADED, "this source serves as many fetch streams as it takes",
                    retry_after_ms=2000)))
                return
            self._streams += 1
            _count(self._per_peer, peer, 1)
            _count(self._per_address, address, 1)
            try:
                await self._serve(stream, peer)
            finally:
                self._streams -= 1
                _count(self._per_peer, peer, -1)
                _count(self._per_address, address, -1)
        except trio.TooSlowError:
            # Returning ends the stream (a send cut midway has reset it already): the slot is free.
            log.info("ended a fetch stream of %s (%s): it took no frame for %g s", peer[:16], address,
                     config.send_timeout)

    async def _send(self, stream: Stream, message: Message) -> None:
        """Send within the send timeout (trio.TooSlowError past it)."""
        with trio.fail_after(self.config.send_timeout):
            await stream.send_message(message)

    async def _serve(self, stream: Stream, peer: str) -> None:
        while True:
            with trio.move_on_after(self.config.idle_timeout) as idle:
                try:
                    request = await stream.receive_message()
                except trio.EndOfChannel:
                    return
            if idle.cancelled_caught:
                return
            try:
                await self._answer(stream, peer, request)
            except ProtocolError as exc:
                if exc.code is not ErrorCode.NOT_FOUND and exc.code is not ErrorCode.BAD_REQUEST:
                    raise
                # A well-formed request this source cannot answer: it says so and keeps serving.
                await self._send(stream, error_message(exc))

    def _holding(self, model: str) -> Holding:
        holding = self._holdings.get(model)
        if holding is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"this node holds no model {model[:16]}")
        return holding

    async def _answer(self, stream: Stream, peer: str, request: Message) -> None:
        if isinstance(request, ChunkRequest):
            await self._send_chunk(stream, peer, request)
        elif isinstance(request, HaveRequest):
            holding = self._holding(request.model)
            await self._send(stream, Have(model=request.model, chunks=len(holding.manifest.chunks),
                                          bitmap=holding.bitmap()))
        elif isinstance(request, ManifestRequest):
            encoded = self._holding(request.model).manifest.encoded
            if request.offset >= len(encoded):
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"the manifest has {len(encoded)} bytes")
            await self._send(stream, ManifestPiece(model=request.model, total=len(encoded), offset=request.offset,
                                                   data=encoded[request.offset : request.offset + FRAME_BYTES]))
        else:
            # Not a fetch request at all: the peer is out of step; the stream is reset.
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"a fetch stream carries requests, not {request.type!r}")

    async def _send_chunk(self, stream: Stream, peer: str, request: ChunkRequest) -> None:
        holding = self._holding(request.model)
        chunk = holding.manifest.chunk_at(request.offset, request.size)
        if chunk is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{request.size} bytes at {request.offset} are no chunk of the manifest")
        if not holding.has(chunk.index):
            raise ProtocolError(ErrorCode.NOT_FOUND, f"chunk {chunk.index} is not held here")
        # The peer's budget first, then everyone's: a peer waiting on its own does not hold the total.
        for bucket in (self._bucket(peer), self._total_bucket):
            if bucket is not None:
                await bucket.take(chunk.size)
        try:
            data = await trio.to_thread.run_sync(holding.read, chunk)
        except (OSError, KeyError) as exc:
            # Dropped or damaged meanwhile: the peer asks elsewhere.
            log.warning("cannot read chunk %d of %s: %s", chunk.index, request.model[:16], exc)
            raise ProtocolError(ErrorCode.NOT_FOUND, f"chunk {chunk.index} is no longer readable here") from None
        view = memoryview(data)
        busy = self._busy
        for start in range(0, chunk.size, FRAME_BYTES):
            if busy is not None and busy():
                await self._busy_bucket.take(min(FRAME_BYTES, chunk.size - start))
            # Each frame is one message written before the next is built: activation records
            # queued on the link meanwhile go out between two frames (send_message checkpoints).
            await self._send(stream, ChunkData(offset=chunk.offset + start, data=bytes(view[start : start + FRAME_BYTES])))
        account = self._account(peer)
        account.bytes += chunk.size
        account.chunks += 1


def _count(counts: dict[str, int], key: str, step: int) -> None:
    """Add ``step`` to ``counts[key]``, the key gone at 0 (so the map holds only those with streams)."""
    left = counts.get(key, 0) + step
    if left:
        counts[key] = left
    else:
        del counts[key]


def register(peers: Peers, source: ChunkSource) -> None:
    """Serve ``source`` to every peer of ``peers``: the one line a daemon adds."""
    peers.handle(FETCH_PROTOCOL, source.serve)
