"""A partial copy of a model file: the original size, verified chunks at their offsets, holes elsewhere.

The range loader reads tensors at their offsets in the file, so a file that
holds just the owned tensors' bytes (and the header) loads like the whole one.
Beside it live the manifest it follows (``FILE.meshd-sparse``, its canonical
bytes) and a journal of the verified chunks (``FILE.meshd-have``: the model id
and a bitmap). The journal is written only after the data it records is on
disk (``fdatasync`` first, then an atomic rename), so after a crash a chunk is
either recorded and intact or refetched, never trusted unwritten.

``punch`` gives the blocks of chunks no longer wanted back to the filesystem
(``fallocate(PUNCH_HOLE)``) and forgets them.

A split set's copy is one sparse file per part, named as llama.cpp finds parts
(``NAME-00001-of-0000N.gguf`` ... beside each other), each at its part's size
with its chunks at their offsets in it; one manifest and one journal, beside
the name it was opened by, cover them all.

This is blocking file IO: the trio shell calls ``read`` (4 MiB) in a thread; the
fetcher writes a chunk's pieces as they arrive (``write_piece``, a frame at a
time, fast to the page cache) and ``record``s it once its hash matches.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import msgpack

from meshd.store.holding import bit_set
from meshd.store.manifest import Chunk, Manifest, ManifestError
from meshd.store.split import part_paths
from wire.fetch import MAX_MANIFEST_BYTES

MANIFEST_SUFFIX = ".meshd-sparse"
JOURNAL_SUFFIX = ".meshd-have"
_JOURNAL_VERSION = 1
# A model id and a bitmap of at most 2**20 chunks.
_MAX_JOURNAL_BYTES = (1 << 17) + 256

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


class BadChunk(ValueError):
    """Bytes that do not hash to the chunk the manifest names."""


class SparseError(OSError):
    """A sparse file that cannot be used (another model's, or its companions damaged)."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def punch_hole(fd: int, offset: int, size: int) -> None:
    """Deallocate ``size`` bytes at ``offset``, keeping the file's size (reads there give zeros)."""
    fallocate = _libc().fallocate
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, size) != 0:
        code = ctypes.get_errno()
        if code != errno.EOPNOTSUPP:
            raise OSError(code, os.strerror(code))
        # A filesystem without hole punching: zeros keep the file right, if not small.
        _zero(fd, offset, size)


def _zero(fd: int, offset: int, size: int) -> None:
    block = bytes(1 << 20)
    while size:
        step = min(size, len(block))
        os.pwrite(fd, block[:step], offset)
        offset += step
        size -= step


def verify(chunk: Chunk, data: bytes) -> None:
    if len(data) != chunk.size or hashlib.sha256(data).digest() != chunk.sha256:
        raise BadChunk(f"bytes at {chunk.offset} do not match chunk {chunk.index} of the manifest")


