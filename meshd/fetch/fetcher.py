"""The fetcher: a model's manifest and a set of its chunks, from several sources at once, verified.

::

    sources = [SourceRef("10.0.0.2:7000", node_id), SourceRef(None, other_node_id)]
    manifest = await fetch_manifest(peers, sources, model_id)
    report = await fetch_range(peers, sources, manifest, Path("model.gguf"), (0, 15))

The planner (``meshd.store.plan``) decides which source gets which chunk;
this shell moves the bytes: one stream per source with up to
``in_flight_per_source`` requests pipelined on it, each chunk's frames
checked as they come (offset exactly where the last frame ended, never past
the chunk) and the whole chunk hashed against the manifest before it is
written (``SparseFile.write``, in a thread). A source that sends a bad chunk,
an oversize or out-of-place frame or a malformed message is excluded for the
rest of the fetch; one that dies or times out has its in-flight chunks
re-queued elsewhere. Verified chunks are journalled, so a fetch resumed after
a crash (or started again with other sources) fetches only what is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from meshd.net.peers import Peers
from meshd.store.manifest import Chunk, Manifest
from meshd.store.sparse import SparseFile


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
    # A chunk request not fully answered within this is a failure of that source (re-queued elsewhere).
    request_timeout: float = 60.0
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
    fetched_chunks: int
    fetched_bytes: int
    reused_bytes: int  # already verified before this fetch
    by_source: dict[str, int]  # bytes verified from each source
    excluded: dict[str, str]  # source -> why


class FetchFailed(Exception):
    """Some chunks could not be fetched from any source (the report says what was)."""

    def __init__(self, message: str, report: FetchReport) -> None:
        super().__init__(message)
        self.report = report


Progress = Callable[[FetchProgress], None]


async def fetch_manifest(peers: Peers, sources: Sequence[SourceRef], model_id: str, *, timeout: float = 30.0) -> Manifest:
    """The manifest of ``model_id`` from the first source that has it and whose bytes hash to the id.

    ProtocolError (NOT_FOUND) when none does."""
    raise NotImplementedError


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
    raise NotImplementedError


async def fetch_range(
    peers: Peers,
    sources: Sequence[SourceRef],
    manifest: Manifest,
    path: Path,
    layers: tuple[int, int],
    *,
    config: FetchConfig = FetchConfig(),
    progress: Progress | None = None,
) -> FetchReport:
    """Fetch the header and exactly the tensors ``layers`` (half-open) owns into the sparse file ``path``.

    The header comes first (it says how many layers the model has); chunks of
    tensors the range no longer owns are punched out, so a re-assignment
    fetches only the difference and gives back what it dropped."""
    raise NotImplementedError
