"""The chunk source: serves the manifests and verified chunks of the files this node holds.

Register it on a node's peers with one line::

    source = ChunkSource()
    register(peers, source)                     # peers.handle(FETCH_PROTOCOL, source.serve)
    source.offer(WholeFile(path, manifest))     # or a SparseFile being fetched: only its verified chunks

A stream carries requests one at a time (``wire.fetch``): the source reads the
next request only once the last is answered, so what one fetcher can make it
buffer is one chunk. Bounded everywhere a peer can push:

* at most ``max_streams`` fetch streams served at once, ``max_streams_per_peer``
  of them per peer; more are refused OVERLOADED (with a retry hint);
* a per-peer upload budget (a token bucket of ``upload_rate`` bytes a second,
  ``upload_burst`` deep): a peer past it waits, others do not;
* a stream that sends no request for ``idle_timeout`` seconds is ended;
* every offset and size is checked against the manifest: a request that is
  not exactly one chunk, or a chunk not held verified, is refused typed.

Low priority next to activation traffic on the same link: chunks go out in
``FRAME_BYTES`` frames with a checkpoint between frames, so a decode frame
queued meanwhile is written after at most one chunk frame, and file reads run
in a worker thread, never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshd.net.link import Stream
from meshd.net.peers import Peers
from meshd.store.holding import Holding
from wire.fetch import FETCH_PROTOCOL


@dataclass(frozen=True)
class SourceConfig:
    max_streams: int = 16
    max_streams_per_peer: int = 4
    # Bytes a second each peer may download from this node, and how far it may burst; None: no limit.
    upload_rate: float | None = None
    upload_burst: int = 16 << 20
    idle_timeout: float = 30.0


@dataclass
class Uploaded:
    """What one peer has taken from this node."""

    bytes: int = 0
    chunks: int = 0
    refused: int = 0


class ChunkSource:
    """Serves every ``offer``ed holding to any peer that asks (see the module docstring)."""

    def __init__(self, config: SourceConfig = SourceConfig()) -> None:
        raise NotImplementedError

    def offer(self, holding: Holding) -> None:
        """Serve ``holding`` under its manifest's model id (replacing an earlier one of the same model)."""
        raise NotImplementedError

    def withdraw(self, model_id: str) -> None:
        """Stop serving a model; streams reading it get NOT_FOUND from their next request."""
        raise NotImplementedError

    def models(self) -> list[str]:
        """The model ids offered."""
        raise NotImplementedError

    def uploaded(self) -> dict[str, Uploaded]:
        """Per peer node id: what it took."""
        raise NotImplementedError

    async def serve(self, stream: Stream) -> None:
        """The handler of one fetch stream (``Peers.handle(FETCH_PROTOCOL, source.serve)``)."""
        raise NotImplementedError


def register(peers: Peers, source: ChunkSource) -> None:
    """Serve ``source`` to every peer of ``peers``: the one line a daemon adds."""
    peers.handle(FETCH_PROTOCOL, source.serve)
