"""Tiny random-weight GGUFs of the dense families (and their MoE siblings) for the range parity tests.

One writer per architecture, each laying out exactly the tensors and keys the
pinned llama.cpp's loader for that architecture reads (src/models/<arch>.cpp),
with the architecture's quirks switched on: sliding-window patterns with a
window shorter than the test prompts, logit softcapping, embedding, residual
and logit scales, shared experts and dense-lead layers, q-lora attention,
MTP (nextn) layers, rope factor tensors that every layer references.
The vocabulary is gguf_factory's byte-level BPE.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np
from gguf_factory import _bias, _norm, _weight, add_byte_level_vocab

WEIGHT_DTYPE = np.float16
# shorter than the longer test prompts, so a sliding-window layer really masks
SWA_WINDOW = 8


@dataclass(frozen=True)
class DenseSpec:
    """One tiny model: its architecture, shape and the ranges its parity test cuts it into."""

    arch: str
    seed: int
    chain: tuple[tuple[int, int], ...]  # the stages; cuts where the architecture is tricky
    n_layer: int = 6
    n_embd: int = 64
    n_ff: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    tied: bool = True
    n_nextn: int = 0  # MTP layers after the trunk (block_count counts them)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 32
    n_ff_shexp: int = 0
    n_dense_lead: int = 0
    kv: dict[str, object] = field(default_factory=dict)  # architecture keys, without the "<arch>." prefix

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


class _Tensors:
    """Adds a model's tensors, each drawn from one generator in writing order (same spec, same bytes)."""

    def __init__(self, w: gguf.GGUFWriter, rng: np.random.Generator, spec: DenseSpec) -> None:
        self.w, self.rng, self.s = w, rng, spec

    def norm(self, name: str, n: int | None = None) -> None:
        self.w.add_tensor(f"{name}.weight", _norm(self.rng, n or self.s.n_embd))

    def bias(self, name: str, n: int) -> None:
        self.w.add_tensor(f"{name}.bias", _bias(self.rng, n))

    def mat(self, name: str, n_out: int, n_in: int) -> None:
        self.w.add_tensor(f"{name}.weight", _weight(self.rng, n_out, n_in, WEIGHT_DTYPE))

    def qkv(self, blk: str, *, fused: bool = False) -> None:
        s = self.s
        if fused:
            self.mat(f"{blk}.attn_qkv", s.q_dim + 2 * s.kv_dim, s.n_embd)
        else:
            self.mat(f"{blk}.attn_q", s.q_dim, s.n_embd)
            self.mat(f"{blk}.attn_k", s.kv_dim, s.n_embd)
            self.mat(f"{blk}.attn_v", s.kv_dim, s.n_embd)
        self.mat(f"{blk}.attn_output", s.n_embd, s.q_dim)

    def ffn(self, blk: str, n_ff: int | None = None) -> None:
        s, n = self.s, n_ff or self.s.n_ff
        self.mat(f"{blk}.ffn_gate", n, s.n_embd)
        self.mat(f"{blk}.ffn_up", n, s.n_embd)
        self.mat(f"{blk}.ffn_down", s.n_embd, n)

    def experts(self, blk: str, *, probs_bias: bool = False, shared: bool = False) -> None:
        s = self.s
        self.mat(f"{blk}.ffn_gate_inp", s.n_expert, s.n_embd)
        if probs_bias:
            self.w.add_tensor(f"{blk}.exp_probs_b.bias", _bias(self.rng, s.n_expert))
        for name, shape in (("gate", (s.n_ff_exp, s.n_embd)), ("up", (s.n_ff_exp, s.n_embd)),
                            ("down", (s.n_embd, s.n_ff_exp))):
            w = self.rng.standard_normal((s.n_expert, *shape)) / np.sqrt(shape[1])
            self.w.add_tensor(f"{blk}.ffn_{name}_exps.weight", w.astype(WEIGHT_DTYPE))
        if shared:
            self.mat(f"{blk}.ffn_gate_shexp", s.n_ff_shexp, s.n_embd)
            self.mat(f"{blk}.ffn_up_shexp", s.n_ff_shexp, s.n_embd)
            self.mat(f"{blk}.ffn_down_shexp", s.n_embd, s.n_ff_shexp)

    def qk_norms(self, blk: str, n: int | None = None, n_k: int | None = None) -> None:
        self.norm(f"{blk}.attn_q_norm", n or self.s.head_dim)
        self.norm(f"{blk}.attn_k_norm", n_k or n or self.s.head_dim)


