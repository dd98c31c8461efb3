"""A range's tensors, as ``meshd.store.ranges`` names them, are exactly what the patched loader reads.

Each range is loaded from a sparse file that holds only the header and those
tensors' bytes (holes elsewhere): the loader must register exactly those
tensors, and the chain of such ranges must give the whole model's logits.
A missing tensor would be read as zeros from a hole and change the logits; an
extra one would show in the tensor count.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from parity import assert_same_logits

from meshd.engine import Context, Model
from meshd.store.manifest import Manifest, compute
from meshd.store.ranges import RangeError, owned_tensors, range_chunks
from meshd.store.sparse import SparseFile

SMALL_CHUNK = 4 << 10
RANGES = [(0, 2), (2, 5), (5, 6)]
TOKENS = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111]


def sparse_copy(source: Path, manifest: Manifest, layers: tuple[int, int], n_layers: int, out: Path) -> SparseFile:
    data = source.read_bytes()
    sparse = SparseFile.open(out, manifest)
    for chunk in range_chunks(manifest, n_layers, *layers):
        sparse.write(chunk, data[chunk.offset : chunk.end])
    sparse.flush()
    return sparse


def logits(stages: list[tuple[Path, tuple[int, int] | None]]) -> np.ndarray:
    models = [Model(path, r) for path, r in stages]
    contexts = [Context(m, n_ctx=64, n_threads=1) for m in models]
    try:
        seq = np.zeros(len(TOKENS), dtype=np.int32)
        pos = np.arange(len(TOKENS), dtype=np.int32)
        out = contexts[0].forward(seq, pos, tokens=TOKENS, want_output=np.ones(len(TOKENS), bool) if len(models) == 1 else None)
        for i, ctx in enumerate(contexts[1:], 1):
            out = ctx.forward(seq, pos, hidden=out, want_output=np.ones(len(TOKENS), bool) if i == len(models) - 1 else None)
        return out.copy()
    finally:
        for c in contexts:
            c.close()
        for m in models:
            m.close()


@pytest.mark.parametrize("name", ["llama-gqa-tied", "llama-gqa-untied", "qwen2-bias", "qwen3-qknorm"])
def test_a_range_loads_from_a_sparse_file_of_its_own_tensors(tiny_models: dict[str, Path], tmp_path: Path, name: str) -> None:
    source = tiny_models[name]
    manifest = compute(source, SMALL_CHUNK)
    n_layers = 6
    stages: list[tuple[Path, tuple[int, int] | None]] = []
    for layers in RANGES:
        owned = owned_tensors(manifest.tensor_names, n_layers, *layers)
        out = tmp_path / f"{layers[0]}-{layers[1]}.gguf"
        sparse = sparse_copy(source, manifest, layers, n_layers, out)
        with Model(out, layers) as m:
            assert m.report.n_tensors == len(owned), f"{name} {layers}: the loader reads other tensors than {owned}"
            assert m.report.n_bytes == sum(manifest.tensor(t).size for t in owned)
        # Only the header and the owned tensors take disk blocks (4 KiB blocks round each region up).
        needed = manifest.header_size + sum(manifest.tensor(t).size for t in owned)
        regions = 1 + len(owned)
        assert needed <= sparse.allocated_bytes() <= needed + regions * 8192
        sparse.close()
        stages.append((out, layers))
    assert_same_logits(logits([(source, None)]), logits(stages), f"{name} split over sparse files")


def test_the_tied_head_goes_to_the_tail_and_an_untied_one_does_not_need_the_embeddings() -> None:
    blocks = [f"blk.{i}.attn_q.weight" for i in range(4)]
    tied = ["token_embd.weight", *blocks, "output_norm.weight"]
    untied = [*tied, "output.weight"]
    assert owned_tensors(tied, 4, 2, 4) == ["token_embd.weight", "blk.2.attn_q.weight", "blk.3.attn_q.weight",
                                            "output_norm.weight"]
    assert owned_tensors(untied, 4, 2, 4) == ["blk.2.attn_q.weight", "blk.3.attn_q.weight", "output_norm.weight",
                                              "output.weight"]
    assert owned_tensors(untied, 4, 0, 1) == ["token_embd.weight", "blk.0.attn_q.weight"]
    assert owned_tensors(untied, 4, 1, 3) == ["blk.1.attn_q.weight", "blk.2.attn_q.weight"]
    # A tensor of no known family (rope_freqs) goes to every range, rather than a load that lacks it.
    assert "rope_freqs.weight" in owned_tensors(["rope_freqs.weight", *blocks], 4, 1, 2)
    with pytest.raises(RangeError, match="not a range"):
        owned_tensors(tied, 4, 3, 5)
