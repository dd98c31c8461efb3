"""Tiny random-weight GGUFs of the DeepSeek sparse attention (DSA) models, written with `gguf`.

deepseek32 (DeepSeek V3.2) and glm-dsa (GLM-5) are deepseek2's blocks (MLA with a
q LoRA, dense-lead layers, routed experts beside a shared one, sigmoid gating with
a selection bias, a nextn block after the trunk: gguf_moe's deepseek2 writers) plus
the lightning indexer: per layer a small multi-head scorer whose top-k picks the
cached positions the MLA attends to, with its own key cache. In glm-dsa only the
"full" indexer layers score; the "shared" ones reuse the top-k of the full layer
before them. Key names and shapes follow the pinned tree (src/models/deepseek32.cpp,
glm-dsa.cpp, src/llama-arch.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf_factory import _bias, _norm, _weight
from gguf_moe import Q_LORA_RANK, MoeSpec, _block_deepseek2, _kv_deepseek2, write_moe_gguf

INDEXER_HEADS = 2
# the indexer keys get a Hadamard rotation, whose sizes start at 64
INDEXER_HEAD_SIZE = 64
# fewer positions than most contexts here hold: the indexer's selection decides what each query attends
INDEXER_TOP_K = 8


@dataclass(frozen=True)
class DsaSpec:
    """A tiny DSA model: deepseek2's shapes, and which trunk layers score their own top-k (glm-dsa)."""

    moe: MoeSpec
    # glm-dsa: 1 for a full indexer layer, 0 for a shared one; deepseek32 indexes every layer
    indexer_types: tuple[int, ...] = ()
    indexer_top_k: int = INDEXER_TOP_K

    @property
    def arch(self) -> str:
        return self.moe.arch

    @property
    def n_layer(self) -> int:
        return self.moe.n_layer

    def indexes(self, il: int) -> bool:
        """Whether layer `il` carries an indexer; the nextn block's is deepseek32's alone (glm-dsa has none)."""
        if il >= self.n_layer:
            return not self.indexer_types
        return not self.indexer_types or bool(self.indexer_types[il])

    def allowed_cuts(self) -> list[int]:
        """Where a chain may be cut: everywhere for deepseek32, just before a full indexer layer for glm-dsa."""
        return [c for c in range(1, self.n_layer) if self.indexes(c)]


DSA_SPECS: dict[str, DsaSpec] = {
    # two dense-lead layers, one nextn block
    "deepseek32": DsaSpec(MoeSpec("deepseek32", seed=41, n_head_kv=1, n_ff_shexp=32, n_dense_lead=2, n_nextn=1)),
    # GLM-5.2's pattern, shortened: full indexers on 0-2, 5 and 7, so cuts at 1, 2, 5 and 7 only
    "glm-dsa": DsaSpec(MoeSpec("glm-dsa", seed=42, n_layer=8, n_head_kv=1, n_ff_shexp=32, n_dense_lead=2, n_nextn=1),
                       indexer_types=(1, 1, 1, 0, 0, 1, 0, 1)),
}


def write_dsa_gguf(path: Path, spec: DsaSpec) -> Path:
    """Writes a model of `spec` to `path`; the same spec always gives the same bytes."""

    def kv(w: gguf.GGUFWriter, moe: MoeSpec) -> None:
        _kv_deepseek2(w, moe)
        w.add_uint32(f"{moe.arch}.attention.indexer.head_count", INDEXER_HEADS)
        w.add_uint32(f"{moe.arch}.attention.indexer.key_length", INDEXER_HEAD_SIZE)
        w.add_uint32(f"{moe.arch}.attention.indexer.top_k", spec.indexer_top_k)
        if spec.indexer_types:
            w.add_array(f"{moe.arch}.attention.indexer.types", list(spec.indexer_types))

    def block(w: gguf.GGUFWriter, rng: np.random.Generator, blk: str, il: int, moe: MoeSpec) -> None:
        _block_deepseek2(w, rng, blk, il, moe)
        if spec.indexes(il):
            _indexer(w, rng, blk, moe)

    return write_moe_gguf(path, spec.moe, kv=kv, block=block)


def _indexer(w: gguf.GGUFWriter, rng: np.random.Generator, blk: str, moe: MoeSpec) -> None:
    """The lightning indexer: queries from the q LoRA, one key head from the normed input, per-head weights."""
    e, hs, dt = moe.n_embd, INDEXER_HEAD_SIZE, moe.weight_dtype
    w.add_tensor(f"{blk}.indexer.attn_q_b.weight", _weight(rng, INDEXER_HEADS * hs, Q_LORA_RANK, dt))
    w.add_tensor(f"{blk}.indexer.attn_k.weight", _weight(rng, hs, e, dt))
    w.add_tensor(f"{blk}.indexer.k_norm.weight", _norm(rng, hs))
    w.add_tensor(f"{blk}.indexer.k_norm.bias", _bias(rng, hs))
    w.add_tensor(f"{blk}.indexer.proj.weight", _weight(rng, INDEXER_HEADS, e, np.float32))
