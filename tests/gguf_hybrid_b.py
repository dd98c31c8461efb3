"""Tiny random-weight GGUFs of four hybrid (recurrent + attention) families, for the range parity tests.

granitehybrid (Granite 4.0-H: Mamba-2 and attention layers, experts with a shared one,
Granite's embedding, residual, attention and logit scales), nemotron_h (Mamba-2,
attention and MLP-only layers) and nemotron_h_moe (its MLP layers as sigmoid-routed
experts through a latent projection, with a shared expert, and one MTP block past the
trunk), jamba (Mamba-1 with dt/B/C norms, attention without RoPE, experts every other
layer) and falcon-h1 (Mamba-2 and attention side by side in every layer). Each writer
lays out exactly the tensors and keys the pinned llama.cpp's loader for the
architecture reads (src/models/<arch>.cpp). A layer's kind comes from a pattern string:
M a recurrent (Mamba) layer, A attention, F a feed-forward-only layer (nemotron-h).
The vocabulary and the weight/norm/bias draws are gguf_factory's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf_factory import _bias, _norm, _weight, add_byte_level_vocab

N_EMBD = 64
N_HEAD, N_HEAD_KV, HEAD_DIM = 4, 2, 16
D_CONV, D_STATE = 4, 16
N_EXPERT, N_EXPERT_USED = 4, 2
F16 = np.float16


@dataclass(frozen=True)
class HybridSpec:
    """One tiny model: its architecture, its layers' kinds and the chains of ranges its test cuts it into."""

    arch: str
    seed: int
    pattern: str  # one letter per trunk layer: M recurrent, A attention, F feed-forward only
    chains: tuple[tuple[tuple[int, int], ...], ...]
    n_ff: int = 96
    d_inner: int = 2 * N_EMBD
    n_ssm_head: int = 8  # Mamba-2 heads (dt_rank); Mamba-1's dt_rank
    n_group: int = 1
    experts: bool = False
    n_ff_exp: int = 32
    n_ff_shexp: int = 0
    n_nextn: int = 0
    moe_latent: int = 0  # nemotron-h experts: their width when projected down from n_embd (0: none)
    tied: bool = False
    kv: dict[str, object] = field(default_factory=dict)  # architecture keys, without the "<arch>." prefix

    @property
    def n_layer(self) -> int:
        return len(self.pattern)


# (0, 3) holds no attention layer, (3, 4) no recurrent one; the cuts at 3 and 4 lie between the two kinds
_GRANITE_CHAINS = (((0, 3), (3, 4), (4, 8)), ((0, 4), (4, 6), (6, 8)))

HYBRID_B_SPECS: dict[str, HybridSpec] = {
    # Granite 4.0-H Tiny/Small: experts with a shared one, RoPE on, every Granite scale set
    "granitehybrid-moe": HybridSpec(
        "granitehybrid", seed=41, pattern="MMMAMMAM", chains=_GRANITE_CHAINS, experts=True, n_ff=32, n_ff_shexp=48,
        kv={"embedding_scale": 12.0, "residual_scale": 0.22, "logit_scale": 8.0, "attention.scale": 0.0078125}),
    # Granite 4.0-H Micro: a dense FFN, no positional encoding at all (rope.scaling.finetuned false)
    "granitehybrid-dense": HybridSpec(
        "granitehybrid", seed=42, pattern="MMAMMA", chains=(((0, 2), (2, 3), (3, 6)),),
        kv={"embedding_scale": 12.0, "residual_scale": 0.22, "logit_scale": 8.0, "rope.scaling.finetuned": False}),
    # (0, 3): no attention; (3, 4): attention only; (4, 6): MLP layers only, neither memory; (6, 8): mixed
    "nemotron_h": HybridSpec("nemotron_h", seed=43, pattern="MFMAFFMA", chains=(((0, 3), (3, 4), (4, 6), (6, 8)),)),
    # one MTP block past the trunk: the tail owns it, no stage runs it
    "nemotron_h_moe": HybridSpec(
        "nemotron_h_moe", seed=44, pattern="MFMAFFMA", chains=(((0, 3), (3, 6), (6, 8)),), experts=True,
        n_ff_shexp=48, n_nextn=1, moe_latent=32, kv={"expert_weights_norm": True, "expert_weights_scale": 2.5}),
    # experts on odd layers, as Jamba's expert_layer_period 2 / offset 1
    "jamba": HybridSpec("jamba", seed=45, pattern="MMMAMMAM", chains=_GRANITE_CHAINS, experts=True, n_ssm_head=4),
    # attention and Mamba-2 in every layer: no stage lacks either; d_inner not twice n_embd, two groups, tied head
    "falcon-h1": HybridSpec("falcon-h1", seed=46, pattern="AAAAAA", chains=(((0, 1), (1, 4), (4, 6)),),
                            d_inner=96, n_ssm_head=6, n_group=2, tied=True),
}