BlockWriter = Callable[[_Tensors, str, int], None]


def _llama_like(t: _Tensors, blk: str, i: int) -> None:
    """gemma, mistral3, exaone, ernie4_5, granite, minicpm: pre-norm attention and SwiGLU/GeGLU."""
    t.norm(f"{blk}.attn_norm")
    t.qkv(blk)
    t.norm(f"{blk}.ffn_norm")
    t.ffn(blk)


def _gemma2(t: _Tensors, blk: str, i: int) -> None:
    t.norm(f"{blk}.attn_norm")
    t.qkv(blk)
    t.norm(f"{blk}.post_attention_norm")
    t.norm(f"{blk}.ffn_norm")
    t.ffn(blk)
    t.norm(f"{blk}.post_ffw_norm")


def _gemma3(t: _Tensors, blk: str, i: int) -> None:
    _gemma2(t, blk, i)
    t.qk_norms(blk)


def _phi3(t: _Tensors, blk: str, i: int) -> None:
    s = t.s
    t.norm(f"{blk}.attn_norm")
    t.qkv(blk, fused=True)
    t.norm(f"{blk}.ffn_norm")
    t.mat(f"{blk}.ffn_up", 2 * s.n_ff, s.n_embd)  # gate and up in one: SwiGLU over the halves
    t.mat(f"{blk}.ffn_down", s.n_embd, s.n_ff)


def _phimoe(t: _Tensors, blk: str, i: int) -> None:
    e = t.s.n_embd
    t.norm(f"{blk}.attn_norm")
    t.bias(f"{blk}.attn_norm", e)
    t.qkv(blk)
    t.bias(f"{blk}.attn_output", e)
    t.norm(f"{blk}.ffn_norm")
    t.bias(f"{blk}.ffn_norm", e)
    t.experts(blk)


def _granitemoe(t: _Tensors, blk: str, i: int) -> None:
    t.norm(f"{blk}.attn_norm")
    t.qkv(blk)
    t.norm(f"{blk}.ffn_norm")
    t.experts(blk, shared=True)


def _olmo2(t: _Tensors, blk: str, i: int) -> None:
    # no pre-norms: q/k norms over the whole projection, post-norms on both branches
    s = t.s
    t.qkv(blk)
    t.qk_norms(blk, s.q_dim, s.kv_dim)
    t.norm(f"{blk}.post_attention_norm")
    t.ffn(blk)
    t.norm(f"{blk}.post_ffw_norm")


def _command_r(t: _Tensors, blk: str, i: int) -> None:
    # one layer norm feeds attention and FFN in parallel
    t.norm(f"{blk}.attn_norm")
    t.qkv(blk)
    t.ffn(blk)


def _exaone4(t: _Tensors, blk: str, i: int) -> None:
    s = t.s
    t.qkv(blk)
    t.norm(f"{blk}.post_attention_norm")
    t.qk_norms(blk)
    t.ffn(blk)
    t.norm(f"{blk}.post_ffw_norm")
    if i >= s.n_layer:  # an MTP layer: the trunk's tensors plus its own projection and norms
        t.mat(f"{blk}.nextn.eh_proj", s.n_embd, 2 * s.n_embd)
        t.norm(f"{blk}.nextn.enorm")
        t.norm(f"{blk}.nextn.hnorm")


