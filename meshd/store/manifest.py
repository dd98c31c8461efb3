"""A stock GGUF's content address: its manifest, and the model id that hashes it.

The manifest names every byte a range loader may read: the header (metadata
and tensor infos, everything before the tensor data) and each tensor's name,
absolute offset, size and sha256, with per-chunk hashes for tensors larger than
one chunk (4 MiB by default). A fetcher checks each chunk against it before
writing, so the model id (sha256 of the manifest's canonical msgpack encoding)
is all a volunteer needs to trust bytes from any peer.

The encoding is a fixed-order msgpack array, so one manifest has one encoding
and decoding re-encodes to check it. A peer sends it: ``Manifest.decode``
bounds every length before msgpack builds anything and validates the layout
(tensors in file order, within the file, not overlapping, after the header).

Computing it reads the whole file once (``compute``, with a tqdm bar on a TTY);
``manifest_for`` caches it beside the file (``FILE.meshd-manifest``) or, when
that directory is not writable, in the state directory, and trusts the cache
only while the file's size and mtime are unchanged.

A ``gguf-split`` set has one manifest and one id: each part's header and size,
and each tensor's part with its offset in that part. Its chunks are numbered
and placed as if the parts lay end to end (a part's bytes start where the
previous part's end), the one byte space the fetch protocol names chunks in;
each chunk also says its part and where that part starts, for the files that
hold it. A single file keeps the manifest (and so the id) it always had.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import msgpack

from meshd.store.gguf_header import GGUFError
from meshd.store.split import MAX_PARTS, model_files
from wire.fetch import MAX_CHUNK_BYTES, MAX_CHUNKS, MAX_MANIFEST_BYTES, MAX_TENSORS
from wire.fetch import MAX_TENSOR_NAME_BYTES as MAX_NAME_BYTES

FORMAT_VERSION = 1
# A split set's manifest: a version of its own, so no set's encoding can be a file's.
SET_FORMAT_VERSION = 2
CHUNK_SIZE = 4 << 20
# Chunk sizes a manifest may declare: tests use small ones to get many chunks from a tiny model.
MIN_CHUNK_SIZE = 4 << 10
MAX_CHUNK_SIZE = MAX_CHUNK_BYTES
MAX_FILE_SIZE = 1 << 46
DIGEST_BYTES = 32

CACHE_SUFFIX = ".meshd-manifest"
_CACHE_VERSION = 1
# A set's cache stamps each part's size and mtime.
_SET_CACHE_VERSION = 2
# A cache file holds the manifest plus a few ints a part.
_MAX_CACHE_BYTES = MAX_MANIFEST_BYTES + 64 + 24 * MAX_PARTS

_READ_BLOCK = 1 << 20


class ManifestError(ValueError):
    """A manifest that is malformed, out of bounds, or does not match what it claims."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One verifiable piece of the file: the unit fetched, checked and recorded."""

    index: int
    # In the model's byte space: the file's, or a set's parts laid end to end.
    offset: int
    size: int
    sha256: bytes
    # The tensor it belongs to; None for a header.
    tensor: str | None
    # The part of a set holding it (0 in a single file), and where that part starts in the byte space.
    part: int = 0
    base: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.size

    @property
    def part_offset(self) -> int:
        """Where the chunk lies in its part's file."""
        return self.offset - self.base


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    # In its part's file (the file's, for a single file).
    offset: int
    size: int
    sha256: bytes
    # One hash per chunk of the tensor (from its first byte) when it spans more than one chunk, else empty.
    chunk_hashes: tuple[bytes, ...] = ()
    part: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True, slots=True)
