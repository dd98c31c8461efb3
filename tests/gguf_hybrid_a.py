"""Tiny random-weight GGUFs of four hybrid architectures, for the layer-range parity tests.

- qwen35 (Qwen3.5, dense) and qwen35moe: gated delta-net layers with a full-attention layer
  every fourth (the converter's full_attention_interval), interleaved M-RoPE over a partial
  rotary part of each head as the real models have it, and one MTP (nextn) block past the
  trunk; qwen35moe's FFNs are routed experts plus a sigmoid-gated shared expert.
- kimi-linear (Kimi Linear): KDA (Kimi delta attention) layers with an MLA layer at every
  fourth and at the last one, MLA in its absorbed form (k_b/v_b) with one latent KV head, a
  dense lead layer, then routed experts with a shared expert and a selection bias.
- lfm2 (LFM2): short-convolution layers and GQA attention layers with q/k norms, a tied
  head, the output norm under LFM2's own name (token_embd_norm); optionally a sliding window
  on its attention layers, which takes the hybrid-iswa memory. lfm2moe (LFM2-MoE) runs the same
  graph with two dense lead layers, then routed experts.

Shapes follow what llama.cpp's converters write (conversion/*.py in the pinned tree).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
from gguf_factory import _bias, _norm, _weight, add_byte_level_vocab
from gguf_moe import (
    KV_LORA_RANK,
    QK_NOPE_DIM,
    QK_ROPE_DIM,
    V_HEAD_DIM,
    MoeSpec,
    _dense_ffn,
    _experts,
    _shared_expert,
    _stack,
)

# the shapes every model here shares (n_embd, heads, expert sizes), as gguf_moe's writers read them
SHAPE = MoeSpec("hybrid", seed=0, n_ff=96, n_expert=4, n_expert_used=2, n_ff_exp=32, n_ff_shexp=32)
F16 = np.float16

# Qwen3.5: a full-attention layer every fourth; the delta net's key and value heads
QWEN35_INTERVAL = 4
QWEN35_HEAD_DIM = 16
QWEN35_N_ROT = 8  # partial rotary, as the real models rotate 64 of 256
QWEN35_SECTIONS = [2, 1, 1, 0]  # interleaved M-RoPE sections over n_rot / 2 pairs
DELTA_HEAD, DELTA_K_HEADS, DELTA_V_HEADS, DELTA_CONV = 16, 2, 4, 4

# Kimi Linear: MLA at every fourth layer and the last, KDA elsewhere
KIMI_MLA_STEP = 4
KIMI_N_LAYER = 7
KDA_HEAD_DIM = 16
KDA_CONV = 4

# LFM2: which layers attend (the rest are short convolutions), the convolution's cache length
LFM2_ATTENTION = (2, 5, 6)
LFM2_L_CACHE = 3
LFM2MOE_DENSE_LEAD = 2


def _begin(path: Path, arch: str, n_layer: int, seed: int) -> tuple[gguf.GGUFWriter, np.random.Generator, int]:
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(256)
    w.add_embedding_length(SHAPE.n_embd)
    w.add_block_count(n_layer)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    return w, np.random.default_rng(seed), add_byte_level_vocab(w)


def _finish(w: gguf.GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def qwen35_is_attention(il: int) -> bool:
    return (il + 1) % QWEN35_INTERVAL == 0


def write_qwen35(path: Path, moe: bool, n_layer: int = 8, seed: int = 31) -> Path:
    """A Qwen3.5 (qwen35) or Qwen3.5-MoE (qwen35moe) of `n_layer` trunk layers and one MTP block."""
    arch = "qwen35moe" if moe else "qwen35"
    w, rng, n_vocab = _begin(path, arch, n_layer + 1, seed)
    e, h, h_kv, d = SHAPE.n_embd, SHAPE.n_head, SHAPE.n_head_kv, QWEN35_HEAD_DIM
    key_dim, value_dim = DELTA_HEAD * DELTA_K_HEADS, DELTA_HEAD * DELTA_V_HEADS
    conv_dim = 2 * key_dim + value_dim
    w.add_nextn_predict_layers(1)
    w.add_feed_forward_length(SHAPE.n_ff)
    w.add_head_count(h)
    w.add_head_count_kv(h_kv)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_dimension_count(QWEN35_N_ROT)
    w.add_rope_dimension_sections(QWEN35_SECTIONS)
    w.add_ssm_conv_kernel(DELTA_CONV)
    w.add_ssm_inner_size(value_dim)
    w.add_ssm_state_size(DELTA_HEAD)
    w.add_ssm_time_step_rank(DELTA_V_HEADS)
    w.add_ssm_group_count(DELTA_K_HEADS)
    w.add_full_attention_interval(QWEN35_INTERVAL)
    if moe:
        w.add_expert_count(SHAPE.n_expert)
        w.add_expert_used_count(SHAPE.n_expert_used)
        w.add_expert_feed_forward_length(SHAPE.n_ff_exp)
        w.add_expert_shared_feed_forward_length(SHAPE.n_ff_shexp)
    w.add_tensor("token_embd.weight", (0.1 * rng.standard_normal((n_vocab, e))).astype(F16))
    w.add_tensor("output_norm.weight", _norm(rng, e))
    w.add_tensor("output.weight", _weight(rng, n_vocab, e, np.float32))

    def attention(blk: str) -> None:
        w.add_tensor(f"{blk}.attn_q.weight", _weight(rng, 2 * h * d, e, F16))  # the query and its gate
        w.add_tensor(f"{blk}.attn_k.weight", _weight(rng, h_kv * d, e, F16))
        w.add_tensor(f"{blk}.attn_v.weight", _weight(rng, h_kv * d, e, F16))
        w.add_tensor(f"{blk}.attn_output.weight", _weight(rng, e, h * d, F16))
        w.add_tensor(f"{blk}.attn_q_norm.weight", _norm(rng, d))
        w.add_tensor(f"{blk}.attn_k_norm.weight", _norm(rng, d))

    def ffn(blk: str) -> None:
        if not moe:
            _dense_ffn(w, rng, blk, SHAPE)
            return
        _experts(w, rng, blk, SHAPE)
        w.add_tensor(f"{blk}.ffn_gate_inp_shexp.weight", _bias(rng, e).astype(F16))
        _shared_expert(w, rng, blk, SHAPE)

    for i in range(n_layer + 1):
        blk = f"blk.{i}"
        w.add_tensor(f"{blk}.attn_norm.weight", _norm(rng, e))
        w.add_tensor(f"{blk}.post_attention_norm.weight", _norm(rng, e))
        if i == n_layer:
            # the MTP block: a full-attention decoder block and its own projections
            attention(blk)
            ffn(blk)
            w.add_tensor(f"{blk}.nextn.eh_proj.weight", _weight(rng, e, 2 * e, F16))
            w.add_tensor(f"{blk}.nextn.enorm.weight", _norm(rng, e))
            w.add_tensor(f"{blk}.nextn.hnorm.weight", _norm(rng, e))
            w.add_tensor(f"{blk}.nextn.shared_head_norm.weight", _norm(rng, e))
            continue
        if qwen35_is_attention(i):
            attention(blk)
        else:
            w.add_tensor(f"{blk}.attn_qkv.weight", _weight(rng, conv_dim, e, F16))
            w.add_tensor(f"{blk}.attn_gate.weight", _weight(rng, value_dim, e, F16))
            w.add_tensor(f"{blk}.ssm_conv1d.weight", (0.5 * rng.standard_normal((conv_dim, DELTA_CONV))).astype(np.float32))
            w.add_tensor(f"{blk}.ssm_dt.bias", _bias(rng, DELTA_V_HEADS))
            w.add_tensor(f"{blk}.ssm_a", -np.exp(rng.uniform(0.0, 1.0, size=DELTA_V_HEADS)).astype(np.float32))
            w.add_tensor(f"{blk}.ssm_beta.weight", _weight(rng, DELTA_V_HEADS, e, F16))
            w.add_tensor(f"{blk}.ssm_alpha.weight", _weight(rng, DELTA_V_HEADS, e, F16))
            w.add_tensor(f"{blk}.ssm_norm.weight", _norm(rng, DELTA_HEAD))
            w.add_tensor(f"{blk}.ssm_out.weight", _weight(rng, e, value_dim, F16))
        ffn(blk)
    return _finish(w, path)


def kimi_is_attention(il: int, n_layer: int = KIMI_N_LAYER) -> bool:
    return (il + 1) % KIMI_MLA_STEP == 0 or il == n_layer - 1


def write_kimi_linear(path: Path, n_layer: int = KIMI_N_LAYER, seed: int = 32) -> Path:
    """A Kimi Linear: KDA layers, MLA at layers 3 and 6, layer 0 a dense lead, MoE after it."""
    w, rng, n_vocab = _begin(path, "kimi-linear", n_layer, seed)
    e, h = SHAPE.n_embd, SHAPE.n_head
    d_inner = h * KDA_HEAD_DIM
    spec = replace(SHAPE, n_ff_shexp=SHAPE.n_ff_exp)  # one shared expert of the routed experts' width
    w.add_feed_forward_length(SHAPE.n_ff)
    w.add_head_count(h)
    # what conversion/kimi_linear.py writes: one latent KV head on MLA layers, none on KDA layers
    w.add_head_count_kv([1 if kimi_is_attention(i, n_layer) else 0 for i in range(n_layer)])
    w.add_ssm_conv_kernel(KDA_CONV)
    w.add_kda_head_dim(KDA_HEAD_DIM)
    w.add_kv_lora_rank(KV_LORA_RANK)
    w.add_rope_dimension_count(QK_ROPE_DIM)
    w.add_key_length(KV_LORA_RANK + QK_ROPE_DIM)
    w.add_value_length(KV_LORA_RANK)
    w.add_key_length_mla(QK_NOPE_DIM + QK_ROPE_DIM)
    w.add_value_length_mla(V_HEAD_DIM)
    w.add_expert_count(SHAPE.n_expert)
    w.add_expert_used_count(SHAPE.n_expert_used)
    w.add_expert_feed_forward_length(SHAPE.n_ff_exp)
    w.add_expert_shared_count(1)
    w.add_leading_dense_block_count(1)
    w.add_expert_weights_scale(2.5)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_tensor("token_embd.weight", (0.1 * rng.standard_normal((n_vocab, e))).astype(F16))
    w.add_tensor("output_norm.weight", _norm(rng, e))
    w.add_tensor("output.weight", _weight(rng, n_vocab, e, np.float32))
    for i in range(n_layer):
        blk = f"blk.{i}"
        w.add_tensor(f"{blk}.attn_norm.weight", _norm(rng, e))
        if kimi_is_attention(i, n_layer):
            w.add_tensor(f"{blk}.attn_kv_a_norm.weight", _norm(rng, KV_LORA_RANK))
            w.add_tensor(f"{blk}.attn_q.weight", _weight(rng, h * (QK_NOPE_DIM + QK_ROPE_DIM), e, F16))
            w.add_tensor(f"{blk}.attn_kv_a_mqa.weight", _weight(rng, KV_LORA_RANK + QK_ROPE_DIM, e, F16))
            w.add_tensor(f"{blk}.attn_k_b.weight", _stack(rng, h, KV_LORA_RANK, QK_NOPE_DIM, F16))
            w.add_tensor(f"{blk}.attn_v_b.weight", _stack(rng, h, V_HEAD_DIM, KV_LORA_RANK, F16))
            w.add_tensor(f"{blk}.attn_output.weight", _weight(rng, e, h * V_HEAD_DIM, F16))
        else:
            for conv in ("ssm_conv1d_q", "ssm_conv1d_k", "ssm_conv1d_v"):
                # ggml {d_conv, 1, d_inner, 1}, as the converter reshapes it
                kernel = 0.5 * rng.standard_normal((1, d_inner, 1, KDA_CONV))
                w.add_tensor(f"{blk}.{conv}.weight", kernel.astype(np.float32))
            for proj in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"{blk}.{proj}.weight", _weight(rng, d_inner, e, F16))
            w.add_tensor(f"{blk}.ssm_f_a.weight", _weight(rng, KDA_HEAD_DIM, e, F16))
            w.add_tensor(f"{blk}.ssm_f_b.weight", _weight(rng, d_inner, KDA_HEAD_DIM, F16))
            w.add_tensor(f"{blk}.ssm_beta.weight", _weight(rng, h, e, F16))
            w.add_tensor(f"{blk}.ssm_a", -np.exp(rng.uniform(0.0, 1.0, size=(1, 1, h, 1))).astype(np.float32))
            w.add_tensor(f"{blk}.ssm_dt.bias", _bias(rng, d_inner))
            w.add_tensor(f"{blk}.ssm_g_a.weight", _weight(rng, KDA_HEAD_DIM, e, F16))
            w.add_tensor(f"{blk}.ssm_g_b.weight", _weight(rng, d_inner, KDA_HEAD_DIM, F16))
            w.add_tensor(f"{blk}.ssm_norm.weight", _norm(rng, KDA_HEAD_DIM))
            w.add_tensor(f"{blk}.attn_output.weight", _weight(rng, e, d_inner, F16))
        w.add_tensor(f"{blk}.ffn_norm.weight", _norm(rng, e))
        if i == 0:
            _dense_ffn(w, rng, blk, spec)
            continue
        _experts(w, rng, blk, spec)
        w.add_tensor(f"{blk}.exp_probs_b.bias", _bias(rng, spec.n_expert))
        _shared_expert(w, rng, blk, spec)
    return _finish(w, path)


def write_lfm2(path: Path, n_layer: int = 7, n_swa: int = 0, moe: bool = False, seed: int = 33) -> Path:
    """An LFM2: attention at LFM2_ATTENTION, short convolutions elsewhere, a tied head; with `n_swa`
    its attention layers slide over that many positions; with `moe` an LFM2-MoE (lfm2moe), whose
    layers after LFM2MOE_DENSE_LEAD dense ones route experts by sigmoid with a selection bias."""
    w, rng, n_vocab = _begin(path, "lfm2moe" if moe else "lfm2", n_layer, seed)
    e, h, h_kv = SHAPE.n_embd, SHAPE.n_head, SHAPE.n_head_kv
    d = e // h
    w.add_feed_forward_length(SHAPE.n_ff)
    w.add_head_count(h)
    w.add_head_count_kv([h_kv if i in LFM2_ATTENTION else 0 for i in range(n_layer)])
    w.add_shortconv_l_cache(LFM2_L_CACHE)
    if n_swa:
        w.add_sliding_window(n_swa)
    if moe:
        w.add_leading_dense_block_count(LFM2MOE_DENSE_LEAD)
        w.add_expert_count(SHAPE.n_expert)
        w.add_expert_used_count(SHAPE.n_expert_used)
        w.add_expert_feed_forward_length(SHAPE.n_ff_exp)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_tensor("token_embd.weight", (0.1 * rng.standard_normal((n_vocab, e))).astype(F16))
    # LFM2's final norm, under the name its converter gives it
    w.add_tensor("token_embd_norm.weight", _norm(rng, e))
    for i in range(n_layer):
        blk = f"blk.{i}"
        w.add_tensor(f"{blk}.attn_norm.weight", _norm(rng, e))
        if i in LFM2_ATTENTION:
            w.add_tensor(f"{blk}.attn_q.weight", _weight(rng, h * d, e, F16))
            w.add_tensor(f"{blk}.attn_k.weight", _weight(rng, h_kv * d, e, F16))
            w.add_tensor(f"{blk}.attn_v.weight", _weight(rng, h_kv * d, e, F16))
            w.add_tensor(f"{blk}.attn_output.weight", _weight(rng, e, h * d, F16))
            w.add_tensor(f"{blk}.attn_q_norm.weight", _norm(rng, d))
            w.add_tensor(f"{blk}.attn_k_norm.weight", _norm(rng, d))
        else:
            # ggml {l_cache, n_embd}: each channel's causal kernel
            w.add_tensor(f"{blk}.shortconv.conv.weight", (0.5 * rng.standard_normal((e, LFM2_L_CACHE))).astype(np.float32))
            w.add_tensor(f"{blk}.shortconv.in_proj.weight", _weight(rng, 3 * e, e, F16))
            w.add_tensor(f"{blk}.shortconv.out_proj.weight", _weight(rng, e, e, F16))
        w.add_tensor(f"{blk}.ffn_norm.weight", _norm(rng, e))
        if moe and i >= LFM2MOE_DENSE_LEAD:
            _experts(w, rng, blk, SHAPE)
            w.add_tensor(f"{blk}.exp_probs_b.bias", _bias(rng, SHAPE.n_expert))
        else:
            _dense_ffn(w, rng, blk, SHAPE)
    return _finish(w, path)