class _Tensors:
    """Adds a model's tensors, each drawn from one generator in writing order (same spec, same bytes)."""

    def __init__(self, w: gguf.GGUFWriter, rng: np.random.Generator, spec: HybridSpec) -> None:
        self.w, self.rng, self.s = w, rng, spec

    def norm(self, name: str, n: int = N_EMBD) -> None:
        self.w.add_tensor(f"{name}.weight", _norm(self.rng, n))

    def mat(self, name: str, n_out: int, n_in: int) -> None:
        self.w.add_tensor(f"{name}.weight", _weight(self.rng, n_out, n_in, F16))

    def stack(self, name: str, n_out: int, n_in: int) -> None:
        w = self.rng.standard_normal((N_EXPERT, n_out, n_in)) / np.sqrt(n_in)
        self.w.add_tensor(f"{name}.weight", w.astype(F16))

    def attention(self, blk: str) -> None:
        self.mat(f"{blk}.attn_q", N_HEAD * HEAD_DIM, N_EMBD)
        self.mat(f"{blk}.attn_k", N_HEAD_KV * HEAD_DIM, N_EMBD)
        self.mat(f"{blk}.attn_v", N_HEAD_KV * HEAD_DIM, N_EMBD)
        self.mat(f"{blk}.attn_output", N_EMBD, N_HEAD * HEAD_DIM)

    def conv(self, blk: str, n_channels: int) -> None:
        self.w.add_tensor(f"{blk}.ssm_conv1d.weight",
                          (0.5 * self.rng.standard_normal((n_channels, D_CONV))).astype(np.float32))
        self.w.add_tensor(f"{blk}.ssm_conv1d.bias", _bias(self.rng, n_channels))

    def dt_bias(self, blk: str, n: int) -> None:
        # softplus(dt + bias) between about 0.001 and 0.1, as Mamba initialises it
        dt = np.exp(self.rng.uniform(np.log(1e-3), np.log(1e-1), size=n))
        self.w.add_tensor(f"{blk}.ssm_dt.bias", np.log(np.expm1(dt)).astype(np.float32))

    def mamba2(self, blk: str) -> None:
        s = self.s
        conv_dim = s.d_inner + 2 * s.n_group * D_STATE
        self.mat(f"{blk}.ssm_in", s.d_inner + conv_dim + s.n_ssm_head, N_EMBD)
        self.conv(blk, conv_dim)
        self.dt_bias(blk, s.n_ssm_head)
        self.w.add_tensor(f"{blk}.ssm_a", -np.exp(self.rng.uniform(0.0, 2.0, size=(s.n_ssm_head, 1))).astype(np.float32))
        self.w.add_tensor(f"{blk}.ssm_d", (1.0 + 0.1 * self.rng.standard_normal((s.n_ssm_head, 1))).astype(np.float32))
        self.w.add_tensor(f"{blk}.ssm_norm.weight", _norm(self.rng, s.d_inner).reshape(s.n_group, -1))
        self.mat(f"{blk}.ssm_out", N_EMBD, s.d_inner)

    def mamba1(self, blk: str) -> None:
        """Jamba's Mamba layer: dt_rank = n_ssm_head, RMS norms on dt, B and C."""
        s = self.s
        self.mat(f"{blk}.ssm_in", 2 * s.d_inner, N_EMBD)
        self.conv(blk, s.d_inner)
        self.mat(f"{blk}.ssm_x", s.n_ssm_head + 2 * D_STATE, s.d_inner)
        self.norm(f"{blk}.ssm_dt_norm", s.n_ssm_head)
        self.w.add_tensor(f"{blk}.ssm_dt.weight", _weight(self.rng, s.d_inner, s.n_ssm_head, np.float32))
        self.dt_bias(blk, s.d_inner)
        self.norm(f"{blk}.ssm_b_norm", D_STATE)
        self.norm(f"{blk}.ssm_c_norm", D_STATE)
        self.w.add_tensor(f"{blk}.ssm_a", -np.tile(np.arange(1, D_STATE + 1, dtype=np.float32), (s.d_inner, 1)))
        self.w.add_tensor(f"{blk}.ssm_d", (1.0 + 0.1 * self.rng.standard_normal(s.d_inner)).astype(np.float32))
        self.mat(f"{blk}.ssm_out", N_EMBD, s.d_inner)

    def swiglu(self, blk: str, n_ff: int, suffix: str = "") -> None:
        self.mat(f"{blk}.ffn_gate{suffix}", n_ff, N_EMBD)
        self.mat(f"{blk}.ffn_up{suffix}", n_ff, N_EMBD)
        self.mat(f"{blk}.ffn_down{suffix}", N_EMBD, n_ff)

    def softmax_experts(self, blk: str, n_ff: int) -> None:
        self.w.add_tensor(f"{blk}.ffn_gate_inp.weight", _weight(self.rng, N_EXPERT, N_EMBD, np.float32))
        self.stack(f"{blk}.ffn_gate_exps", n_ff, N_EMBD)
        self.stack(f"{blk}.ffn_up_exps", n_ff, N_EMBD)
        self.stack(f"{blk}.ffn_down_exps", N_EMBD, n_ff)

    def nemotron_experts(self, blk: str) -> None:
        """Sigmoid routing with a selection bias, ReLU² experts without gate in the latent width, a shared expert."""
        s = self.s
        latent = s.moe_latent or N_EMBD
        self.w.add_tensor(f"{blk}.ffn_gate_inp.weight", _weight(self.rng, N_EXPERT, N_EMBD, np.float32))
        self.w.add_tensor(f"{blk}.exp_probs_b.bias", _bias(self.rng, N_EXPERT))
        if s.moe_latent:
            self.mat(f"{blk}.ffn_latent_down", latent, N_EMBD)
            self.mat(f"{blk}.ffn_latent_up", N_EMBD, latent)
        self.stack(f"{blk}.ffn_up_exps", s.n_ff_exp, latent)
        self.stack(f"{blk}.ffn_down_exps", latent, s.n_ff_exp)
        self.mat(f"{blk}.ffn_up_shexp", s.n_ff_shexp, N_EMBD)
        self.mat(f"{blk}.ffn_down_shexp", N_EMBD, s.n_ff_shexp)