class Part:
    """One file of a model: its size and its header (every byte before its tensor data)."""

    file_size: int
    header_size: int
    header_sha256: bytes
    # As for a tensor: per-chunk hashes when the header spans more than one chunk.
    header_chunks: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class Manifest:
    """The fields name the file, or a set's first part; ``more_parts`` the set's others, in order."""

    file_size: int
    header_size: int
    header_sha256: bytes
    # In (part, offset) order.
    tensors: tuple[TensorEntry, ...]
    chunk_size: int = CHUNK_SIZE
    # As for a tensor: per-chunk hashes when the header spans more than one chunk.
    header_chunks: tuple[bytes, ...] = ()
    more_parts: tuple[Part, ...] = ()
    _by_name: dict[str, TensorEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _validate(self)
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tensors})

    # ----- identity

    @cached_property
    def encoded(self) -> bytes:
        """The canonical encoding, the bytes the model id hashes."""
        body: list[Any]
        if not self.more_parts:
            tensors = [[t.name, t.offset, t.size, t.sha256, b"".join(t.chunk_hashes)] for t in self.tensors]
            body = [FORMAT_VERSION, self.chunk_size, self.file_size, self.header_size, self.header_sha256,
                    b"".join(self.header_chunks), tensors]
        else:
            parts = [[p.file_size, p.header_size, p.header_sha256, b"".join(p.header_chunks)] for p in self.parts]
            tensors = [[t.name, t.part, t.offset, t.size, t.sha256, b"".join(t.chunk_hashes)] for t in self.tensors]
            body = [SET_FORMAT_VERSION, self.chunk_size, parts, tensors]
        data: bytes = msgpack.packb(body, use_bin_type=True)
        return data

    @property
    def parts(self) -> tuple[Part, ...]:
        """The model's files in order: the one file, or every part of a set."""
        return (Part(self.file_size, self.header_size, self.header_sha256, self.header_chunks), *self.more_parts)

    @cached_property
    def bases(self) -> tuple[int, ...]:
        """Where each part starts in the model's byte space."""
        starts = [0]
        for p in self.parts[:-1]:
            starts.append(starts[-1] + p.file_size)
        return tuple(starts)

    @property
    def total_size(self) -> int:
        """The bytes of every file of the model."""
        return sum(p.file_size for p in self.parts)

    @cached_property
    def model_id(self) -> str:
        return hashlib.sha256(self.encoded).hexdigest()

    @classmethod
    def decode(cls, data: bytes, expected_id: str | None = None) -> Manifest:
        """The manifest ``data`` encodes, bounded and validated; ManifestError otherwise.

        With ``expected_id`` the bytes must hash to it (a peer's manifest for a model id)."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"a manifest of {len(data)} bytes exceeds the limit of {MAX_MANIFEST_BYTES}")
        if expected_id is not None and hashlib.sha256(data).hexdigest() != expected_id:
            raise ManifestError(f"the manifest does not hash to model id {expected_id[:16]}")
        try:
            body = msgpack.unpackb(
                data, raw=False, use_list=True, strict_map_key=True,
                max_str_len=MAX_NAME_BYTES, max_bin_len=MAX_CHUNKS * DIGEST_BYTES,
                max_array_len=MAX_TENSORS, max_map_len=0, max_ext_len=0,
            )
        except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
            raise ManifestError(f"undecodable manifest: {exc}") from None
        manifest = _from_body(body)
        if manifest.encoded != data:
            raise ManifestError("the manifest is not in its canonical encoding")
        return manifest

    # ----- contents

    def tensor(self, name: str) -> TensorEntry:
        entry = self._by_name.get(name)
        if entry is None:
            raise KeyError(name)
        return entry

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @cached_property
    def chunks(self) -> tuple[Chunk, ...]:
        """Every chunk in byte-space order: per part, its header's first, then each of its tensors'."""
        out: list[Chunk] = []
        regions: list[tuple[int, str | None, int, int, bytes, tuple[bytes, ...]]] = [
            (i, None, 0, p.header_size, p.header_sha256, p.header_chunks) for i, p in enumerate(self.parts)]
        regions += [(t.part, t.name, t.offset, t.size, t.sha256, t.chunk_hashes) for t in self.tensors]
        # (part, offset) order: each part's header sorts before its tensors, which lie after it
        regions.sort(key=lambda region: (region[0], region[2]))
        for part, name, offset, size, whole, hashes in regions:
            base = self.bases[part]
            if not hashes:
                out.append(Chunk(len(out), base + offset, size, whole, name, part, base))
                continue
            for i, digest in enumerate(hashes):
                start = i * self.chunk_size
                out.append(Chunk(len(out), base + offset + start, min(self.chunk_size, size - start), digest, name,
                                 part, base))
        return tuple(out)

    @cached_property
    def _chunks_by_tensor(self) -> dict[str | None, list[Chunk]]:
        found: dict[str | None, list[Chunk]] = {}
        for chunk in self.chunks:
            found.setdefault(chunk.tensor, []).append(chunk)
        return found

    def header_chunks_list(self) -> list[Chunk]:
        """The chunks of every header (each part's, for a set)."""
        return list(self._chunks_by_tensor[None])

    def chunks_of(self, names: Iterable[str]) -> list[Chunk]:
        """The chunks of these tensors (KeyError for a name the manifest lacks), in file order."""
        wanted = set(names)
        missing = wanted - self._by_name.keys()
        if missing:
            raise KeyError(sorted(missing)[0])
        return [c for c in self.chunks if c.tensor in wanted]

    def chunk_at(self, offset: int, size: int) -> Chunk | None:
        """The chunk exactly at ``offset`` of ``size`` bytes, if there is one."""
        chunk = self._chunk_by_offset.get(offset)
        return chunk if chunk is not None and chunk.size == size else None

    @cached_property
    def _chunk_by_offset(self) -> dict[int, Chunk]:
        return {c.offset: c for c in self.chunks}

    def bytes_of(self, chunks: Iterable[Chunk]) -> int:
        return sum(c.size for c in chunks)


def _chunk_count(size: int, chunk_size: int) -> int:
    """How many per-chunk hashes a region of ``size`` bytes carries (0: its whole hash is its one chunk)."""
    return 0 if size <= chunk_size else -(-size // chunk_size)


def _validate(m: Manifest) -> None:
    if not (MIN_CHUNK_SIZE <= m.chunk_size <= MAX_CHUNK_SIZE) or m.chunk_size & (m.chunk_size - 1):
        raise ManifestError(f"chunk size {m.chunk_size} is not a power of two from {MIN_CHUNK_SIZE} to {MAX_CHUNK_SIZE}")
    parts = m.parts
    if len(parts) > MAX_PARTS:
        raise ManifestError(f"a set of {len(parts)} parts exceeds the limit of {MAX_PARTS}")
    chunks = 0
    for i, p in enumerate(parts):
        what = "the header" if len(parts) == 1 else f"the header of part {i + 1}"
        if not 0 < p.file_size <= MAX_FILE_SIZE:
            raise ManifestError(f"file size {p.file_size} is out of bounds")
        if not 0 < p.header_size <= p.file_size:
            raise ManifestError(f"header size {p.header_size} is not within the file")
        _check_digest(p.header_sha256, what)
        _check_chunk_hashes(p.header_chunks, p.header_size, m.chunk_size, what)
        chunks += max(1, len(p.header_chunks))
    if sum(p.file_size for p in parts) > MAX_FILE_SIZE:
        raise ManifestError(f"a set of {sum(p.file_size for p in parts)} bytes is out of bounds")
    if len(m.tensors) > MAX_TENSORS:
        raise ManifestError(f"{len(m.tensors)} tensors exceed the limit of {MAX_TENSORS}")
    part, end = 0, parts[0].header_size
    names: set[str] = set()
    for t in m.tensors:
        if not t.name or len(t.name.encode()) > MAX_NAME_BYTES:
            raise ManifestError(f"a tensor name of {len(t.name.encode())} bytes is empty or over {MAX_NAME_BYTES}")
        if t.name in names:
            raise ManifestError(f"tensor {t.name!r} is listed twice")
        names.add(t.name)
        if not part <= t.part < len(parts):
            raise ManifestError(f"tensor {t.name!r} is in part {t.part}, out of order or of no part")
        if t.part != part:
            part, end = t.part, parts[t.part].header_size
        if t.size < 1 or t.offset < end or t.offset + t.size > parts[part].file_size:
            raise ManifestError(f"tensor {t.name!r} at {t.offset}+{t.size} overlaps another, the header or the file's end")
        end = t.offset + t.size
        _check_digest(t.sha256, f"tensor {t.name!r}")
        _check_chunk_hashes(t.chunk_hashes, t.size, m.chunk_size, f"tensor {t.name!r}")
        chunks += max(1, len(t.chunk_hashes))
    if chunks > MAX_CHUNKS:
        raise ManifestError(f"{chunks} chunks exceed the limit of {MAX_CHUNKS}")


def _check_digest(digest: bytes, what: str) -> None:
    if len(digest) != DIGEST_BYTES:
        raise ManifestError(f"the hash of {what} is {len(digest)} bytes, not {DIGEST_BYTES}")


def _check_chunk_hashes(hashes: Sequence[bytes], size: int, chunk_size: int, what: str) -> None:
    if len(hashes) != _chunk_count(size, chunk_size):
        raise ManifestError(f"{what} has {len(hashes)} chunk hashes, not {_chunk_count(size, chunk_size)}")
    for digest in hashes:
        _check_digest(digest, f"a chunk of {what}")


def _split_hashes(blob: object, what: str) -> tuple[bytes, ...]:
    if type(blob) is not bytes or len(blob) % DIGEST_BYTES:
        raise ManifestError(f"the chunk hashes of {what} are not whole {DIGEST_BYTES}-byte digests")
    return tuple(blob[i : i + DIGEST_BYTES] for i in range(0, len(blob), DIGEST_BYTES))


def _int(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ManifestError(f"{what} is not a non-negative integer")
    return value


def _from_body(body: Any) -> Manifest:
    if type(body) is list and body and body[0] == SET_FORMAT_VERSION and type(body[0]) is int:
        return _set_from_body(body)
    if type(body) is not list or len(body) != 7:
        raise ManifestError("a manifest is an array of 7 fields")
    version, chunk_size, file_size, header_size, header_sha, header_chunks, tensors = body
    if version != FORMAT_VERSION or type(version) is not int:
        raise ManifestError(f"unsupported manifest version {version!r}")
    if type(header_sha) is not bytes or type(tensors) is not list:
        raise ManifestError("the header hash is bytes and the tensors an array")
    entries = []
    for item in tensors:
        if type(item) is not list or len(item) != 5:
            raise ManifestError("a tensor entry is an array of 5 fields")
        name, offset, size, digest, parts = item
        if type(name) is not str or type(digest) is not bytes:
            raise ManifestError("a tensor's name is a string and its hash bytes")
        entries.append(TensorEntry(name, _int(offset, "an offset"), _int(size, "a size"), digest,
                                   _split_hashes(parts, repr(name))))
    return Manifest(
        file_size=_int(file_size, "the file size"), header_size=_int(header_size, "the header size"),
        header_sha256=header_sha, tensors=tuple(entries), chunk_size=_int(chunk_size, "the chunk size"),
        header_chunks=_split_hashes(header_chunks, "the header"),
    )


def _set_from_body(body: list[Any]) -> Manifest:
    if len(body) != 4:
        raise ManifestError("a split set's manifest is an array of 4 fields")
    _, chunk_size, parts, tensors = body
    if type(parts) is not list or type(tensors) is not list:
        raise ManifestError("a split set's parts and tensors are arrays")
    # one part is a file, whose manifest is the single-file one: a set's id is never a file's
    if not 2 <= len(parts) <= MAX_PARTS:
        raise ManifestError(f"a split set has 2 to {MAX_PARTS} parts, not {len(parts)}")
    files = []
    for item in parts:
        if type(item) is not list or len(item) != 4 or type(item[2]) is not bytes:
            raise ManifestError("a part is an array of 4 fields, its header hash bytes")
        file_size, header_size, header_sha, header_chunks = item
        files.append(Part(_int(file_size, "a part's size"), _int(header_size, "a header size"), header_sha,
                          _split_hashes(header_chunks, "a part's header")))
    entries = []
    for entry in tensors:
        if type(entry) is not list or len(entry) != 6:
            raise ManifestError("a tensor entry of a split set is an array of 6 fields")
        name, part, offset, size, digest, hashes = entry
        if type(name) is not str or type(digest) is not bytes:
            raise ManifestError("a tensor's name is a string and its hash bytes")
        entries.append(TensorEntry(name, _int(offset, "an offset"), _int(size, "a size"), digest,
                                   _split_hashes(hashes, repr(name)), _int(part, "a part")))
    first = files[0]
    return Manifest(file_size=first.file_size, header_size=first.header_size, header_sha256=first.header_sha256,
                    tensors=tuple(entries), chunk_size=_int(chunk_size, "the chunk size"),
                    header_chunks=first.header_chunks, more_parts=tuple(files[1:]))


# ----- computing one from a file


Progress = Callable[[int], None]


def model_paths(path: Path) -> list[tuple[Path, int, list[tuple[str, int, int]]]]:
    """Per file of the model at ``path`` (the file, or every part of the set it is a part of):
    ``(path, header size, [(tensor name, offset, size)])`` in file order.

    Reads only the headers. A file that is not a readable GGUF raises ManifestError; a set with a
    part missing or not of it, SplitError (a ValueError) naming the part."""
    try:
        files = model_files(path)
    except GGUFError as exc:
        raise ManifestError(f"{path.name} is not a readable GGUF ({exc})") from None
    return [(p, layout.header_size, [(t.name, t.offset, t.size) for t in layout.tensors])
            for p, layout in zip(files.paths, files.layouts, strict=True)]


def _hash_region(f: Any, offset: int, size: int, chunk_size: int, progress: Progress) -> tuple[bytes, tuple[bytes, ...]]:
    whole = hashlib.sha256()
    parts: list[bytes] = []
    f.seek(offset)
    left = size
    while left:
        piece = hashlib.sha256()
        take = min(chunk_size, left)
        while take:
            block = f.read(min(_READ_BLOCK, take))
            if not block:
                raise ManifestError(f"the file ends inside a tensor, at byte {f.tell()}")
            whole.update(block)
            piece.update(block)
            take -= len(block)
            left -= len(block)
            progress(len(block))
        parts.append(piece.digest())
    return whole.digest(), tuple(parts) if len(parts) > 1 else ()


def compute(path: Path, chunk_size: int = CHUNK_SIZE, progress: Progress | None = None) -> Manifest:
    """Read ``path`` (and the rest of its set, for a part of one) once and build its manifest
    (``progress(bytes)`` after each block read)."""
    tick: Progress = progress or (lambda n: None)
    parts, tensors = [], []
    for i, (part, header_size, layout) in enumerate(model_paths(path)):
        with open(part, "rb") as f:
            header_sha, header_chunks = _hash_region(f, 0, header_size, chunk_size, tick)
            parts.append(Part(os.fstat(f.fileno()).st_size, header_size, header_sha, header_chunks))
            for name, offset, size in layout:
                digest, hashes = _hash_region(f, offset, size, chunk_size, tick)
                tensors.append(TensorEntry(name, offset, size, digest, hashes, i))
    first = parts[0]
    return Manifest(first.file_size, first.header_size, first.header_sha256, tuple(tensors), chunk_size,
                    first.header_chunks, tuple(parts[1:]))


def _progress_bar(path: Path, total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"hashing {path.name}",
                disable=not sys.stderr.isatty(), leave=False)


def cache_paths(path: Path, state_dir: Path | None) -> list[Path]:
    """Where a manifest of ``path`` is cached: beside it, then in the state directory."""
    paths = [path.with_name(path.name + CACHE_SUFFIX)]
    if state_dir is not None:
        key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
        paths.append(state_dir / "manifests" / f"{key}{CACHE_SUFFIX}")
    return paths


Stamp = list[list[int]]


def _stamp(paths: Iterable[Path]) -> Stamp:
    """Each file's size and mtime: a cache is trusted only while they hold."""
    return [[st.st_size, st.st_mtime_ns] for st in (p.stat() for p in paths)]


def _cache_record(stamp: Stamp, encoded: bytes) -> list[Any]:
    # A file's record is the one caches always had, so they stay valid; a set's stamps every part.
    if len(stamp) == 1:
        return [_CACHE_VERSION, *stamp[0], encoded]
    return [_SET_CACHE_VERSION, stamp, encoded]


def _read_cache(cache: Path, stamp: Stamp) -> Manifest | None:
    try:
        with open(cache, "rb") as f:
            data = f.read(_MAX_CACHE_BYTES + 1)
        if len(data) > _MAX_CACHE_BYTES:
            return None
        record = msgpack.unpackb(data, raw=False, max_bin_len=MAX_MANIFEST_BYTES, max_array_len=max(4, MAX_PARTS),
                                 max_str_len=0, max_map_len=0)
        encoded = record[-1] if type(record) is list and record else None
        if type(encoded) is not bytes or record != _cache_record(stamp, encoded):
            return None
        return Manifest.decode(encoded)
    except (OSError, ValueError, TypeError, msgpack.UnpackException):
        # Missing, damaged or stale: computed again.
        return None


def _write_cache(cache: Path, stamp: Stamp, manifest: Manifest) -> bool:
    data = msgpack.packb(_cache_record(stamp, manifest.encoded), use_bin_type=True)
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, cache)
        return True
    except OSError:
        tmp.unlink(missing_ok=True)
        return False


def manifest_for(path: Path, state_dir: Path | None = None, chunk_size: int = CHUNK_SIZE) -> Manifest:
    """The manifest of ``path`` (of its whole set, for a part of one): from a cache still matching the
    files' sizes and mtimes, else computed and cached (beside the file, or the set's first part).

    Computing shows a progress bar on a TTY and nothing otherwise."""
    paths = [p for p, _, _ in model_paths(path)]
    stamp = _stamp(paths)
    caches = cache_paths(paths[0], state_dir)
    for cache in caches:
        found = _read_cache(cache, stamp)
        if found is not None and found.chunk_size == chunk_size:
            return found
    with _progress_bar(paths[0], sum(size for size, _ in stamp)) as bar:
        manifest = compute(paths[0], chunk_size, bar.update)
    for cache in caches:
        if _write_cache(cache, stamp, manifest):
            break
    return manifest


def remember(path: Path, manifest: Manifest, state_dir: Path | None = None) -> None:
    """Cache ``manifest`` as the one of ``path`` (and its set), as ``manifest_for`` would: for files just
    written from bytes hashed as they came (a pull from the hub), so that nothing reads them again."""
    paths = [p for p, _, _ in model_paths(path)]
    stamp = _stamp(paths)
    for cache in cache_paths(paths[0], state_dir):
        if _write_cache(cache, stamp, manifest):
            return
