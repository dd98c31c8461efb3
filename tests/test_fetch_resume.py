"""A fetch cut short (crash, cancel) resumes with only what was missing; a re-assignment fetches the difference."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
from fetchnet import chunked, peers_node, source_node

from meshd.fetch.fetcher import FetchConfig, FetchProgress, SourceRef, fetch_chunks, fetch_range
from meshd.store.holding import WholeFile
from meshd.store.manifest import Manifest
from meshd.store.ranges import range_chunks
from meshd.store.sparse import SparseFile

N_LAYERS = 6


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> tuple[Path, Manifest]:
    return chunked(tiny_models["qwen3-qknorm"])


async def test_a_crashed_fetch_resumes_without_fetching_journalled_chunks_again(
    model: tuple[Path, Manifest], tmp_path: Path
) -> None:
    path, manifest = model
    out = tmp_path / "mine.gguf"
    chunks = list(manifest.chunks)
    async with source_node(WholeFile(path, manifest)) as (_, at, source), peers_node() as me:
        target = SparseFile.open(out, manifest)
        cut = trio.CancelScope()

        def stop_halfway(p: FetchProgress) -> None:
            if p.done_bytes * 2 >= p.total_bytes:
                cut.cancel()

        with trio.fail_after(30):
            with cut:
                await fetch_chunks(me, [SourceRef(at)], target, chunks, progress=stop_halfway,
                                   config=FetchConfig(in_flight_per_source=1))
        assert cut.cancelled_caught
        # The process dies here: nothing more is flushed; the journal has what the cut flushed.
        os.close(target._fds[0])
        first = sum(u.chunks for u in source.uploaded().values())
        resumed = SparseFile.resume(out, manifest.model_id)
        journalled = len(chunks) - len(resumed.missing(chunks))
        assert 0 < journalled <= first < len(chunks)
        with trio.fail_after(30):
            report = await fetch_chunks(me, [SourceRef(at)], resumed, chunks)
        resumed.close()
    assert report.fetched_chunks == len(chunks) - journalled
    assert report.reused_bytes == sum(c.size for c in chunks) - report.fetched_bytes
    assert out.read_bytes() == path.read_bytes()


async def test_a_reassignment_fetches_only_the_new_tensors_and_drops_the_old(
    model: tuple[Path, Manifest], tmp_path: Path
) -> None:
    path, manifest = model
    out = tmp_path / "mine.gguf"
    async with source_node(WholeFile(path, manifest)) as (_, at, _), peers_node() as me:
        with trio.fail_after(30):
            first = await fetch_range(me, [SourceRef(at)], manifest, out, (0, 3))
            second = await fetch_range(me, [SourceRef(at)], manifest, out, (2, 4))
    old = {c.index for c in range_chunks(manifest, N_LAYERS, 0, 3)}
    new = range_chunks(manifest, N_LAYERS, 2, 4)
    assert first.fetched_chunks == len(old)
    assert second.fetched_chunks == len([c for c in new if c.index not in old])
    sparse = SparseFile.resume(out)
    assert {c.index for c in manifest.chunks if sparse.has(c.index)} == {c.index for c in new}
    # Blocks 0-1 and the embeddings were punched out: the disk holds about the new range.
    needed = sum(c.size for c in new)
    assert needed <= sparse.allocated_bytes() <= needed + len(new) * 8192
    sparse.close()
