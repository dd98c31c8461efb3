"""Tiny random-weight GGUF models, written with the `gguf` package, for engine tests.

Each architecture the engine supports gets a model small enough to load and run
in milliseconds, plus one architecture without range support (`gpt2`) for the
refusal path. The vocabulary is a real byte-level BPE (the 256 GPT-2 byte
symbols, three ChatML control tokens, a few merges), so llama.cpp loads it like
any BPE model and tokenize/detokenize work, while n_vocab stays small.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# ChatML control tokens at the ids SmolLM2 uses, so bos/eos behave like the default model's.
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Shape and flavour of one tiny model."""

    arch: str
    tied: bool
    weight_dtype: type[np.floating]  # of the 2-D projection weights; norms and biases stay f32
    n_embd: int = 64
    n_layer: int = 6
    n_ff: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int | None = None  # None: n_embd / n_head; qwen3 widens it like the real models
    n_ctx: int = 256
    seed: int = 0

    @property
    def n_embd_head(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


TINY_SPECS: dict[str, TinySpec] = {
    "llama-gqa-tied": TinySpec("llama", tied=True, weight_dtype=np.float16, seed=1),
    "llama-gqa-untied": TinySpec("llama", tied=False, weight_dtype=np.float32, seed=2),
    "qwen2-bias": TinySpec("qwen2", tied=True, weight_dtype=np.float16, seed=3),
    "qwen3-qknorm": TinySpec("qwen3", tied=False, weight_dtype=np.float16, head_dim=32, seed=4),
}
# An architecture whose graph builder ignores layer ranges: partial loads must be refused.
UNSUPPORTED_SPEC = TinySpec("gpt2", tied=True, weight_dtype=np.float16, n_head_kv=4, seed=5)


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of a minimal GPT-2 style byte-level BPE."""
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to code points from 256 up
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    symbols = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    merged = ["".join(m.split(" ")) for m in MERGES]
    tokens = CONTROL_TOKENS + symbols + merged
    types = [int(gguf.TokenType.CONTROL)] * len(CONTROL_TOKENS)
    types += [int(gguf.TokenType.NORMAL)] * (len(symbols) + len(merged))
    return tokens, types, list(MERGES)


def add_byte_level_vocab(w: gguf.GGUFWriter) -> int:
    """Writes the tokenizer of byte_level_vocab() (bos/eos/unk/pad at SmolLM2's ids, the ChatML
    template), so every tiny model's vocabulary loads alike; returns n_vocab."""
    tokens, types, merges = byte_level_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(CONTROL_TOKENS.index("<|im_start|>"))
    w.add_eos_token_id(CONTROL_TOKENS.index("<|im_end|>"))
    w.add_unk_token_id(CONTROL_TOKENS.index("<|endoftext|>"))
    w.add_pad_token_id(CONTROL_TOKENS.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    return len(tokens)


def _weight(rng: np.random.Generator, n_out: int, n_in: int, dtype: type[np.floating]) -> np.ndarray:
    # 1/sqrt(fan_in) scaling: every layer moves the residual by O(1), so a skipped,
    # repeated or misordered layer shows up in the logits instead of vanishing in noise
    return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(dtype)


def _norm(rng: np.random.Generator, n: int) -> np.ndarray:
    # near 1 but not exactly, so a norm weight that is dropped or swapped changes the result
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def _bias(rng: np.random.Generator, n: int) -> np.ndarray:
    return (0.1 * rng.standard_normal(n)).astype(np.float32)


class GGUFReader(gguf.GGUFReader):
    """gguf.GGUFReader over a plain array of the file's map: np.memmap's bookkeeping on each of the million
    slices a 49,152-token vocabulary is parsed into is more than half of reading the default model's header
    (some 4 CPU-s of 6); the fields, tensors and their bytes are the same."""

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        # the view keeps the map (its base) open as long as any field or tensor refers to it
        self._plain = mapped.view(np.ndarray)


def tokenizer_of(source: Path) -> dict[str, Any]:
    """The tokenizer fields of the GGUF at `source` (a real model's), by key."""
    return {key: field.contents() for key, field in GGUFReader(source).fields.items()
            if key.startswith("tokenizer.")}


def add_vocab_of(w: gguf.GGUFWriter, tokenizer: dict[str, Any]) -> int:
    """Writes a tokenizer_of() another model, so a tiny model can stand in for a small model of that
    vocabulary (a draft model); returns n_vocab."""
    for key, value in tokenizer.items():
        if key == "tokenizer.ggml.tokens":
            w.add_token_list(value)
        elif key == "tokenizer.ggml.token_type":
            w.add_token_types(value)
        elif key == "tokenizer.ggml.merges":
            w.add_token_merges(value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
    return len(tokenizer["tokenizer.ggml.tokens"])


def write_tiny_gguf(path: Path, spec: TinySpec, vocab_of: Path | None = None) -> Path:
    """Writes a model of `spec` to `path`; the same spec always gives the same bytes. With `vocab_of`,
    the tokenizer is that GGUF's instead of the tiny byte-level one."""
    rng = np.random.default_rng(spec.seed)
    tokenizer = None if vocab_of is None else tokenizer_of(vocab_of)
    n_vocab = len(byte_level_vocab()[0] if tokenizer is None else tokenizer["tokenizer.ggml.tokens"])
    arch, e, d = spec.arch, spec.n_embd, spec.n_embd_head
    q_dim, kv_dim = spec.n_head * d, spec.n_head_kv * d

    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(spec.n_ctx)
    w.add_embedding_length(e)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_vocab_size(n_vocab)
    if spec.head_dim is not None:
        w.add_key_length(d)
        w.add_value_length(d)
    if arch == "gpt2":
        w.add_layer_norm_eps(1e-5)
    else:
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if spec.weight_dtype == np.float16 else gguf.LlamaFileType.ALL_F32)

    if tokenizer is None:
        add_byte_level_vocab(w)
    else:
        add_vocab_of(w, tokenizer)

    # small embeddings: the layers, not the input token, decide the residual, so greedy decoding
    # wanders over the vocabulary instead of repeating the prompt's last token (as a tied head would)
    w.add_tensor("token_embd.weight", (0.1 * rng.standard_normal((n_vocab, e))).astype(np.float16))
    if arch == "gpt2":
        w.add_tensor("position_embd.weight", (0.1 * rng.standard_normal((spec.n_ctx, e))).astype(np.float32))
        w.add_tensor("output_norm.bias", _bias(rng, e))
    w.add_tensor("output_norm.weight", _norm(rng, e))
    if not spec.tied:
        # f32 while token_embd is f16: the two heads differ in bytes, so a report that
        # counted one in place of the other could not match by accident
        w.add_tensor("output.weight", _weight(rng, n_vocab, e, np.float32))

    for i in range(spec.n_layer):
        blk = f"blk.{i}"
        if arch == "gpt2":
            _add_gpt2_block(w, rng, blk, spec)
            continue
        w.add_tensor(f"{blk}.attn_norm.weight", _norm(rng, e))
        w.add_tensor(f"{blk}.attn_q.weight", _weight(rng, q_dim, e, spec.weight_dtype))
        w.add_tensor(f"{blk}.attn_k.weight", _weight(rng, kv_dim, e, spec.weight_dtype))
        w.add_tensor(f"{blk}.attn_v.weight", _weight(rng, kv_dim, e, spec.weight_dtype))
        if arch == "qwen2":
            w.add_tensor(f"{blk}.attn_q.bias", _bias(rng, q_dim))
            w.add_tensor(f"{blk}.attn_k.bias", _bias(rng, kv_dim))
            w.add_tensor(f"{blk}.attn_v.bias", _bias(rng, kv_dim))
        if arch == "qwen3":
            w.add_tensor(f"{blk}.attn_q_norm.weight", _norm(rng, d))
            w.add_tensor(f"{blk}.attn_k_norm.weight", _norm(rng, d))
        w.add_tensor(f"{blk}.attn_output.weight", _weight(rng, e, q_dim, spec.weight_dtype))
        w.add_tensor(f"{blk}.ffn_norm.weight", _norm(rng, e))
        w.add_tensor(f"{blk}.ffn_gate.weight", _weight(rng, spec.n_ff, e, spec.weight_dtype))
        w.add_tensor(f"{blk}.ffn_up.weight", _weight(rng, spec.n_ff, e, spec.weight_dtype))
        w.add_tensor(f"{blk}.ffn_down.weight", _weight(rng, e, spec.n_ff, spec.weight_dtype))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_gpt2_block(w: gguf.GGUFWriter, rng: np.random.Generator, blk: str, spec: TinySpec) -> None:
    e = spec.n_embd
    w.add_tensor(f"{blk}.attn_norm.weight", _norm(rng, e))
    w.add_tensor(f"{blk}.attn_norm.bias", _bias(rng, e))
    w.add_tensor(f"{blk}.attn_qkv.weight", _weight(rng, 3 * e, e, spec.weight_dtype))
    w.add_tensor(f"{blk}.attn_qkv.bias", _bias(rng, 3 * e))
    w.add_tensor(f"{blk}.attn_output.weight", _weight(rng, e, e, spec.weight_dtype))
    w.add_tensor(f"{blk}.attn_output.bias", _bias(rng, e))
    w.add_tensor(f"{blk}.ffn_norm.weight", _norm(rng, e))
    w.add_tensor(f"{blk}.ffn_norm.bias", _bias(rng, e))
    w.add_tensor(f"{blk}.ffn_up.weight", _weight(rng, spec.n_ff, e, spec.weight_dtype))
    w.add_tensor(f"{blk}.ffn_up.bias", _bias(rng, spec.n_ff))
    w.add_tensor(f"{blk}.ffn_down.weight", _weight(rng, e, spec.n_ff, spec.weight_dtype))
    w.add_tensor(f"{blk}.ffn_down.bias", _bias(rng, e))


def owned_tensors(reader: gguf.GGUFReader, layers: tuple[int, int]) -> dict[str, int]:
    """Name -> bytes of the tensors a range owns, from the GGUF header alone.

    blk.N.* for N in range; token_embd at the head, and at the tail too when
    there is no output.weight (tied head); output_norm.* and output.* at the tail.
    """
    begin, end = layers
    arch = _arch(reader)
    # the nextn (MTP) blocks after the trunk are not layers a range counts
    nextn = reader.fields.get(f"{arch}.nextn_predict_layers")
    n_layer = int(reader.fields[f"{arch}.block_count"].contents()) - (int(nextn.contents()) if nextn else 0)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    tied = "output.weight" not in sizes
    owned: dict[str, int] = {}
    for name, n_bytes in sizes.items():
        parts = name.split(".")
        if parts[0] == "blk":
            keep = begin <= int(parts[1]) < end
        elif name == "token_embd.weight":
            keep = begin == 0 or (tied and end == n_layer)
        elif parts[0] in ("output_norm", "output"):
            keep = end == n_layer
        else:
            keep = begin == 0 and end == n_layer  # e.g. gpt2's position_embd: only a full load is checked
        if keep:
            owned[name] = n_bytes
    return owned


def _arch(reader: gguf.GGUFReader) -> str:
    return str(reader.fields["general.architecture"].contents())


def split_gguf(source: Path, out: Path, parts: int) -> list[Path]:
    """Writes `source` again as a `parts`-part gguf-split set `out`-0000i-of-0000N.gguf beside `out`
    (the `gguf` package's split writer: the model's metadata in the first part, the split.* keys in
    every part, tensors in file order, as even a count per part as the writer's per-part cap makes);
    returns the parts' paths in order."""
    reader = GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    per_part = -(-len(reader.tensors) // parts)
    w = gguf.GGUFWriter(out, arch, split_max_tensors=per_part)
    for field in reader.fields.values():
        # the writer adds the architecture and the GGUF.* header fields itself
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in reader.tensors:
        w.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    w.close()
    names = w.format_shard_names(out)
    assert len(names) == parts, f"{len(reader.tensors)} tensors made {len(names)} parts, not {parts}"
    return names