def _ernie4_5_moe(t: _Tensors, blk: str, i: int) -> None:
    t.norm(f"{blk}.attn_norm")
    t.qkv(blk)
    t.norm(f"{blk}.ffn_norm")
    if i < t.s.n_dense_lead:
        t.ffn(blk)
    else:
        t.experts(blk, probs_bias=True, shared=True)


def _hunyuan_moe(t: _Tensors, blk: str, i: int) -> None:
    t.norm(f"{blk}.attn_norm")
    t.qkv(blk)
    t.qk_norms(blk)
    t.norm(f"{blk}.ffn_norm")
    t.experts(blk, shared=True)


def _hunyuan_dense(t: _Tensors, blk: str, i: int) -> None:
    t.norm(f"{blk}.attn_norm")
    t.qkv(blk)
    t.qk_norms(blk)
    t.norm(f"{blk}.ffn_norm")
    t.ffn(blk)


# minicpm3's multi-head latent attention: q through a low-rank bottleneck, k/v from a shared latent
MLA_Q_LORA, MLA_KV_LORA, MLA_ROPE, MLA_NOPE = 32, 16, 8, 8


def _minicpm3(t: _Tensors, blk: str, i: int) -> None:
    s = t.s
    t.norm(f"{blk}.attn_norm")
    t.norm(f"{blk}.attn_q_a_norm", MLA_Q_LORA)
    t.norm(f"{blk}.attn_kv_a_norm", MLA_KV_LORA)
    t.mat(f"{blk}.attn_q_a", MLA_Q_LORA, s.n_embd)
    t.mat(f"{blk}.attn_q_b", s.n_head * (MLA_NOPE + MLA_ROPE), MLA_Q_LORA)
    t.mat(f"{blk}.attn_kv_a_mqa", MLA_KV_LORA + MLA_ROPE, s.n_embd)
    t.mat(f"{blk}.attn_kv_b", s.n_head * (MLA_NOPE + s.head_dim), MLA_KV_LORA)
    t.mat(f"{blk}.attn_output", s.n_embd, s.n_head * s.head_dim)
    t.norm(f"{blk}.ffn_norm")
    t.ffn(blk)


def _afmoe(t: _Tensors, blk: str, i: int) -> None:
    s = t.s
    t.norm(f"{blk}.attn_norm")
    t.norm(f"{blk}.post_attention_norm")
    t.qkv(blk)
    t.qk_norms(blk)
    t.mat(f"{blk}.attn_gate", s.q_dim, s.n_embd)
    t.norm(f"{blk}.ffn_norm")
    t.norm(f"{blk}.post_ffw_norm")
    if i < s.n_dense_lead:
        t.ffn(blk)
    else:
        t.experts(blk, probs_bias=True, shared=True)


BLOCKS: dict[str, BlockWriter] = {
    "gemma": _llama_like, "gemma2": _gemma2, "gemma3": _gemma3, "mistral3": _llama_like,
    "phi3": _phi3, "phimoe": _phimoe, "granite": _llama_like, "granitemoe": _granitemoe,
    "minicpm": _llama_like, "minicpm3": _minicpm3, "olmo2": _olmo2, "command-r": _command_r,
    "cohere2": _command_r, "exaone": _llama_like, "exaone4": _exaone4, "ernie4_5": _llama_like,
    "ernie4_5-moe": _ernie4_5_moe, "hunyuan-moe": _hunyuan_moe, "hunyuan-dense": _hunyuan_dense,
    "afmoe": _afmoe,
}
# command-r and cohere2 use layer norm (eps under another key); the rest RMS norm
LAYER_NORM_ARCHS = {"command-r", "cohere2"}
# loaders that require a separate output head
UNTIED_ONLY = {"phimoe", "olmo2"}


def _swa(pattern: int | None = None, **more: object) -> dict[str, object]:
    kv: dict[str, object] = {"attention.sliding_window": SWA_WINDOW, **more}
    if pattern is not None:
        kv["attention.sliding_window_pattern"] = pattern
    return kv


