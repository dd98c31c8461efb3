"""What a node holds of a model, as a source serves it: which chunks are verified, and their bytes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from meshd.store.manifest import Chunk, Manifest
from meshd.store.split import part_paths


class Holding(Protocol):
    """A file of one model, whole or partial. Only verified chunks are ``has`` and readable."""

    @property
    def manifest(self) -> Manifest: ...

    def has(self, index: int) -> bool: ...

    def read(self, chunk: Chunk) -> bytes:
        """The chunk's bytes (KeyError unless ``has(chunk.index)``). Blocking file IO: run off the event loop."""
        ...

    def bitmap(self) -> bytes:
        """Bit i (little-endian in each byte) set when chunk i is held verified."""
        ...


def full_bitmap(chunks: int) -> bytes:
    whole, rest = divmod(chunks, 8)
    return b"\xff" * whole + (bytes([(1 << rest) - 1]) if rest else b"")


def bit_set(bitmap: bytes | bytearray, index: int) -> bool:
    byte = index >> 3
    return byte < len(bitmap) and bool(bitmap[byte] >> (index & 7) & 1)


class WholeFile:
    """A complete GGUF (or every part of a split set, ``path`` its first) whose manifest was computed from
    it: every chunk is verified by construction.

    The manifest cache is trusted only while the files' sizes and mtimes hold
    (``manifest_for``); ``read`` checks the size again, so a file replaced under
    a running source stops being served instead of serving other bytes."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self._paths = part_paths(path, len(manifest.parts)) if manifest.more_parts else [path]
        # the file a loader is given: the model's, or the set's first part
        self.path = self._paths[0]
        self._manifest = manifest
        self._bitmap = full_bitmap(len(manifest.chunks))

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    def has(self, index: int) -> bool:
        return 0 <= index < len(self._manifest.chunks)

    def read(self, chunk: Chunk) -> bytes:
        if not self.has(chunk.index) or self._manifest.chunks[chunk.index] != chunk:
            raise KeyError(chunk.index)
        path = self._paths[chunk.part]
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size != self._manifest.parts[chunk.part].file_size:
                raise OSError(f"{path.name} changed size since its manifest was made")
            return os.pread(f.fileno(), chunk.size, chunk.part_offset)

    def bitmap(self) -> bytes:
        return self._bitmap
