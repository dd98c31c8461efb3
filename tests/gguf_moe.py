"""Tiny random-weight GGUFs of the mixture-of-experts families (and GLM-4), written with `gguf`.

Each model carries what makes its architecture tricky to split: routed experts
(qwen3moe, Mixtral-style llama), shared experts (qwen2moe's gated one,
deepseek2's and glm4moe's plain ones), DeepSeek's multi-head latent attention
with a q LoRA, dense-lead layers and sigmoid gating with a selection bias,
gpt-oss's sliding-window pattern, attention sinks and biased experts, and the
nextn (MTP) block appended after the trunk (deepseek2, glm4moe, glm4). The
vocabulary and the weight/norm/bias draws are gguf_factory's, so these load
like the dense tiny models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf_factory import _bias, _norm, _weight, add_byte_level_vocab, byte_level_vocab


@dataclass(frozen=True)
class MoeSpec:
    """Shape and flavour of one tiny model; n_layer counts the trunk, the nextn blocks come after it."""

    arch: str
    seed: int
    n_layer: int = 6
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 96  # dense FFN width (dense-lead layers, glm4)
    n_expert: int = 4
    n_expert_used: int = 2
    n_ff_exp: int = 32
    n_ff_shexp: int = 0  # 0: no shared expert
    n_dense_lead: int = 0
    n_nextn: int = 0
    n_swa: int = 0  # gpt-oss: window of its sliding layers (every other one)
    rope_sections: tuple[int, ...] = ()  # glm4/glm4moe: M-RoPE, as the vision variants have it
    tied: bool = False
    weight_dtype: type[np.floating] = np.float16
    n_ctx: int = 256


# deepseek2's latent attention: q through a rank-32 LoRA, k/v through a rank-16 latent
Q_LORA_RANK = 32
KV_LORA_RANK = 16
QK_ROPE_DIM = 8
QK_NOPE_DIM = 16
V_HEAD_DIM = 16
# llama4: every second layer is MoE
LLAMA4_MOE_STEP = 2

MOE_SPECS: dict[str, MoeSpec] = {
    "qwen3moe": MoeSpec("qwen3moe", seed=27, head_dim=32),
    "qwen2moe-shexp": MoeSpec("qwen2moe", seed=12, n_ff_shexp=48, tied=False),
    # llama sizes its experts by feed_forward_length
    "mixtral": MoeSpec("llama", seed=27, n_ff=32, tied=True, weight_dtype=np.float32),
    "deepseek2-mla": MoeSpec("deepseek2", seed=14, n_head_kv=1, n_ff_shexp=32, n_dense_lead=2, n_nextn=1),
    "gpt-oss": MoeSpec("gpt-oss", seed=15, n_swa=8),
    "glm4moe": MoeSpec("glm4moe", seed=20, n_ff_shexp=32, n_dense_lead=1, n_nextn=1, tied=True),
    "glm4": MoeSpec("glm4", seed=21, n_expert=0, n_expert_used=0, n_nextn=1),
    # MoE on every second layer (1, 3, 5), one routed expert beside the shared one; layer 3 has no RoPE
    "llama4": MoeSpec("llama4", seed=19, n_expert_used=1, n_ff_shexp=32),
}
# DeepSeek V1: a MoE sibling of deepseek2 whose graph has no range support, so partial loads are refused
UNSUPPORTED_MOE_SPEC = MoeSpec("deepseek", seed=18, n_ff_shexp=32, n_dense_lead=1)


Block = Callable[[gguf.GGUFWriter, np.random.Generator, str, int, MoeSpec], None]
ArchKv = Callable[[gguf.GGUFWriter, MoeSpec], None]


def write_moe_gguf(path: Path, spec: MoeSpec, kv: ArchKv | None = None, block: Block | None = None) -> Path:
    """Writes a model of `spec` to `path`; the same spec always gives the same bytes.

    `kv` and `block` stand in for the architecture's own writers (tests/gguf_dsa.py builds on deepseek2's)."""
    rng = np.random.default_rng(spec.seed)
    n_vocab = len(byte_level_vocab()[0])
    e = spec.n_embd

    w = gguf.GGUFWriter(path, spec.arch)
    w.add_name(f"tiny-{spec.arch}")
    w.add_context_length(spec.n_ctx)
    w.add_embedding_length(e)
    w.add_block_count(spec.n_layer + spec.n_nextn)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_vocab_size(n_vocab)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if spec.weight_dtype == np.float16 else gguf.LlamaFileType.ALL_F32)
    if spec.n_expert:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
        w.add_expert_feed_forward_length(spec.n_ff_exp)
    if spec.n_nextn:
        w.add_nextn_predict_layers(spec.n_nextn)
    (kv or ARCH_KV[spec.arch])(w, spec)

    add_byte_level_vocab(w)

    # small embeddings, as in gguf_factory: the layers, not the input token, decide the residual
    w.add_tensor("token_embd.weight", (0.1 * rng.standard_normal((n_vocab, e))).astype(np.float16))
    w.add_tensor("output_norm.weight", _norm(rng, e))
    if not spec.tied:
        w.add_tensor("output.weight", _weight(rng, n_vocab, e, np.float32))
    for i in range(spec.n_layer + spec.n_nextn):
        (block or ARCH_BLOCK[spec.arch])(w, rng, f"blk.{i}", i, spec)
        if i >= spec.n_layer:
            _add_nextn(w, rng, f"blk.{i}", spec)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _kv_qwen(w: gguf.GGUFWriter, spec: MoeSpec) -> None:
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    if spec.n_ff_shexp:
        w.add_expert_shared_feed_forward_length(spec.n_ff_shexp)


def _kv_deepseek(w: gguf.GGUFWriter, spec: MoeSpec) -> None:
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_leading_dense_block_count(spec.n_dense_lead)
    w.add_expert_shared_count(spec.n_ff_shexp // spec.n_ff_exp)


def _kv_deepseek2(w: gguf.GGUFWriter, spec: MoeSpec) -> None:
    # what convert_hf_to_gguf writes for MLA: the cached key is the latent plus the rope part,
    # the "_mla" lengths are the per-head sizes after decompression
    w.add_key_length(KV_LORA_RANK + QK_ROPE_DIM)
    w.add_value_length(KV_LORA_RANK)
    w.add_key_length_mla(QK_NOPE_DIM + QK_ROPE_DIM)
    w.add_value_length_mla(V_HEAD_DIM)
    w.add_rope_dimension_count(QK_ROPE_DIM)
    w.add_q_lora_rank(Q_LORA_RANK)
    w.add_kv_lora_rank(KV_LORA_RANK)
    w.add_leading_dense_block_count(spec.n_dense_lead)
    w.add_expert_shared_count(spec.n_ff_shexp // spec.n_ff_exp)
    w.add_expert_weights_scale(2.5)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _kv_gpt_oss(w: gguf.GGUFWriter, spec: MoeSpec) -> None:
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_sliding_window(spec.n_swa)


def _kv_glm4(w: gguf.GGUFWriter, spec: MoeSpec) -> None:
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    # GLM rotates half of each head
    w.add_rope_dimension_count(spec.head_dim // 2)
    if spec.rope_sections:
        w.add_rope_dimension_sections(list(spec.rope_sections))
    if spec.n_expert:
        w.add_leading_dense_block_count(spec.n_dense_lead)
        w.add_expert_shared_count(spec.n_ff_shexp // spec.n_ff_exp)
        w.add_expert_weights_scale(1.5)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _kv_llama4(w: gguf.GGUFWriter, spec: MoeSpec) -> None:
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_interleave_moe_layer_step(LLAMA4_MOE_STEP)


def _attn_qkvo(w: gguf.GGUFWriter, rng: np.random.Generator, blk: str, spec: MoeSpec,
               bias: bool = False, qk_norm: bool = False) -> None:
    e, d = spec.n_embd, spec.head_dim
    q_dim, kv_dim = spec.n_head * d, spec.n_head_kv * d
    w.add_tensor(f"{blk}.attn_norm.weight", _norm(rng, e))
    w.add_tensor(f"{blk}.attn_q.weight", _weight(rng, q_dim, e, spec.weight_dtype))
    w.add_tensor(f"{blk}.attn_k.weight", _weight(rng, kv_dim, e, spec.weight_dtype))
    w.add_tensor(f"{blk}.attn_v.weight", _weight(rng, kv_dim, e, spec.weight_dtype))
    if bias:
        w.add_tensor(f"{blk}.attn_q.bias", _bias(rng, q_dim))
        w.add_tensor(f"{blk}.attn_k.bias", _bias(rng, kv_dim))
        w.add_tensor(f"{blk}.attn_v.bias", _bias(rng, kv_dim))
    if qk_norm:
        w.add_tensor(f"{blk}.attn_q_norm.weight", _norm(rng, d))
        w.add_tensor(f"{blk}.attn_k_norm.weight", _norm(rng, d))
    w.add_tensor(f"{blk}.attn_output.weight", _weight(rng, e, q_dim, spec.weight_dtype))


def _experts(w: gguf.GGUFWriter, rng: np.random.Generator, blk: str, spec: MoeSpec) -> None:
    """Router and routed experts: ggml's {n_embd, n_ff_exp, n_expert} is numpy's (n_expert, n_ff_exp, n_embd)."""
    e, f, n = spec.n_embd, spec.n_ff_exp, spec.n_expert
    # an f32 router: with f16 a near-tie between two experts could hinge on rounding, which is fine
    # for parity but makes the routing less varied across tokens
    w.add_tensor(f"{blk}.ffn_gate_inp.weight", _weight(rng, n, e, np.float32))
    w.add_tensor(f"{blk}.ffn_gate_exps.weight", _stack(rng, n, f, e, spec.weight_dtype))
    w.add_tensor(f"{blk}.ffn_up_exps.weight", _stack(rng, n, f, e, spec.weight_dtype))
    w.add_tensor(f"{blk}.ffn_down_exps.weight", _stack(rng, n, e, f, spec.weight_dtype))


def _shared_expert(w: gguf.GGUFWriter, rng: np.random.Generator, blk: str, spec: MoeSpec) -> None:
    e, f = spec.n_embd, spec.n_ff_shexp
    w.add_tensor(f"{blk}.ffn_gate_shexp.weight", _weight(rng, f, e, spec.weight_dtype))
    w.add_tensor(f"{blk}.ffn_up_shexp.weight", _weight(rng, f, e, spec.weight_dtype))
    w.add_tensor(f"{blk}.ffn_down_shexp.weight", _weight(rng, e, f, spec.weight_dtype))


def _dense_ffn(w: gguf.GGUFWriter, rng: np.random.Generator, blk: str, spec: MoeSpec) -> None:
    e, f = spec.n_embd, spec.n_ff
    w.add_tensor(f"{blk}.ffn_gate.weight", _weight(rng, f, e, spec.weight_dtype))
    w.add_tensor(f"{blk}.ffn_up.weight", _weight(rng, f, e, spec.weight_dtype))
    w.add_tensor(f"{blk}.ffn_down.weight", _weight(rng, e, f, spec.weight_dtype))


def _stack(rng: np.random.Generator, n: int, n_out: int, n_in: int, dtype: type[np.floating]) -> np.ndarray:
    return np.stack([_weight(rng, n_out, n_in, dtype) for _ in range(n)])


def _block_classic(w: gguf.GGUFWriter, rng: np.random.Generator, blk: str, il: int, spec: MoeSpec) -> None:
    """Multi-head attention, then dense FFN (the dense lead) or experts: qwen2moe, qwen3moe, llama, deepseek."""
    _attn_qkvo(w, rng, blk, spec, bias=spec.arch == "qwen2moe", qk_norm=spec.arch == "qwen3moe")
    w.add_tensor(f"{blk}.ffn_norm.weight", _norm(rng, spec.n_embd))
    if il < spec.n_dense_lead:
        _dense_ffn(w, rng, blk, spec)
        return
    _experts(w, rng, blk, spec)
    if spec.arch == "qwen2moe":
        # qwen2moe gates its shared expert per token with a sigmoid of one projection
        w.add_tensor(f"{blk}.ffn_gate_inp_shexp.weight", _weight(rng, 1, spec.n_embd, np.float32)[0])
    if spec.n_ff_shexp:
        _shared_expert(w, rng, blk, spec)


def _block_deepseek2(w: gguf.GGUFWriter, rng: np.random.Generator, blk: str, il: int, spec: MoeSpec) -> None:
    e, h, dt = spec.n_embd, spec.n_head, spec.weight_dtype
    w.add_tensor(f"{blk}.attn_norm.weight", _norm(rng, e))
    w.add_tensor(f"{blk}.attn_q_a_norm.weight", _norm(rng, Q_LORA_RANK))
    w.add_tensor(f"{blk}.attn_kv_a_norm.weight", _norm(rng, KV_LORA_RANK))
    w.add_tensor(f"{blk}.attn_q_a.weight", _weight(rng, Q_LORA_RANK, e, dt))
    w.add_tensor(f"{blk}.attn_q_b.weight", _weight(rng, h * (QK_NOPE_DIM + QK_ROPE_DIM), Q_LORA_RANK, dt))
    w.add_tensor(f"{blk}.attn_kv_a_mqa.weight", _weight(rng, KV_LORA_RANK + QK_ROPE_DIM, e, dt))
    # the absorbed (split) form of wkv_b: k_b is {qk_nope, kv_lora, n_head}, v_b {kv_lora, v_dim, n_head}
    w.add_tensor(f"{blk}.attn_k_b.weight", _stack(rng, h, KV_LORA_RANK, QK_NOPE_DIM, dt))
    w.add_tensor(f"{blk}.attn_v_b.weight", _stack(rng, h, V_HEAD_DIM, KV_LORA_RANK, dt))
    w.add_tensor(f"{blk}.attn_output.weight", _weight(rng, e, h * V_HEAD_DIM, dt))
    w.add_tensor(f"{blk}.ffn_norm.weight", _norm(rng, e))
    if il < spec.n_dense_lead:
        _dense_ffn(w, rng, blk, spec)
        return
    _experts(w, rng, blk, spec)
    # DeepSeek V3's selection bias: shifts which experts win without weighting them
    w.add_tensor(f"{blk}.exp_probs_b.bias", _bias(rng, spec.n_expert))
    _shared_expert(w, rng, blk, spec)


def _block_gpt_oss(w: gguf.GGUFWriter, rng: np.random.Generator, blk: str, il: int, spec: MoeSpec) -> None:
    e, f, n = spec.n_embd, spec.n_ff_exp, spec.n_expert
    _attn_qkvo(w, rng, blk, spec, bias=True)
    w.add_tensor(f"{blk}.attn_output.bias", _bias(rng, e))
    w.add_tensor(f"{blk}.attn_sinks.weight", _bias(rng, spec.n_head))
    w.add_tensor(f"{blk}.post_attention_norm.weight", _norm(rng, e))
    _experts(w, rng, blk, spec)
    w.add_tensor(f"{blk}.ffn_gate_inp.bias", _bias(rng, n))
    w.add_tensor(f"{blk}.ffn_gate_exps.bias", _bias(rng, n * f).reshape(n, f))
    w.add_tensor(f"{blk}.ffn_up_exps.bias", _bias(rng, n * f).reshape(n, f))
    w.add_tensor(f"{blk}.ffn_down_exps.bias", _bias(rng, n * e).reshape(n, e))


def _block_glm4moe(w: gguf.GGUFWriter, rng: np.random.Generator, blk: str, il: int, spec: MoeSpec) -> None:
    _attn_qkvo(w, rng, blk, spec, bias=True, qk_norm=True)
    # GLM-4.5 has no ffn_norm: the post-attention norm is the FFN's input norm
    w.add_tensor(f"{blk}.post_attention_norm.weight", _norm(rng, spec.n_embd))
    if il < spec.n_dense_lead:
        _dense_ffn(w, rng, blk, spec)
        return
    _experts(w, rng, blk, spec)
    w.add_tensor(f"{blk}.exp_probs_b.bias", _bias(rng, spec.n_expert))
    _shared_expert(w, rng, blk, spec)


def _block_glm4(w: gguf.GGUFWriter, rng: np.random.Generator, blk: str, il: int, spec: MoeSpec) -> None:
    e, f = spec.n_embd, spec.n_ff
    _attn_qkvo(w, rng, blk, spec, bias=True)
    w.add_tensor(f"{blk}.post_attention_norm.weight", _norm(rng, e))
    w.add_tensor(f"{blk}.ffn_norm.weight", _norm(rng, e))
    # gate and up fused in one tensor, split by the SwiGLU
    w.add_tensor(f"{blk}.ffn_up.weight", _weight(rng, 2 * f, e, spec.weight_dtype))
    w.add_tensor(f"{blk}.ffn_down.weight", _weight(rng, e, f, spec.weight_dtype))
    w.add_tensor(f"{blk}.post_ffw_norm.weight", _norm(rng, e))


def _block_llama4(w: gguf.GGUFWriter, rng: np.random.Generator, blk: str, il: int, spec: MoeSpec) -> None:
    _attn_qkvo(w, rng, blk, spec)
    w.add_tensor(f"{blk}.ffn_norm.weight", _norm(rng, spec.n_embd))
    if (il + 1) % LLAMA4_MOE_STEP:
        _dense_ffn(w, rng, blk, spec)
        return
    _experts(w, rng, blk, spec)
    _shared_expert(w, rng, blk, spec)


def _add_nextn(w: gguf.GGUFWriter, rng: np.random.Generator, blk: str, spec: MoeSpec) -> None:
    """The MTP head's own tensors, beside the full decoder block it also has."""
    e = spec.n_embd
    w.add_tensor(f"{blk}.nextn.eh_proj.weight", _weight(rng, e, 2 * e, spec.weight_dtype))
    w.add_tensor(f"{blk}.nextn.enorm.weight", _norm(rng, e))
    w.add_tensor(f"{blk}.nextn.hnorm.weight", _norm(rng, e))
    w.add_tensor(f"{blk}.nextn.shared_head_norm.weight", _norm(rng, e))


ARCH_KV: dict[str, ArchKv] = {
    "qwen3moe": _kv_qwen,
    "qwen2moe": _kv_qwen,
    "llama": _kv_qwen,
    "deepseek": _kv_deepseek,
    "deepseek2": _kv_deepseek2,
    "gpt-oss": _kv_gpt_oss,
    "glm4moe": _kv_glm4,
    "glm4": _kv_glm4,
    "llama4": _kv_llama4,
}
ARCH_BLOCK: dict[str, Block] = {
    "qwen3moe": _block_classic,
    "qwen2moe": _block_classic,
    "llama": _block_classic,
    "deepseek": _block_classic,
    "deepseek2": _block_deepseek2,
    "gpt-oss": _block_gpt_oss,
    "glm4moe": _block_glm4moe,
    "glm4": _block_glm4,
    "llama4": _block_llama4,
}
