"""Two source processes serve the default model; one is SIGKILLed mid-fetch. The fetch finishes from the
other without fetching a verified chunk twice, and the range loads from the sparse file and computes
exactly what the whole model does."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import trio
from fetchnet import peers_node, start_source_process
from localmesh import stop_process
from parity import assert_same_logits

from meshd.engine import Context, Model
from meshd.fetch.fetcher import FetchProgress, SourceRef, fetch_manifest, fetch_range
from meshd.store.manifest import compute
from meshd.store.ranges import range_chunks

pytestmark = pytest.mark.slow  # two processes hash and serve the 98 MB default model

LAYERS = (10, 30)
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]


def logits(stages: list[tuple[Path, tuple[int, int] | None]]) -> np.ndarray:
    models = [Model(p, r) for p, r in stages]
    contexts = [Context(m, n_ctx=64, n_threads=1) for m in models]
    try:
        seq, pos = np.zeros(len(TOKENS), np.int32), np.arange(len(TOKENS), dtype=np.int32)
        out = contexts[0].forward(seq, pos, tokens=TOKENS)
        for ctx in contexts[1:]:
            out = ctx.forward(seq, pos, hidden=out)
        return out.copy()
    finally:
        for c in contexts:
            c.close()
        for m in models:
            m.close()


async def test_a_source_killed_mid_fetch_costs_no_verified_chunk(default_model: Path, tmp_path: Path) -> None:
    manifest = compute(default_model)
    victim = start_source_process("whole", default_model)
    survivor = start_source_process("whole", default_model)
    killed: list[int] = []
    try:
        wanted = range_chunks(manifest, 30, *LAYERS)
        total = sum(c.size for c in wanted)

        def kill_a_third_in(p: FetchProgress) -> None:
            if not killed and p.done_bytes * 3 >= total:
                os.kill(victim.proc.pid, signal.SIGKILL)
                killed.append(p.done_bytes)

        out = tmp_path / "range.gguf"
        sources = [SourceRef(victim.address, victim.node_id), SourceRef(survivor.address, survivor.node_id)]
        async with peers_node() as me:
            with trio.fail_after(120):
                got = await fetch_manifest(me, sources, manifest.model_id)
                report = await fetch_range(me, sources, got, out, LAYERS, progress=kill_a_third_in)
    finally:
        stop_process(victim.proc)
        stop_process(survivor.proc)
    assert killed and victim.proc.returncode == -signal.SIGKILL
    assert victim.node_id in report.lost and report.excluded == {}
    assert report.by_source[victim.node_id] > 0 and report.by_source[survivor.node_id] > 0
    # Every chunk fetched once: none verified before the kill was fetched again.
    assert report.fetched_chunks == len(wanted) and report.fetched_bytes == total
    original, fetched = default_model.read_bytes(), out.read_bytes()
    assert all(fetched[c.offset : c.end] == original[c.offset : c.end] for c in wanted)
    # The disk holds the header and the owned tensors, give or take a block a tensor.
    assert total <= os.stat(out).st_blocks * 512 <= total * 1.01 + len(wanted) * 4096
    assert_same_logits(logits([(default_model, None)]), logits([(default_model, (0, 10)), (out, LAYERS)]),
                       "head from the whole file, tail from the fetched range")