def _granite_block(t: _Tensors, blk: str, kind: str) -> None:
    s = t.s
    t.norm(f"{blk}.attn_norm")
    if kind == "M":
        t.mamba2(blk)
    else:
        t.attention(blk)
    t.norm(f"{blk}.ffn_norm")
    if s.experts:
        t.softmax_experts(blk, s.n_ff)
        t.swiglu(blk, s.n_ff_shexp, "_shexp")
    else:
        t.swiglu(blk, s.n_ff)


def _nemotron_block(t: _Tensors, blk: str, kind: str) -> None:
    s = t.s
    t.norm(f"{blk}.attn_norm")
    if kind == "M":
        t.mamba2(blk)
    elif kind == "A":
        t.attention(blk)
    elif s.experts:
        t.nemotron_experts(blk)
    else:
        t.mat(f"{blk}.ffn_up", s.n_ff, N_EMBD)  # ReLU², no gate
        t.mat(f"{blk}.ffn_down", N_EMBD, s.n_ff)


def _nemotron_mtp_block(t: _Tensors, blk: str) -> None:
    """An MTP block: input fusion, an attention sub-layer and an expert sub-layer, its own head norm."""
    t.norm(f"{blk}.nextn.enorm")
    t.norm(f"{blk}.nextn.hnorm")
    t.mat(f"{blk}.nextn.eh_proj", N_EMBD, 2 * N_EMBD)
    t.norm(f"{blk}.nextn.shared_head_norm")
    t.norm(f"{blk}.attn_norm")
    t.attention(blk)
    t.norm(f"{blk}.post_attention_norm")
    t.nemotron_experts(blk)


