"""A range loaded from a sparse copy of the model (what a volunteer that fetched only its layers holds) reads
its own tensors and none of the holes beside them, though its pages were evicted and fault back in.

The engine is real llama.cpp on the default model, in-process; the copy is meshd.store.sparse's; mincore
says which of its pages the kernel's page cache holds.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
from pagecache import evict, resident

from meshd.engine import Context, Model
from meshd.store.holding import WholeFile
from meshd.store.manifest import manifest_for
from meshd.store.ranges import range_chunks
from meshd.store.sparse import SparseFile

# The default model's layers; a range in its middle, whose holes on either side hold megabytes of tensors.
N_LAYERS = 30
RANGE = (10, 20)
# How far either side of its tensors a hole is looked at: half of this machine's 8 MiB read-around of a
# mapped file (read_ahead_kb; 128 KiB by default), so a fault at a tensor's edge that read around would
# leave pages here. The header's own read-ahead (a read(), not the mapping) ends megabytes before it.
NEAR = 4 << 20


def owned_runs(chunks: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The byte ranges that the chunks cover, adjacent ones joined, whole pages."""
    runs: list[tuple[int, int]] = []
    for start, end in sorted(chunks):
        start -= start % mmap.PAGESIZE
        end += -end % mmap.PAGESIZE
        if runs and start <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], end))
        else:
            runs.append((start, end))
    return runs


def test_a_range_loaded_cold_from_a_sparse_copy_reads_its_tensors_and_no_hole_beside_them(
        tmp_path: Path, default_model: Path) -> None:
    manifest = manifest_for(default_model)
    whole = WholeFile(default_model, manifest)
    chunks = range_chunks(manifest, N_LAYERS, *RANGE)
    sparse = SparseFile.open(tmp_path / "copy.gguf", manifest)
    try:
        for chunk in chunks:
            sparse.write(chunk, whole.read(chunk))
    finally:
        sparse.close()
    path = sparse.path
    tensors = owned_runs([(c.part_offset, c.part_offset + c.size) for c in chunks if c.tensor is not None])
    # but the last page: growing a file to a size off a page boundary zeroes its tail in the cache
    size = path.stat().st_size
    last_page = size - size % mmap.PAGESIZE
    beside = [(max(a - NEAR, 0), a) for a, _ in tensors] + [(b, min(b + NEAR, last_page)) for _, b in tensors]
    owned = sum(b - a for a, b in tensors) // mmap.PAGESIZE

    evict(path)
    assert resident(path, 0, size) == 0, "the copy stayed cached: nothing here would be read"
    with Model(path, RANGE) as model:
        # The load asks the kernel to read the range's tensors ahead (POSIX_MADV_WILLNEED, in big reads), but
        # that is a hint it may cut short: a loaded CI-like box had 2,272 of 5,412 pages in when the load
        # returned, a quiet one all. So only what the forward pass leaves is checked, not when it came.
        with Context(model, n_ctx=64, n_threads=1) as ctx:
            ctx.forward([0] * 4, range(4), hidden=np.ones((4, model.report.stage_width), dtype=np.float32))
        assert sum(resident(path, a, b) for a, b in tensors) == owned
        # the forward pass touched every tensor: a fault that read around or ahead would have read holes
        assert [resident(path, a, b) for a, b in beside] == [0] * len(beside), (tensors, beside)

    # the same when the tensors' pages, read ahead by the load, were evicted before they were used (as memory
    # pressure on a busy volunteer does): the forward pass faults them back in, each no more than its page
    with Model(path, RANGE) as model, Context(model, n_ctx=64, n_threads=1) as ctx:
        evict(path)
        assert sum(resident(path, a, b) for a, b in tensors) < owned // 2, "the evicted pages stayed cached"
        ctx.forward([0] * 4, range(4), hidden=np.ones((4, model.report.stage_width), dtype=np.float32))
        assert sum(resident(path, a, b) for a, b in tensors) == owned
        assert [resident(path, a, b) for a, b in beside] == [0] * len(beside), (tensors, beside)
