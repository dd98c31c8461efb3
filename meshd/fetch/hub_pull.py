"""``meshd pull hf:...``: a hub model's files whole, or a layer range of it into a sparse file.

Whole: every file read once from the hub, written as it comes beside its
final name (``NAME.partial``) and hashed on the way, checked against the sha256
the commit pins, then renamed into place with its manifest cached beside it:
the files are then what a local copy is, the same model id, and are not read
again to be served. A range: the manifest (this node's own from an earlier
read, or built by reading the files once without keeping them), then exactly
the range's chunks, each checked, into a resumable sparse file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import trio

from meshd.fetch.fetcher import FetchProgress, FetchReport, block_count
from meshd.fetch.hub import HubReader, cached_manifest, remember_manifest
from meshd.fetch.hub_chunks import fetch_from_hub
from meshd.fetch.hub_hash import hash_model
from meshd.store.manifest import CHUNK_SIZE, Manifest, remember
from meshd.store.ranges import owned_tensors, range_chunks
from meshd.store.sparse import SparseFile
from meshd.store.split import part_paths

Progress = Callable[[int], None]


def file_paths(reader: HubReader, out: Path) -> list[Path]:
    """Where the files go: ``out``, or for a set the parts named as llama.cpp finds them beside it."""
    count = len(reader.model.files)
    return part_paths(out, count) if count > 1 else [out]


def pull_whole(reader: HubReader, out: Path, state_dir: Path | None, progress: Progress | None = None) -> Manifest:
    """Every file of the model into ``out`` (and its parts beside it), checked; the manifest built on the way."""
    paths = file_paths(reader, out)
    partial = [p.with_name(p.name + ".partial") for p in paths]
    out.parent.mkdir(parents=True, exist_ok=True)
    fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644) for p in partial]
    try:
        def sink(part: int, offset: int, data: bytes) -> None:
            os.pwrite(fds[part], data, offset)

        manifest = hash_model(reader, CHUNK_SIZE, progress, sink)
        for fd in fds:
            os.fsync(fd)
    except BaseException:
        for p in partial:
            p.unlink(missing_ok=True)
        raise
    finally:
        for fd in fds:
            os.close(fd)
    for p, final in zip(partial, paths, strict=True):
        os.replace(p, final)
    remember(paths[0], manifest, state_dir)
    if state_dir is not None:
        remember_manifest(state_dir, reader.model, manifest)
    return manifest


async def pull_range(reader: HubReader, state_dir: Path, out: Path | None, layers: tuple[int, int],
                     hashing: Progress | None = None, progress: Callable[[FetchProgress], None] | None = None
                     ) -> tuple[Manifest, Path, FetchReport]:
    """The header and the tensors of ``layers`` into a sparse file (``out``, or ``STATE_DIR/models/ID.gguf``),
    each chunk checked against the model's manifest: this node's own, built once from the whole files."""
    manifest = await trio.to_thread.run_sync(cached_manifest, state_dir, reader.model)
    if manifest is None:
        # layers the model does not have are a mistake said at once, not after a read of the whole files
        _, layout = await trio.to_thread.run_sync(reader.header, 0)
        if layout.block_count is not None:
            owned_tensors([], layout.block_count, *layers)
        manifest = await trio.to_thread.run_sync(hash_model, reader, CHUNK_SIZE, hashing, abandon_on_cancel=True)
        await trio.to_thread.run_sync(remember_manifest, state_dir, reader.model, manifest)
    path = out or state_dir / "models" / f"{manifest.model_id}.gguf"
    sparse = await trio.to_thread.run_sync(SparseFile.open, path, manifest)
    try:
        report = await fetch_from_hub(reader, sparse, manifest.header_chunks_list())
        n_layers = await trio.to_thread.run_sync(block_count, sparse.path)
        body = [c for c in range_chunks(manifest, n_layers, *layers) if c.tensor is not None]
        report.add(await fetch_from_hub(reader, sparse, body, progress=progress))
    finally:
        await trio.to_thread.run_sync(sparse.close)
    # the model's manifest, kept as the sparse file's own: a stage loading it (meshd serve) knows the model's id
    # without hashing the file, whose holes are not the model's bytes
    await trio.to_thread.run_sync(remember, sparse.path, manifest, None)
    return manifest, sparse.path, report
