"""Messages of the fetch protocol: a model's manifest and its verified chunks, from any member holding them.

One stream to a source carries requests one after another, each answered
before the source reads the next (so a fetcher's in-flight requests to a
source are bounded by what it sends, and the source buffers none):

* ``ManifestRequest(model, offset)`` -> ``ManifestPiece``: the manifest's
  canonical bytes, in pieces of at most ``FRAME_BYTES``; the fetcher checks
  the whole against the model id (its sha256).
* ``HaveRequest(model)`` -> ``Have``: a bitmap of the manifest's chunks the
  source holds verified (a partial source serves only those).
* ``ChunkRequest(model, offset, size)`` -> ``ChunkData`` frames of at most
  ``FRAME_BYTES`` each, in order, covering exactly one chunk of the manifest.
  The header is chunks too (the manifest's first), so "fetch the header" is
  a ChunkRequest like any other, verified and resumable the same way.

Any request may be answered by an ``ErrorMessage`` instead (NOT_FOUND for a
model or chunk the source lacks, OVERLOADED with a retry hint when its upload
budget is spent). Frames are small so that activation traffic on the same link
waits behind at most one of them.
"""

from __future__ import annotations

from pydantic import Field

from wire.limits import Limits, register_protocol
from wire.message import Message
from wire.types import Count, Digest

FETCH_PROTOCOL = "meshd/fetch/1"

# The most one ChunkData or ManifestPiece carries: a decode-step activation
# queued behind it waits for 256 KiB on the link, not a whole chunk.
FRAME_BYTES = 256 << 10
# A chunk is at most this (manifests use 4 MiB; tests use smaller ones).
MAX_CHUNK_BYTES = 64 << 20
# 2**20 chunks of 4 MiB are 4 TiB; a model has a few thousand tensors.
MAX_CHUNKS = 1 << 20
MAX_TENSORS = 1 << 16
MAX_TENSOR_NAME_BYTES = 256
# Everything a valid manifest can hold: per tensor its name and five small fields, every chunk's hash.
MAX_MANIFEST_BYTES = 64 + MAX_TENSORS * (MAX_TENSOR_NAME_BYTES + 2 * 32 + 40) + MAX_CHUNKS * 32

register_protocol(FETCH_PROTOCOL, Limits(max_message_bytes=FRAME_BYTES + 1024, max_objects=64, max_depth=4))


class ManifestRequest(Message, tag="manifest_request"):
    model: Digest
    offset: Count = 0


class ManifestPiece(Message, tag="manifest_piece"):
    model: Digest
    total: int = Field(ge=1, le=MAX_MANIFEST_BYTES)
    offset: Count
    data: bytes = Field(max_length=FRAME_BYTES)


class HaveRequest(Message, tag="have_request"):
    model: Digest


class Have(Message, tag="have"):
    model: Digest
    # Bit i (little-endian within each byte) set: chunk i of the manifest is held, verified.
    chunks: int = Field(ge=1, le=MAX_CHUNKS)
    bitmap: bytes = Field(max_length=MAX_CHUNKS // 8)


class ChunkRequest(Message, tag="chunk_request"):
    model: Digest
    offset: Count
    size: int = Field(ge=1, le=MAX_CHUNK_BYTES)


class ChunkData(Message, tag="chunk_data"):
    # Absolute in the file: the receiver checks it is exactly where the previous frame ended.
    offset: Count
    data: bytes = Field(min_length=1, max_length=FRAME_BYTES)