def _jamba_block(t: _Tensors, blk: str, kind: str, il: int) -> None:
    s = t.s
    t.norm(f"{blk}.attn_norm")
    if kind == "M":
        t.mamba1(blk)
    else:
        t.attention(blk)
    t.norm(f"{blk}.ffn_norm")
    if s.experts and il % 2 == 1:
        t.softmax_experts(blk, s.n_ff)
    else:
        t.swiglu(blk, s.n_ff)


def _falcon_h1_block(t: _Tensors, blk: str) -> None:
    t.mamba2(blk)
    t.attention(blk)
    t.norm(f"{blk}.attn_norm")
    # the pinned loader asks for falcon-h1's FFN norm without a ".weight" suffix
    t.w.add_tensor(f"{blk}.ffn_norm", _norm(t.rng, N_EMBD))
    t.swiglu(blk, t.s.n_ff)


def _add_kv(w: gguf.GGUFWriter, spec: HybridSpec) -> None:
    for key, value in spec.kv.items():
        name = f"{spec.arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(name, value)
        elif isinstance(value, int):
            w.add_uint32(name, value)
        elif isinstance(value, float):
            w.add_float32(name, value)
        else:
            raise TypeError(f"{name}: unsupported value {value!r}")


def write_hybrid_b_gguf(path: Path, spec: HybridSpec) -> Path:
    """Writes a model of `spec` to `path` (the same spec always gives the same bytes)."""
    rng = np.random.default_rng(spec.seed)
    a = spec.arch
    kinds = spec.pattern + "A" * spec.n_nextn  # an MTP block attends
    w = gguf.GGUFWriter(path, a)
    w.add_name("tiny random-weight hybrid")
    w.add_context_length(256)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(len(kinds))
    w.add_head_count(N_HEAD)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    if a == "falcon-h1":
        w.add_head_count_kv(N_HEAD_KV)
        w.add_feed_forward_length(spec.n_ff)
    else:
        # a layer is recurrent where it has no KV heads (and, in nemotron-h, no FFN width)
        w.add_head_count_kv([N_HEAD_KV if k == "A" else 0 for k in kinds])
        if a.startswith("nemotron_h"):
            w.add_feed_forward_length([spec.n_ff if k == "F" else 0 for k in spec.pattern] + [0] * spec.n_nextn)
        else:
            w.add_feed_forward_length(spec.n_ff)
    if a.startswith("nemotron_h"):
        w.add_layer_norm_eps(1e-5)  # the MTP head's final LayerNorm; required even without one
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_ssm_conv_kernel(D_CONV)
    w.add_ssm_inner_size(spec.d_inner)
    w.add_ssm_state_size(D_STATE)
    w.add_ssm_time_step_rank(spec.n_ssm_head)
    if a != "jamba":
        w.add_ssm_group_count(spec.n_group)
    if spec.experts:
        w.add_expert_count(N_EXPERT)
        w.add_expert_used_count(N_EXPERT_USED)
        w.add_expert_feed_forward_length(spec.n_ff_exp)
        if spec.n_ff_shexp:
            w.add_expert_shared_feed_forward_length(spec.n_ff_shexp)
    if spec.n_nextn:
        w.add_uint32(f"{a}.nextn_predict_layers", spec.n_nextn)
    if spec.moe_latent:
        w.add_uint32(f"{a}.moe_latent_size", spec.moe_latent)
    _add_kv(w, spec)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    n_vocab = add_byte_level_vocab(w)

    t = _Tensors(w, rng, spec)
    w.add_tensor("token_embd.weight", (0.1 * rng.standard_normal((n_vocab, N_EMBD))).astype(F16))
    t.norm("output_norm")
    if not spec.tied:
        w.add_tensor("output.weight", _weight(rng, n_vocab, N_EMBD, np.float32))
    for il, kind in enumerate(spec.pattern):
        blk = f"blk.{il}"
        if a == "granitehybrid":
            _granite_block(t, blk, kind)
        elif a.startswith("nemotron_h"):
            _nemotron_block(t, blk, kind)
        elif a == "jamba":
            _jamba_block(t, blk, kind, il)
        else:
            _falcon_h1_block(t, blk)
    for il in range(spec.n_layer, spec.n_layer + spec.n_nextn):
        _nemotron_mtp_block(t, f"blk.{il}")

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
