"""A tiny random-weight DeepSeek V4 (`deepseek4`) GGUF, written with `gguf`.

It carries what makes the architecture tricky to split: hc_mult hyper-connection
streams between the layers (a stage boundary is hc_mult x n_embd floats per token,
mixed only by the tail's output_hc_*), the first hash_layer_count layers routing
their experts by token id (ffn_gate_tid2eid), a shared expert, the q LoRA, grouped
low-rank output, attention sinks, the sliding window, and both compressed attentions
(ratio 4 with its indexer, ratio 128). Key names and shapes follow the pinned tree's
src/models/deepseek4.cpp and tests/test-llama-archs.cpp. The vocabulary and weight
draws are gguf_factory's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf_factory import _norm, _weight, add_byte_level_vocab, byte_level_vocab

ARCH = "deepseek4"
# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS, the only scoring deepseek4 loads
SQRT_SOFTPLUS = 4


@dataclass(frozen=True)
class Dsv4Spec:
    seed: int = 41
    n_layer: int = 6
    n_embd: int = 128
    n_head: int = 2
    head_dim: int = 64
    q_lora_rank: int = 32
    o_groups: int = 2
    o_lora_rank: int = 16
    hc_mult: int = 4
    n_hash_layers: int = 3
    n_expert: int = 4
    n_expert_used: int = 2
    n_ff_exp: int = 32
    n_swa: int = 8
    indexer_heads: int = 2
    indexer_dim: int = 64
    # per layer: 0 plain, 4 compressed with the indexer, 128 heavily compressed
    compress_ratios: tuple[int, ...] = (0, 4, 0, 128, 4, 0)
    n_ctx: int = 256


DSV4_SPEC = Dsv4Spec()


def stage_width(spec: Dsv4Spec) -> int:
    """Floats per token row between two stages: the hyper-connection streams, unmixed."""
    return spec.hc_mult * spec.n_embd


def write_dsv4_gguf(path: Path, spec: Dsv4Spec = DSV4_SPEC) -> Path:
    """Writes the model of `spec` to `path`; the same spec always gives the same bytes."""
    assert len(spec.compress_ratios) == spec.n_layer
    rng = np.random.default_rng(spec.seed)
    n_vocab = len(byte_level_vocab()[0])
    e, hd = spec.n_embd, spec.head_dim

    w = gguf.GGUFWriter(path, ARCH)
    w.add_name("tiny-deepseek4")
    w.add_context_length(spec.n_ctx)
    w.add_embedding_length(e)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff_exp)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(1)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd // 2)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(n_vocab)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_q_lora_rank(spec.q_lora_rank)
    w.add_sliding_window(spec.n_swa)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)
    w.add_expert_feed_forward_length(spec.n_ff_exp)
    w.add_expert_shared_count(1)
    w.add_expert_weights_scale(1.5)
    w.add_expert_weights_norm(True)
    w.add_uint32(f"{ARCH}.expert_gating_func", SQRT_SOFTPLUS)
    w.add_float32(f"{ARCH}.swiglu_clamp_exp", 10.0)
    w.add_uint32(f"{ARCH}.attention.indexer.head_count", spec.indexer_heads)
    w.add_uint32(f"{ARCH}.attention.indexer.key_length", spec.indexer_dim)
    # a top-k beyond every context keeps every compressed block: selection ties cannot flip a result
    w.add_uint32(f"{ARCH}.attention.indexer.top_k", 131072)
    w.add_uint32(f"{ARCH}.attention.output_group_count", spec.o_groups)
    w.add_uint32(f"{ARCH}.attention.output_lora_rank", spec.o_lora_rank)
    w.add_float32(f"{ARCH}.attention.compress_rope_freq_base", 160000.0)
    w.add_array(f"{ARCH}.attention.compress_ratios", list(spec.compress_ratios))
    w.add_uint32(f"{ARCH}.hyper_connection.count", spec.hc_mult)
    w.add_uint32(f"{ARCH}.hyper_connection.sinkhorn_iterations", 2)
    w.add_float32(f"{ARCH}.hyper_connection.epsilon", 1e-6)
    w.add_uint32(f"{ARCH}.hash_layer_count", spec.n_hash_layers)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    add_byte_level_vocab(w)

    f32 = np.float32
    hc, hc_dim = spec.hc_mult, spec.hc_mult * e
    w.add_tensor("token_embd.weight", (0.1 * rng.standard_normal((n_vocab, e))).astype(f32))
    w.add_tensor("output_norm.weight", _norm(rng, e))
    w.add_tensor("output.weight", _weight(rng, n_vocab, e, f32))
    w.add_tensor("output_hc_fn.weight", _weight(rng, hc, hc_dim, f32))
    w.add_tensor("output_hc_base.weight", _small(rng, hc))
    w.add_tensor("output_hc_scale.weight", _small(rng, 1))
    for i in range(spec.n_layer):
        _add_block(w, rng, i, spec, n_vocab)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _small(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (0.1 * rng.standard_normal(shape)).astype(np.float32)


def _add_block(w: gguf.GGUFWriter, rng: np.random.Generator, i: int, spec: Dsv4Spec, n_vocab: int) -> None:
    f32 = np.float32
    e, hd, q = spec.n_embd, spec.head_dim, spec.q_lora_rank
    hc_dim, hc_mix = spec.hc_mult * e, (2 + spec.hc_mult) * spec.hc_mult
    blk = f"blk.{i}"
    w.add_tensor(f"{blk}.attn_norm.weight", _norm(rng, e))
    w.add_tensor(f"{blk}.attn_sinks.weight", _small(rng, spec.n_head))
    w.add_tensor(f"{blk}.attn_q_a.weight", _weight(rng, q, e, f32))
    w.add_tensor(f"{blk}.attn_q_a_norm.weight", _norm(rng, q))
    w.add_tensor(f"{blk}.attn_q_b.weight", _weight(rng, spec.n_head * hd, q, f32))
    w.add_tensor(f"{blk}.attn_kv.weight", _weight(rng, hd, e, f32))
    w.add_tensor(f"{blk}.attn_kv_a_norm.weight", _norm(rng, hd))
    # the file holds wo_a as (o_lora_rank * o_groups) rows of n_head*head_dim/o_groups; the loader reshapes it
    w.add_tensor(f"{blk}.attn_output_a.weight",
                 _weight(rng, spec.o_lora_rank * spec.o_groups, spec.n_head * hd // spec.o_groups, f32))
    w.add_tensor(f"{blk}.attn_output_b.weight", _weight(rng, e, spec.o_groups * spec.o_lora_rank, f32))
    for part in ("attn", "ffn"):
        w.add_tensor(f"{blk}.hc_{part}_fn.weight", _weight(rng, hc_mix, hc_dim, f32))
        w.add_tensor(f"{blk}.hc_{part}_base.weight", _small(rng, hc_mix))
        w.add_tensor(f"{blk}.hc_{part}_scale.weight", _small(rng, 3))

    ratio = spec.compress_ratios[i]
    if ratio:
        coff = 2 if ratio == 4 else 1
        w.add_tensor(f"{blk}.attn_compressor_kv.weight", _weight(rng, coff * hd, e, f32))
        w.add_tensor(f"{blk}.attn_compressor_gate.weight", _weight(rng, coff * hd, e, f32))
        w.add_tensor(f"{blk}.attn_compressor_ape.weight", _small(rng, ratio, coff * hd))
        w.add_tensor(f"{blk}.attn_compressor_norm.weight", _norm(rng, hd))
    if ratio == 4:
        ih, idim = spec.indexer_heads, spec.indexer_dim
        w.add_tensor(f"{blk}.indexer.proj.weight", _weight(rng, ih, e, f32))
        w.add_tensor(f"{blk}.indexer.attn_q_b.weight", _weight(rng, ih * idim, q, f32))
        w.add_tensor(f"{blk}.indexer_compressor_kv.weight", _weight(rng, 2 * idim, e, f32))
        w.add_tensor(f"{blk}.indexer_compressor_gate.weight", _weight(rng, 2 * idim, e, f32))
        w.add_tensor(f"{blk}.indexer_compressor_ape.weight", _small(rng, 4, 2 * idim))
        w.add_tensor(f"{blk}.indexer_compressor_norm.weight", _norm(rng, idim))

    n_exp, n_ff = spec.n_expert, spec.n_ff_exp
    w.add_tensor(f"{blk}.ffn_gate_inp.weight", _weight(rng, n_exp, e, f32))
    if i < spec.n_hash_layers:
        # each token id picks its own distinct experts: a stage without the ids would route differently
        table = np.stack([rng.permutation(n_exp)[:spec.n_expert_used] for _ in range(n_vocab)]).astype(np.int32)
        w.add_tensor(f"{blk}.ffn_gate_tid2eid.weight", table)
    else:
        w.add_tensor(f"{blk}.exp_probs_b.bias", _small(rng, n_exp))
    w.add_tensor(f"{blk}.ffn_norm.weight", _norm(rng, e))
    w.add_tensor(f"{blk}.ffn_gate_exps.weight", np.stack([_weight(rng, n_ff, e, f32) for _ in range(n_exp)]))
    w.add_tensor(f"{blk}.ffn_down_exps.weight", np.stack([_weight(rng, e, n_ff, f32) for _ in range(n_exp)]))
    w.add_tensor(f"{blk}.ffn_up_exps.weight", np.stack([_weight(rng, n_ff, e, f32) for _ in range(n_exp)]))
    w.add_tensor(f"{blk}.ffn_gate_shexp.weight", _weight(rng, n_ff, e, f32))
    w.add_tensor(f"{blk}.ffn_down_shexp.weight", _weight(rng, e, n_ff, f32))
    w.add_tensor(f"{blk}.ffn_up_shexp.weight", _weight(rng, n_ff, e, f32))