_MOE = {"n_expert": 4, "n_expert_used": 2}
_THIRDS = ((0, 2), (2, 4), (4, 6))

DENSE_SPECS: dict[str, DenseSpec] = {
    # the head scales the token embeddings by sqrt(n_embd); the later stages must not scale again
    "gemma": DenseSpec("gemma", seed=11, chain=((0, 1), (1, 4), (4, 6))),
    # sliding window on even layers (pattern 2), softcapped attention and logits; cuts put a
    # full-attention layer first and last in the middle stage
    "gemma2": DenseSpec("gemma2", seed=12, chain=((0, 1), (1, 4), (4, 6)),
                        kv=_swa(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    # pattern 6 over 8 layers: 0-4 sliding, 5 global, 6-7 sliding; the head and tail stages hold
    # sliding layers only, the middle one crosses the global layer; the window's own rope base
    "gemma3": DenseSpec("gemma3", seed=13, n_layer=8, head_dim=32, chain=((0, 3), (3, 7), (7, 8)),
                        kv=_swa(**{"rope.freq_base_swa": 1000.0, "final_logit_softcapping": 4.0})),
    "mistral3": DenseSpec("mistral3", seed=14, tied=False, chain=_THIRDS),
    # fused qkv, fused gate+up; rope factors held once, referenced by every layer
    "phi3": DenseSpec("phi3", seed=15, chain=((0, 1), (1, 3), (3, 6))),
    # the experts take feed_forward_length (phimoe, granitemoe, hunyuan-moe) or expert_feed_forward_length
    "phimoe": DenseSpec("phimoe", seed=16, tied=False, n_ff=32, chain=_THIRDS, **_MOE),
    # embedding, residual and logit scales; the head alone applies the embedding scale
    "granite": DenseSpec("granite", seed=17, chain=((0, 1), (1, 5), (5, 6)),
                         kv={"logit_scale": 2.0, "residual_scale": 0.5, "embedding_scale": 3.0,
                             "attention.scale": 0.2}),
    "granitemoe": DenseSpec("granitemoe", seed=18, n_ff=32, chain=_THIRDS, n_ff_shexp=48, **_MOE,
                            kv={"logit_scale": 2.0, "residual_scale": 0.5, "embedding_scale": 3.0}),
    # embedding scale 12 and residual scale 1.4/sqrt(n_layer) by default, from the whole model's depth
    "minicpm": DenseSpec("minicpm", seed=19, chain=((0, 2), (2, 3), (3, 6))),
    # fixed input scale 12 (the gemma quirk) and q-lora attention
    "minicpm3": DenseSpec("minicpm3", seed=20, head_dim=MLA_NOPE + MLA_ROPE, n_head_kv=4,
                          chain=((0, 1), (1, 4), (4, 6)),
                          kv={"attention.q_lora_rank": MLA_Q_LORA, "attention.kv_lora_rank": MLA_KV_LORA,
                              "rope.dimension_count": MLA_ROPE}),
    # olmo3-style sliding window, pattern 4: layers 3 and 7 global
    "olmo2": DenseSpec("olmo2", seed=21, n_layer=8, tied=False, chain=((0, 3), (3, 4), (4, 8)), kv=_swa()),
    "command-r": DenseSpec("command-r", seed=22, chain=_THIRDS, kv={"logit_scale": 0.5}),
    "cohere2": DenseSpec("cohere2", seed=23, n_layer=8, chain=((0, 2), (2, 5), (5, 8)),
                         kv=_swa(logit_scale=0.5)),
    "exaone": DenseSpec("exaone", seed=24, tied=False, chain=_THIRDS),
    # one MTP layer after the trunk: neither the whole model nor any stage runs it
    "exaone4": DenseSpec("exaone4", seed=25, n_nextn=1, chain=((0, 2), (2, 5), (5, 6))),
    "ernie4_5": DenseSpec("ernie4_5", seed=26, chain=_THIRDS),
    # two dense-lead layers; a cut right after them
    "ernie4_5-moe": DenseSpec("ernie4_5-moe", seed=27, n_dense_lead=2, n_ff_shexp=48, chain=((0, 2), (2, 3), (3, 6)),
                              **_MOE, kv={"interleave_moe_layer_step": 1}),
    "hunyuan-moe": DenseSpec("hunyuan-moe", seed=28, n_ff=32, n_ff_shexp=48, chain=_THIRDS, **_MOE),
    "hunyuan-dense": DenseSpec("hunyuan-dense", seed=29, chain=_THIRDS),
    # scaled input, sliding window pattern 4, one dense-lead layer, gated attention, shared expert
    "afmoe": DenseSpec("afmoe", seed=30, n_layer=8, n_dense_lead=1, n_ff_shexp=32, chain=((0, 1), (1, 4), (4, 8)),
                       **_MOE, kv=_swa(expert_shared_count=1)),
}


def _arch_kv(w: gguf.GGUFWriter, spec: DenseSpec) -> None:
    a = spec.arch
    for key, value in spec.kv.items():
        name = f"{a}.{key}"
        if isinstance(value, bool):
            w.add_bool(name, value)
        elif isinstance(value, int):
            w.add_uint32(name, value)
        elif isinstance(value, float):
            w.add_float32(name, value)
        elif isinstance(value, list):
            w.add_array(name, value)
        else:
            raise TypeError(f"{name}: unsupported value {value!r}")
    if spec.n_expert:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
        w.add_expert_feed_forward_length(spec.n_ff_exp)
        if spec.n_ff_shexp:
            w.add_expert_shared_feed_forward_length(spec.n_ff_shexp)
        if spec.n_dense_lead:
            w.add_leading_dense_block_count(spec.n_dense_lead)
    if spec.n_nextn:
        w.add_uint32(f"{a}.nextn_predict_layers", spec.n_nextn)




def write_dense_gguf(path: Path, spec: DenseSpec, extra_kv: dict[str, object] | None = None) -> Path:
    """Writes a model of `spec` to `path` (the same spec always gives the same bytes).

    extra_kv adds architecture keys on top of the spec's (e.g. a deepstack mapping)."""
    if spec.tied and spec.arch in UNTIED_ONLY:
        raise ValueError(f"{spec.arch} needs an untied output head")
    rng = np.random.default_rng(spec.seed)
    a, e = spec.arch, spec.n_embd
    w = gguf.GGUFWriter(path, a)
    # no architecture in the name: llama.cpp keys vocabulary quirks on names such as "phi3"
    w.add_name("tiny random-weight model")
    w.add_context_length(256)
    w.add_embedding_length(e)
    w.add_block_count(spec.n_layer + spec.n_nextn)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    if a in LAYER_NORM_ARCHS:
        w.add_layer_norm_eps(1e-5)
    else:
        w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _arch_kv(w, replace(spec, kv={**spec.kv, **(extra_kv or {})}))
    n_vocab = add_byte_level_vocab(w)

    t = _Tensors(w, rng, spec)
    w.add_tensor("token_embd.weight", (0.1 * rng.standard_normal((n_vocab, e))).astype(np.float16))
    t.norm("output_norm")
    if a == "phimoe":
        t.bias("output_norm", e)
    if not spec.tied:
        w.add_tensor("output.weight", _weight(rng, n_vocab, e, np.float32))
        if a == "phimoe":
            t.bias("output", n_vocab)
    if a == "phi3":
        # one copy in the file; every layer's graph references it
        n_rot = spec.head_dim
        w.add_tensor("rope_factors_long.weight", (1.0 + rng.random(n_rot // 2)).astype(np.float32))
        w.add_tensor("rope_factors_short.weight", (1.0 + 0.5 * rng.random(n_rot // 2)).astype(np.float32))

    block = BLOCKS[a]
    for i in range(spec.n_layer + spec.n_nextn):
        block(t, f"blk.{i}", i)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
