"""Sparse files: verified chunks only, a journal that survives a restart, holes punched for dropped chunks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from meshd.store.manifest import Manifest, compute
from meshd.store.sparse import JOURNAL_SUFFIX, BadChunk, SparseError, SparseFile

SMALL_CHUNK = 4 << 10


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> tuple[Path, Manifest, bytes]:
    path = tiny_models["llama-gqa-untied"]
    return path, compute(path, SMALL_CHUNK), path.read_bytes()


def test_created_at_the_original_size_with_nothing_allocated(model: tuple[Path, Manifest, bytes], tmp_path: Path) -> None:
    _, manifest, _ = model
    sparse = SparseFile.open(tmp_path / "m.gguf", manifest)
    assert os.stat(tmp_path / "m.gguf").st_size == manifest.file_size
    assert sparse.allocated_bytes() == 0 and sparse.verified_bytes() == 0
    assert not any(sparse.has(c.index) for c in manifest.chunks)
    sparse.close()


def test_a_bad_chunk_is_refused_and_not_recorded(model: tuple[Path, Manifest, bytes], tmp_path: Path) -> None:
    _, manifest, data = model
    sparse = SparseFile.open(tmp_path / "m.gguf", manifest)
    chunk = manifest.chunks[3]
    good = data[chunk.offset : chunk.end]
    with pytest.raises(BadChunk):
        sparse.write(chunk, bytes([good[0] ^ 1]) + good[1:])
    with pytest.raises(BadChunk):
        sparse.write(chunk, good[:-1])
    assert not sparse.has(chunk.index)
    with pytest.raises(KeyError):
        sparse.read(chunk)
    sparse.write(chunk, good)
    assert sparse.read(chunk) == good
    sparse.close()


def test_verified_chunks_survive_a_restart_and_unflushed_ones_are_fetched_again(
    model: tuple[Path, Manifest, bytes], tmp_path: Path
) -> None:
    _, manifest, data = model
    path = tmp_path / "m.gguf"
    sparse = SparseFile.open(path, manifest)
    first, later = manifest.chunks[:5], manifest.chunks[5:8]
    for c in first:
        sparse.write(c, data[c.offset : c.end])
    sparse.flush()
    for c in later:
        sparse.write(c, data[c.offset : c.end])
    # A crash before the next flush: the journal on disk records only the first five.
    os.close(sparse._fds[0])
    again = SparseFile.resume(path, manifest.model_id)
    assert [c.index for c in manifest.chunks if again.has(c.index)] == [c.index for c in first]
    assert all(again.read(c) == data[c.offset : c.end] for c in first)
    assert again.missing(manifest.chunks[:8]) == list(later)
    again.close()


def test_punch_frees_the_blocks_and_forgets_the_chunks(model: tuple[Path, Manifest, bytes], tmp_path: Path) -> None:
    _, manifest, data = model
    sparse = SparseFile.open(tmp_path / "m.gguf", manifest)
    for c in manifest.chunks:
        sparse.write(c, data[c.offset : c.end])
    sparse.flush()
    full = sparse.allocated_bytes()
    big = [t for t in manifest.tensors if t.name.startswith("blk.1.")]
    dropped = manifest.chunks_of(t.name for t in big)
    released = sparse.punch(dropped)
    assert released == sum(t.size for t in big)
    assert full - sparse.allocated_bytes() >= released - len(dropped) * 8192
    assert not any(sparse.has(c.index) for c in dropped)
    with open(tmp_path / "m.gguf", "rb") as f:
        f.seek(big[0].offset)
        assert f.read(big[0].size) == bytes(big[0].size)
    sparse.close()
    # The journal agrees after a restart.
    again = SparseFile.resume(tmp_path / "m.gguf")
    assert again.missing(manifest.chunks) == dropped
    again.close()


def test_a_file_that_is_not_this_models_partial_download_is_left_alone(
    model: tuple[Path, Manifest, bytes], tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    _, manifest, _ = model
    plain = tmp_path / "plain.gguf"
    plain.write_bytes(b"someone's file")
    with pytest.raises(SparseError, match="not a partial download"):
        SparseFile.open(plain, manifest)
    assert plain.read_bytes() == b"someone's file"
    other = compute(tiny_models["qwen2-bias"], SMALL_CHUNK)
    SparseFile.open(tmp_path / "m.gguf", other).close()
    with pytest.raises(SparseError, match="another model"):
        SparseFile.open(tmp_path / "m.gguf", manifest)


def test_a_damaged_journal_is_an_error_not_trust(model: tuple[Path, Manifest, bytes], tmp_path: Path) -> None:
    _, manifest, _ = model
    SparseFile.open(tmp_path / "m.gguf", manifest).close()
    (tmp_path / ("m.gguf" + JOURNAL_SUFFIX)).write_bytes(b"\xff" * 10)
    with pytest.raises(SparseError, match="unreadable"):
        SparseFile.open(tmp_path / "m.gguf", manifest)
