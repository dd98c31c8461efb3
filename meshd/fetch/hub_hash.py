"""The first holder of a hub model: every file read once, checked against the sha256 its commit pins, and
hashed into the manifest a local copy of the same files has (the same model id); and the check that a
member's manifest describes the hub model, for everyone after (meshd.fetch.hub says why a range cannot be
checked against the hub alone)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from meshd.fetch.hub import HubError, HubReader, check_parts
from meshd.store.manifest import CHUNK_SIZE, Manifest, ManifestError, Part, TensorEntry

# Bytes read a request while hashing a whole file: one long GET would do, but ranges let a broken
# connection resume where it broke.
_PASS_READ = 16 << 20

Progress = Callable[[int], None]


class _Hasher:
    """Fed a file's bytes in order: the whole file's sha256, and each region's (header, tensors) as a manifest
    hashes it, chunk by chunk."""

    def __init__(self, regions: list[tuple[str | None, int, int]], chunk_size: int,
                 beside: ThreadPoolExecutor) -> None:
        self.whole = hashlib.sha256()
        # the whole file's hash runs in a thread beside the regions' (hashlib lets the GIL go): with all three
        # hashes of every byte in one thread the whole read of tools/bench_hub.py's set took 284-315 MB/s from
        # the fake hub here, 423-441 this way (load 3-4)
        self.beside = beside
        self.regions = regions
        self.chunk_size = chunk_size
        self.pos = 0
        self.at = 0  # the region being hashed
        self.region_hash = hashlib.sha256()
        self.piece = hashlib.sha256()
        self.pieces: list[bytes] = []
        self.done: list[tuple[str | None, int, int, bytes, tuple[bytes, ...]]] = []

    def feed(self, data: bytes) -> None:
        whole = self.beside.submit(self.whole.update, data)
        try:
            self._regions(data)
        finally:
            whole.result()

    def _regions(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.at >= len(self.regions):
                self.pos += len(view)
                return
            name, offset, size = self.regions[self.at]
            if self.pos < offset:
                step = min(len(view), offset - self.pos)
                view, self.pos = view[step:], self.pos + step
                continue
            into = self.pos - offset
            step = min(len(view), size - into, self.chunk_size - into % self.chunk_size)
            self.region_hash.update(view[:step])
            self.piece.update(view[:step])
            view, self.pos = view[step:], self.pos + step
            into += step
            if into % self.chunk_size == 0 or into == size:
                self.pieces.append(self.piece.digest())
                self.piece = hashlib.sha256()
            if into == size:
                hashes = tuple(self.pieces) if len(self.pieces) > 1 else ()
                self.done.append((name, offset, size, self.region_hash.digest(), hashes))
                self.region_hash, self.pieces = hashlib.sha256(), []
                self.at += 1


def _blocks(reader: HubReader, part: int) -> Iterator[bytes]:
    """File ``part``'s bytes in order, a block read ahead while the last is hashed (the read waits on the
    network, the hash on a core: in turn they took 0.54 of the server's rate here)."""
    size = reader.model.files[part].size
    ranges = [(start, min(size, start + _PASS_READ)) for start in range(0, size, _PASS_READ)]
    with ThreadPoolExecutor(1) as ahead:
        pending = ahead.submit(reader.read, part, *ranges[0])
        for following in [*ranges[1:], None]:
            data = pending.result()
            if following is not None:
                pending = ahead.submit(reader.read, part, *following)
            yield data


def hash_model(reader: HubReader, chunk_size: int = CHUNK_SIZE, progress: Progress | None = None,
               sink: Callable[[int, int, bytes], None] | None = None) -> Manifest:
    """Read every file of the hub model once, check each against the sha256 its commit pins, and build its
    manifest (the one a local copy of the same files has: the same model id).

    ``sink(part, offset, data)`` is given the bytes as they come (a whole pull writes them). HubError if a
    file's bytes are not the pinned ones."""
    tick: Progress = progress or (lambda n: None)
    model = reader.model
    reader.check()
    headers = [reader.header(i) for i in range(len(model.files))]
    check_parts(model, [layout for _, layout in headers])
    parts, tensors = [], []
    for i, (f, (_, layout)) in enumerate(zip(model.files, headers, strict=True)):
        regions: list[tuple[str | None, int, int]] = [(None, 0, layout.header_size)]
        regions += [(t.name, t.offset, t.size) for t in layout.tensors]
        with ThreadPoolExecutor(1) as beside:
            hasher = _Hasher(regions, chunk_size, beside)
            for block in _blocks(reader, i):
                hasher.feed(block)
                if sink is not None:
                    sink(i, hasher.pos - len(block), block)
                tick(len(block))
        if hasher.whole.hexdigest() != f.sha256:
            raise HubError(f"the bytes {model.endpoint} serves as {f.path} do not hash to the sha256 "
                           f"{f.sha256[:12]} that commit {model.commit[:12]} pins (a lying mirror)")
        (_, _, header_size, header_sha, header_chunks), *rest = hasher.done
        parts.append(Part(f.size, header_size, header_sha, header_chunks))
        tensors += [TensorEntry(name or "", offset, size, digest, hashes, i) for name, offset, size, digest, hashes
                    in rest]
    first = parts[0]
    try:
        return Manifest(first.file_size, first.header_size, first.header_sha256, tuple(tensors), chunk_size,
                        first.header_chunks, tuple(parts[1:]))
    except ManifestError as exc:
        raise HubError(f"{model.name} of {model.where} has no usable manifest: {exc}") from None


def check_binding(reader: HubReader, manifest: Manifest) -> None:
    """That ``manifest`` (a member's word) describes the hub model: as many files, of the sizes the commit pins,
    each header the bytes the hub serves (read here). HubError otherwise. The tensors' hashes are checked as
    their bytes come (``fetch_from_hub``)."""
    model = reader.model
    if len(manifest.parts) != len(model.files):
        raise HubError(f"the manifest has {len(manifest.parts)} parts where {model.where} has {len(model.files)}")
    for i, (part, f) in enumerate(zip(manifest.parts, model.files, strict=True)):
        if part.file_size != f.size:
            raise HubError(f"the manifest says {f.path} is {part.file_size} bytes; commit {model.commit[:12]} "
                           f"says {f.size}")
        # exactly the header the manifest names: a volunteer reads nothing of the hub but headers and its tensors
        header = reader.read(i, 0, part.header_size)
        if hashlib.sha256(header).digest() != part.header_sha256:
            raise HubError(f"the header of {f.path} the hub serves is not the one the manifest names")


