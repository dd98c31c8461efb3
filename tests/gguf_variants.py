"""Tiny GGUFs that take the loader's other paths, made from tools/gguf_factory.py's models.

Each variant rewrites a tiny model's tensors (the metadata is copied as it is):
per-tensor `.scale` tensors as NVFP4/FP8 quantisers write them, a fused `attn_qkv`
with its bias, and layers of different sizes. `write_dense_lead_moe` writes the
header and tensors of a DeepSeek-style model (dense lead layers, then routed and
shared experts) for what reads a file's sizes without loading it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np
from gguf_factory import (
    GGUFReader,
    TinySpec,
    _bias,
    _norm,
    _weight,
    add_byte_level_vocab,
    byte_level_vocab,
    write_tiny_gguf,
)

Tensors = Iterator[tuple[str, np.ndarray]]
# (name, array) of one tensor of the source -> the tensors the variant writes in its place
Transform = Callable[[str, np.ndarray], Tensors]

# the projections whose per-tensor scales llama.cpp's generic pass loads
SCALED = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def rewrite_gguf(src: Path, dst: Path, transform: Transform) -> Path:
    """`src` with its metadata as it is and each tensor replaced by what `transform` makes of it."""
    reader = GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        for name, array in transform(tensor.name, np.array(tensor.data)):
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def with_scales(src: Path, dst: Path, seed: int = 11) -> Path:
    """Every projection of every layer followed by its per-tensor `.scale` (shape {1}, f32, not 1)."""
    rng = np.random.default_rng(seed)

    def transform(name: str, array: np.ndarray) -> Tensors:
        yield name, array
        parts = name.split(".")
        if parts[0] == "blk" and parts[2] in SCALED and parts[3] == "weight":
            yield f"blk.{parts[1]}.{parts[2]}.scale", rng.uniform(0.5, 1.5, size=1).astype(np.float32)

    return rewrite_gguf(src, dst, transform)


def with_fused_qkv(src: Path, dst: Path, seed: int = 12) -> Path:
    """attn_q, attn_k and attn_v of every layer as one attn_qkv.weight with an attn_qkv.bias."""
    rng = np.random.default_rng(seed)
    held: dict[str, np.ndarray] = {}

    def transform(name: str, array: np.ndarray) -> Tensors:
        parts = name.split(".")
        if parts[0] != "blk" or parts[2] not in ("attn_q", "attn_k", "attn_v"):
            yield name, array
            return
        held[parts[2]] = array
        if len(held) == 3:
            qkv = np.concatenate([held.pop("attn_q"), held.pop("attn_k"), held.pop("attn_v")], axis=0)
            yield f"blk.{parts[1]}.attn_qkv.weight", qkv
            yield f"blk.{parts[1]}.attn_qkv.bias", _bias(rng, qkv.shape[0])

    return rewrite_gguf(src, dst, transform)


def with_uneven_layers(src: Path, dst: Path, seed: int = 13) -> Path:
    """Layers of different sizes that llama still loads: odd layers' projections widened to f32, even
    layers given the optional output and FFN biases."""
    rng = np.random.default_rng(seed)

    def transform(name: str, array: np.ndarray) -> Tensors:
        parts = name.split(".")
        if parts[0] != "blk":
            yield name, array
            return
        layer = int(parts[1])
        yield name, array.astype(np.float32) if layer % 2 and array.ndim == 2 else array
        if layer % 2 == 0 and parts[2] == "attn_output":
            yield f"blk.{layer}.attn_output.bias", _bias(rng, array.shape[0])
        if layer % 2 == 0 and parts[2] == "ffn_down":
            yield f"blk.{layer}.ffn_down.bias", _bias(rng, array.shape[0])

    return rewrite_gguf(src, dst, transform)


def write_variant(tmp: Path, spec: TinySpec, variant: Callable[[Path, Path], Path]) -> Path:
    base = write_tiny_gguf(tmp / f"{spec.arch}-{spec.seed}-base.gguf", spec)
    return variant(base, tmp / f"{spec.arch}-{spec.seed}-{variant.__name__}.gguf")


def write_dense_lead_moe(path: Path, n_layer: int = 6, n_dense: int = 2, n_expert: int = 8,
                         n_embd: int = 64, n_ff: int = 128, n_ff_exp: int = 32, seed: int = 14) -> Path:
    """A DeepSeek-style file: `n_dense` dense lead layers, then layers of `n_expert` routed experts
    and one shared expert, and a nextn (MTP) block past the last layer."""
    rng = np.random.default_rng(seed)
    n_vocab = len(byte_level_vocab()[0])
    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_name("tiny-dense-lead-moe")
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer + 1)
    w.add_uint32("deepseek2.nextn_predict_layers", 1)
    w.add_feed_forward_length(n_ff)
    w.add_expert_feed_forward_length(n_ff_exp)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_leading_dense_block_count(n_dense)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(2)
    w.add_expert_shared_count(1)
    w.add_layer_norm_rms_eps(1e-5)
    add_byte_level_vocab(w)
    w.add_tensor("token_embd.weight", _weight(rng, n_vocab, n_embd, np.float16))
    w.add_tensor("output_norm.weight", _norm(rng, n_embd))
    w.add_tensor("output.weight", _weight(rng, n_vocab, n_embd, np.float16))
    for i in range(n_layer + 1):
        blk = f"blk.{i}"
        w.add_tensor(f"{blk}.attn_norm.weight", _norm(rng, n_embd))
        for proj in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"{blk}.{proj}.weight", _weight(rng, n_embd, n_embd, np.float16))
        w.add_tensor(f"{blk}.ffn_norm.weight", _norm(rng, n_embd))
        if i < n_dense:
            w.add_tensor(f"{blk}.ffn_gate.weight", _weight(rng, n_ff, n_embd, np.float16))
            w.add_tensor(f"{blk}.ffn_up.weight", _weight(rng, n_ff, n_embd, np.float16))
            w.add_tensor(f"{blk}.ffn_down.weight", _weight(rng, n_embd, n_ff, np.float16))
            continue
        w.add_tensor(f"{blk}.ffn_gate_inp.weight", _weight(rng, n_expert, n_embd, np.float32))
        experts = (0.1 * rng.standard_normal((n_expert, n_ff_exp, n_embd))).astype(np.float16)
        w.add_tensor(f"{blk}.ffn_gate_exps.weight", experts)
        w.add_tensor(f"{blk}.ffn_up_exps.weight", experts.copy())
        w.add_tensor(f"{blk}.ffn_down_exps.weight", np.ascontiguousarray(experts.transpose(0, 2, 1)))
        w.add_tensor(f"{blk}.ffn_gate_shexp.weight", _weight(rng, n_ff_exp, n_embd, np.float16))
        w.add_tensor(f"{blk}.ffn_up_shexp.weight", _weight(rng, n_ff_exp, n_embd, np.float16))
        w.add_tensor(f"{blk}.ffn_down_shexp.weight", _weight(rng, n_embd, n_ff_exp, np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path




def write_mamba2(path: Path, n_layer: int = 6, n_embd: int = 64, d_state: int = 16, n_head: int = 8,
                 n_group: int = 1, d_conv: int = 4, tied: bool = False, seed: int = 15) -> Path:
    """A Mamba-2 as llama.cpp's converter writes one: d_inner = 2 * n_embd, A = -exp(A_log), an
    untied head in f32 while the projections are f16."""
    rng = np.random.default_rng(seed)
    n_vocab = len(byte_level_vocab()[0])
    d_inner = 2 * n_embd
    conv_dim = d_inner + 2 * n_group * d_state
    d_in_proj = d_inner + conv_dim + n_head
    w = gguf.GGUFWriter(path, "mamba2")
    w.add_name("tiny-mamba2")
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(n_head)
    w.add_ssm_group_count(n_group)
    w.add_layer_norm_rms_eps(1e-5)
    add_byte_level_vocab(w)
    w.add_tensor("token_embd.weight", (0.1 * rng.standard_normal((n_vocab, n_embd))).astype(np.float16))
    w.add_tensor("output_norm.weight", _norm(rng, n_embd))
    if not tied:
        w.add_tensor("output.weight", _weight(rng, n_vocab, n_embd, np.float32))
    for i in range(n_layer):
        blk = f"blk.{i}"
        w.add_tensor(f"{blk}.attn_norm.weight", _norm(rng, n_embd))
        w.add_tensor(f"{blk}.ssm_in.weight", _weight(rng, d_in_proj, n_embd, np.float16))
        w.add_tensor(f"{blk}.ssm_conv1d.weight", (0.5 * rng.standard_normal((conv_dim, d_conv))).astype(np.float32))
        w.add_tensor(f"{blk}.ssm_conv1d.bias", _bias(rng, conv_dim))
        # softplus(dt + bias) between about 0.001 and 0.1, as Mamba-2 initialises it
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), size=n_head))
        w.add_tensor(f"{blk}.ssm_dt.bias", np.log(np.expm1(dt)).astype(np.float32))
        w.add_tensor(f"{blk}.ssm_a", -np.exp(rng.uniform(0.0, 2.0, size=(n_head, 1))).astype(np.float32))
        w.add_tensor(f"{blk}.ssm_d", (1.0 + 0.1 * rng.standard_normal((n_head, 1))).astype(np.float32))
        w.add_tensor(f"{blk}.ssm_norm.weight", _norm(rng, d_inner).reshape(n_group, d_inner // n_group))
        w.add_tensor(f"{blk}.ssm_out.weight", _weight(rng, n_embd, d_inner, np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_mamba(path: Path, n_layer: int = 6, n_embd: int = 64, d_state: int = 16, dt_rank: int = 4,
                d_conv: int = 4, tied: bool = False, seed: int = 16) -> Path:
    """A Mamba (v1) as llama.cpp's converter writes one: d_inner = 2 * n_embd, A = -exp(A_log)."""
    rng = np.random.default_rng(seed)
    n_vocab = len(byte_level_vocab()[0])
    d_inner = 2 * n_embd
    w = gguf.GGUFWriter(path, "mamba")
    w.add_name("tiny-mamba")
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_layer_norm_rms_eps(1e-5)
    add_byte_level_vocab(w)
    w.add_tensor("token_embd.weight", (0.1 * rng.standard_normal((n_vocab, n_embd))).astype(np.float16))
    w.add_tensor("output_norm.weight", _norm(rng, n_embd))
    if not tied:
        w.add_tensor("output.weight", _weight(rng, n_vocab, n_embd, np.float32))
    for i in range(n_layer):
        blk = f"blk.{i}"
        w.add_tensor(f"{blk}.attn_norm.weight", _norm(rng, n_embd))
        w.add_tensor(f"{blk}.ssm_in.weight", _weight(rng, 2 * d_inner, n_embd, np.float16))
        w.add_tensor(f"{blk}.ssm_conv1d.weight", (0.5 * rng.standard_normal((d_inner, d_conv))).astype(np.float32))
        w.add_tensor(f"{blk}.ssm_conv1d.bias", _bias(rng, d_inner))
        w.add_tensor(f"{blk}.ssm_x.weight", _weight(rng, dt_rank + 2 * d_state, d_inner, np.float16))
        w.add_tensor(f"{blk}.ssm_dt.weight", _weight(rng, d_inner, dt_rank, np.float32))
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), size=d_inner))
        w.add_tensor(f"{blk}.ssm_dt.bias", np.log(np.expm1(dt)).astype(np.float32))
        a = np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1))  # S4D-real initialisation
        w.add_tensor(f"{blk}.ssm_a", -a)
        w.add_tensor(f"{blk}.ssm_d", (1.0 + 0.1 * rng.standard_normal(d_inner)).astype(np.float32))
        w.add_tensor(f"{blk}.ssm_out.weight", _weight(rng, n_embd, d_inner, np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_qwen3next(path: Path, n_layer: int = 8, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                    head_dim: int = 16, n_expert: int = 4, n_ff_exp: int = 32, seed: int = 17) -> Path:
    """A Qwen3-Next: gated delta-net (linear attention) layers with a full-attention layer every
    fourth, each with routed experts and a gated shared expert."""
    rng = np.random.default_rng(seed)
    n_vocab = len(byte_level_vocab()[0])
    head_k, n_k_heads, n_v_heads = 16, 2, 4  # the delta net's key heads and value heads
    key_dim, value_dim = head_k * n_k_heads, head_k * n_v_heads
    conv_dim = 2 * key_dim + value_dim
    w = gguf.GGUFWriter(path, "qwen3next")
    w.add_name("tiny-qwen3next")
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(4 * n_embd)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(n_ff_exp)
    w.add_expert_shared_feed_forward_length(n_ff_exp)
    w.add_ssm_conv_kernel(4)
    w.add_ssm_inner_size(value_dim)
    w.add_ssm_state_size(head_k)
    w.add_ssm_time_step_rank(n_v_heads)
    w.add_ssm_group_count(n_k_heads)
    w.add_uint32("qwen3next.full_attention_interval", 4)
    add_byte_level_vocab(w)
    w.add_tensor("token_embd.weight", (0.1 * rng.standard_normal((n_vocab, n_embd))).astype(np.float16))
    w.add_tensor("output_norm.weight", _norm(rng, n_embd))
    w.add_tensor("output.weight", _weight(rng, n_vocab, n_embd, np.float32))
    f16 = np.float16
    for i in range(n_layer):
        blk = f"blk.{i}"
        w.add_tensor(f"{blk}.attn_norm.weight", _norm(rng, n_embd))
        w.add_tensor(f"{blk}.post_attention_norm.weight", _norm(rng, n_embd))
        if (i + 1) % 4 == 0:
            w.add_tensor(f"{blk}.attn_q.weight", _weight(rng, 2 * n_head * head_dim, n_embd, f16))  # query and gate
            w.add_tensor(f"{blk}.attn_k.weight", _weight(rng, n_head_kv * head_dim, n_embd, f16))
            w.add_tensor(f"{blk}.attn_v.weight", _weight(rng, n_head_kv * head_dim, n_embd, f16))
            w.add_tensor(f"{blk}.attn_output.weight", _weight(rng, n_embd, n_head * head_dim, f16))
            w.add_tensor(f"{blk}.attn_q_norm.weight", _norm(rng, head_dim))
            w.add_tensor(f"{blk}.attn_k_norm.weight", _norm(rng, head_dim))
        else:
            w.add_tensor(f"{blk}.attn_qkv.weight", _weight(rng, conv_dim, n_embd, f16))
            w.add_tensor(f"{blk}.attn_gate.weight", _weight(rng, value_dim, n_embd, f16))
            w.add_tensor(f"{blk}.ssm_conv1d.weight", (0.5 * rng.standard_normal((conv_dim, 4))).astype(np.float32))
            w.add_tensor(f"{blk}.ssm_dt.bias", _bias(rng, n_v_heads))
            w.add_tensor(f"{blk}.ssm_a", -np.exp(rng.uniform(0.0, 1.0, size=n_v_heads)).astype(np.float32))
            w.add_tensor(f"{blk}.ssm_ba.weight", _weight(rng, 2 * n_v_heads, n_embd, f16))
            w.add_tensor(f"{blk}.ssm_norm.weight", _norm(rng, head_k))
            w.add_tensor(f"{blk}.ssm_out.weight", _weight(rng, n_embd, value_dim, f16))
        w.add_tensor(f"{blk}.ffn_gate_inp.weight", _weight(rng, n_expert, n_embd, np.float32))
        w.add_tensor(f"{blk}.ffn_gate_exps.weight", (rng.standard_normal((n_expert, n_ff_exp, n_embd)) / 8).astype(f16))
        w.add_tensor(f"{blk}.ffn_up_exps.weight", (rng.standard_normal((n_expert, n_ff_exp, n_embd)) / 8).astype(f16))
        w.add_tensor(f"{blk}.ffn_down_exps.weight", (rng.standard_normal((n_expert, n_embd, n_ff_exp)) / 6).astype(f16))
        w.add_tensor(f"{blk}.ffn_gate_inp_shexp.weight", _bias(rng, n_embd).astype(f16))
        w.add_tensor(f"{blk}.ffn_gate_shexp.weight", _weight(rng, n_ff_exp, n_embd, f16))
        w.add_tensor(f"{blk}.ffn_up_shexp.weight", _weight(rng, n_ff_exp, n_embd, f16))
        w.add_tensor(f"{blk}.ffn_down_shexp.weight", _weight(rng, n_embd, n_ff_exp, f16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