class SparseFile:
    """A sparse copy of one model's file (or of each part of a set), resumable. Open with ``SparseFile.open``."""

    def __init__(self, name: Path, manifest: Manifest, paths: list[Path], fds: list[int], bitmap: bytearray) -> None:
        # the file a loader is given: the model's, or the set's first part
        self.path = paths[0]
        self.paths = paths
        self._name = name
        self._manifest = manifest
        self._fds = fds
        self._bitmap = bitmap
        self._unsaved = False

    @classmethod
    def open(cls, path: Path, manifest: Manifest) -> SparseFile:
        """The sparse file at ``path`` for ``manifest``: created at the original size, or resumed. For a
        split set ``path`` names it (``NAME.gguf``, or its first part's name) and its parts lie beside it.

        Resuming keeps the chunks its journal records. A file there of another
        model (or a plain file with no journal) is refused: it is not ours to overwrite."""
        companion = path.with_name(path.name + MANIFEST_SUFFIX)
        journal = path.with_name(path.name + JOURNAL_SUFFIX)
        paths = part_paths(path, len(manifest.parts)) if manifest.more_parts else [path]
        bitmap = bytearray(-(-len(manifest.chunks) // 8))
        there = [p for p in paths if p.exists()]
        if there:
            if not journal.exists():
                raise SparseError(errno.EEXIST, f"{there[0]} exists and is not a partial download of this model")
            recorded_id, recorded = _read_journal(journal)
            if recorded_id != manifest.model_id:
                raise SparseError(errno.EEXIST, f"{there[0]} is a partial download of another model "
                                                f"({recorded_id[:16]})")
            # a part gone since (deleted by hand) holds nothing: its chunks are fetched again
            if len(recorded) == len(bitmap) and len(there) == len(paths):
                bitmap[:] = recorded
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
        fds: list[int] = []
        try:
            for part, file in zip(manifest.parts, paths, strict=True):
                fds.append(os.open(file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))
                # chunks are read whole, in whatever order peers ask for them: the device's read-ahead (8 MiB
                # on some disks) would read past a held run into the holes beside it and keep their pages
                os.posix_fadvise(fds[-1], 0, 0, os.POSIX_FADV_RANDOM)
                if os.fstat(fds[-1]).st_size != part.file_size:
                    os.ftruncate(fds[-1], part.file_size)
            if not companion.exists() or companion.read_bytes() != manifest.encoded:
                _write_atomic(companion, manifest.encoded)
            sparse = cls(path, manifest, paths, fds, bitmap)
            sparse._unsaved = True
            sparse.flush()
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return sparse

    @classmethod
    def resume(cls, path: Path, model_id: str | None = None) -> SparseFile:
        """Reopen a partial download from its companions alone (its manifest is beside it)."""
        companion = path.with_name(path.name + MANIFEST_SUFFIX)
        try:
            with open(companion, "rb") as f:
                data = f.read(MAX_MANIFEST_BYTES + 1)
            manifest = Manifest.decode(data, model_id)
        except (OSError, ManifestError) as exc:
            raise SparseError(errno.ENOENT, f"{path} has no usable manifest beside it ({exc})") from None
        return cls.open(path, manifest)

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    def has(self, index: int) -> bool:
        return 0 <= index < len(self._manifest.chunks) and bit_set(self._bitmap, index)

    def bitmap(self) -> bytes:
        return bytes(self._bitmap)

    def missing(self, chunks: Iterable[Chunk]) -> list[Chunk]:
        return [c for c in chunks if not self.has(c.index)]

    def verified_bytes(self) -> int:
        return sum(c.size for c in self._manifest.chunks if self.has(c.index))

    def allocated_bytes(self) -> int:
        """What the file (every part) takes on disk (its block count), holes excluded."""
        return sum(os.fstat(fd).st_blocks * 512 for fd in self._fds)

    def write(self, chunk: Chunk, data: bytes) -> None:
        """Verify ``data`` against ``chunk`` (BadChunk if it does not match), write it and record it.

        The record reaches the journal at the next ``flush``."""
        self.store(chunk, data)
        self.record(chunk)

    def store(self, chunk: Chunk, data: bytes) -> None:
        """``write`` without the record: the part that may run in a worker thread, beside others."""
        if self._manifest.chunks[chunk.index] != chunk:
            raise KeyError(chunk.index)
        verify(chunk, data)
        written = os.pwrite(self._fds[chunk.part], data, chunk.part_offset)
        if written != len(data):
            raise OSError(errno.EIO, f"short write at {chunk.offset}")

    def write_piece(self, chunk: Chunk, start: int, data: bytes | memoryview) -> None:
        """Write bytes of ``chunk`` from its byte ``start`` as they arrive, unverified.

        Safe because only recorded chunks are trusted (read, served, journalled):
        the caller hashes the pieces and ``record``s the chunk once the hash
        matches, or ``discard``s it."""
        if self._manifest.chunks[chunk.index] != chunk or start < 0 or start + len(data) > chunk.size:
            raise KeyError(chunk.index)
        if os.pwrite(self._fds[chunk.part], data, chunk.part_offset + start) != len(data):
            raise OSError(errno.EIO, f"short write at {chunk.offset + start}")

    def discard(self, chunk: Chunk) -> None:
        """Free the blocks of an unrecorded chunk's bytes (a bad chunk's, half written)."""
        if not self.has(chunk.index):
            punch_hole(self._fds[chunk.part], chunk.part_offset, chunk.size)

    def record(self, chunk: Chunk) -> None:
        """Count a stored chunk as verified (one thread only: the bitmap is not locked)."""
        self._bitmap[chunk.index >> 3] |= 1 << (chunk.index & 7)
        self._unsaved = True

    def read(self, chunk: Chunk) -> bytes:
        """A verified chunk's bytes; KeyError if it is not (or stops being) held.

        Checked again after the read: ``punch`` forgets a chunk before it frees its
        blocks, so a read that raced a punch (and may hold zeros) is refused, never served."""
        if not self.has(chunk.index) or self._manifest.chunks[chunk.index] != chunk:
            raise KeyError(chunk.index)
        data = os.pread(self._fds[chunk.part], chunk.size, chunk.part_offset)
        if not self.has(chunk.index):
            raise KeyError(chunk.index)
        return data

    def flush(self) -> None:
        """Make every recorded chunk durable, then the journal that records them.

        The bitmap is taken before the data is synced, so a chunk recorded
        meanwhile (by another thread) waits for the next flush."""
        if not self._unsaved:
            return
        self._unsaved = False
        snapshot = bytes(self._bitmap)
        try:
            for fd in self._fds:
                os.fdatasync(fd)
            journal = self._name.with_name(self._name.name + JOURNAL_SUFFIX)
            _write_atomic(journal, msgpack.packb([_JOURNAL_VERSION, self._manifest.model_id, snapshot]))
        except BaseException:
            self._unsaved = True
            raise

    def punch(self, chunks: Iterable[Chunk]) -> int:
        """Drop these chunks: forget them, then free their blocks. Returns the bytes released."""
        dropped = [c for c in chunks if self.has(c.index)]
        for c in dropped:
            self._bitmap[c.index >> 3] &= ~(1 << (c.index & 7)) & 0xFF
        # Forgotten first and durably: a crash between the two leaves holes nobody trusts, never trust in holes.
        self._unsaved = True
        self.flush()
        for c in dropped:
            punch_hole(self._fds[c.part], c.part_offset, c.size)
        return sum(c.size for c in dropped)

    def close(self) -> None:
        if self._fds:
            try:
                self.flush()
            finally:
                for fd in self._fds:
                    os.close(fd)
                self._fds = []


def _read_journal(journal: Path) -> tuple[str, bytes]:
    try:
        with open(journal, "rb") as f:
            data = f.read(_MAX_JOURNAL_BYTES)
        version, model_id, bitmap = msgpack.unpackb(data, raw=False, max_str_len=128, max_array_len=3, max_map_len=0)
        if version != _JOURNAL_VERSION or type(model_id) is not str or type(bitmap) is not bytes:
            raise ValueError("unknown journal format")
    except (OSError, ValueError, TypeError, msgpack.UnpackException) as exc:
        raise SparseError(errno.EINVAL, f"the journal {journal.name} is unreadable ({exc})") from None
    return model_id, bitmap


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
