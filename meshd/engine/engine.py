"""Python face of the range-aware engine: models, contexts and samplers over numpy.

Everything a caller passes is checked here first (dtype, shape, byte length,
token ids, positions, sequence ids, layer range); the native side checks again
and never aborts on what it can check.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshd.engine.devices import check_vulkan_device, device_of
from meshd.engine.native import build_fingerprint, load


class EngineError(Exception):
    """A native call failed; the message is the engine's own."""


class ModelLoadError(EngineError):
    pass


class UnsupportedModel(EngineError):
    pass


class InvalidInput(EngineError, ValueError):
    pass


class KVCacheFull(EngineError):
    pass


def _raise(code: int, what: str) -> None:
    ffi, lib = load()
    message = f"{what}: {ffi.string(lib.me_last_error()).decode(errors='replace')}"
    kinds: dict[int, type[EngineError]] = {
        lib.ME_ERR_INVALID_ARGUMENT: InvalidInput,
        lib.ME_ERR_LOAD: ModelLoadError,
        lib.ME_ERR_UNSUPPORTED: UnsupportedModel,
        lib.ME_ERR_NO_KV_SPACE: KVCacheFull,
    }
    raise kinds.get(code, EngineError)(message)


def _init_once() -> None:
    check_vulkan_device()
    _, lib = load()
    levels = {"none": -1, "error": 0, "warn": 1, "info": 2}
    lib.me_init(levels.get(os.environ.get("MESHD_LLAMA_LOG", "none"), -1))


@dataclass(frozen=True)
class RangeReport:
    """What a loaded model holds, as the engine reports it from the loaded tensors."""

    layer_begin: int
    layer_end: int
    n_layer: int
    has_input: bool
    has_output: bool
    n_tensors: int
    n_bytes: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    arch: str
    # floats per token row between two stages: what a stage after the first takes and one
    # before the last puts out (n_embd for most architectures, wider where the layers carry more)
    stage_width: int
    # the owned layers [begin, end) that the load's --gpu-layers offloads, whether or not the
    # build has a GPU; n_bytes_gpu says what did land in GPU memory
    gpu_layers: tuple[int, int]
    gpu_output: bool
    n_bytes_gpu: int
    # a stage after the first whose layers read token ids (DeepSeek V4's hash-routed layers):
    # it takes the token ids with the residual rows
    needs_tokens: bool = False
    # the numerics it computes with (native.build_fingerprint, and whether layers run on a GPU, whose
    # kernels are not the CPU's): replicas compare bytes only within one
    numerics: str = ""
    # the device its offloaded layers are on, e.g. "Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits))";
    # "" where none are (a CPU-only build, no device found, or --gpu-layers 0)
    device: str = ""

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> RangeReport:
        """The report as a worker's ready message carries it (msgpack turns tuples into lists)."""
        return cls(**{**fields, "gpu_layers": tuple(fields["gpu_layers"])})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def offloaded(self) -> str:
        """What the load put on a GPU and where, e.g. "layers [3, 6) and the output head on Vulkan0
        (llvmpipe (LLVM 15.0.6, 256 bits)), 1.2 MiB"; "" where nothing is."""
        begin, end = self.gpu_layers
        if not self.n_bytes_gpu or (end <= begin and not self.gpu_output):
            return ""
        return f"{self.offload_plan} on {self.device or 'the GPU'}, {self.n_bytes_gpu / 2**20:.1f} MiB"

    @property
    def offload_plan(self) -> str:
        """The owned layers (and head) the load asked to offload, whether or not a GPU took them."""
        begin, end = self.gpu_layers
        return (f"layers [{begin}, {end})" if end > begin else "") + \
            (" and " if end > begin and self.gpu_output else "") + ("the output head" if self.gpu_output else "")

    @property
    def is_head(self) -> bool:
        return self.has_input

    @property
    def is_tail(self) -> bool:
        return self.has_output


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = 0


class Model:
    """A GGUF loaded for layers [begin, end) only; `layers=None` loads the whole model.

    `n_gpu_layers` counts over the owned layers, from the end of the range (at the tail the
    output head is one more, the last); -1 offloads all of them, 0 none.
    """

    def __init__(self, path: str | Path, layers: tuple[int, int | None] | None = None, n_gpu_layers: int = 0) -> None:
        ffi, lib = load()
        _init_once()
        self._ffi, self._lib = ffi, lib
        self._handle = ffi.NULL
        self.path = Path(path)
        begin, end = (0, None) if layers is None else layers
        if not isinstance(begin, int) or (end is not None and not isinstance(end, int)):
            raise InvalidInput(f"layer range must be integers, got {layers!r}")
        if begin < 0:
            raise InvalidInput(f"layer range [{begin}, {end}) starts below 0")
        if end is not None and end <= begin:
            raise InvalidInput(f"layer range [{begin}, {end}) is empty or inverted")
        if not isinstance(n_gpu_layers, int) or n_gpu_layers < -1:
            raise InvalidInput(f"gpu layers must be -1 (all owned layers) or a count from 0, got {n_gpu_layers!r}")
        if not self.path.exists():
            raise ModelLoadError(f"model file not found: {self.path}")
        if not self.path.is_file():
            raise ModelLoadError(f"model path is not a file: {self.path}")
        out = ffi.new("me_model **")
        rc = lib.me_model_load(str(self.path).encode(), begin, -1 if end is None else end, n_gpu_layers, out)
        if rc != lib.ME_OK:
            _raise(rc, f"cannot load {self.path.name}")
        self._handle = out[0]
        info = ffi.new("me_model_info *")
        self._check(lib.me_model_get_info(self._handle, info), "model info")
        dev = ffi.new("me_device_info *")
        self._check(lib.me_model_device(self._handle, dev), "model device")
        offloaded = device_of(ffi, lib, dev) if info.n_bytes_gpu else None
        device = str(offloaded) if offloaded is not None else ""
        self.report = RangeReport(
            layer_begin=info.layer_begin,
            layer_end=info.layer_end,
            n_layer=info.n_layer,
            has_input=bool(info.has_input),
            has_output=bool(info.has_output),
            n_tensors=info.n_tensors,
            n_bytes=info.n_bytes,
            n_embd=info.n_embd,
            n_vocab=info.n_vocab,
            n_ctx_train=info.n_ctx_train,
            arch=ffi.string(info.arch).decode(),
            stage_width=info.stage_width,
            gpu_layers=(info.gpu_layer_begin, info.gpu_layer_end),
            gpu_output=bool(info.gpu_output),
            n_bytes_gpu=info.n_bytes_gpu,
            needs_tokens=bool(info.needs_tokens),
            # the device is told: two GPU stages of one build differ on two GPU models (kernels are
            # tuned per device), and so do ggml's own kernel choices (MESHD_STOCK_KERNELS=1) from the
            # engine's batch-invariant ones; the CPU's are the build's own
            numerics=f"{build_fingerprint()}/{device or 'cpu'}"
                     f"{'/stock-kernels' if device and os.environ.get('MESHD_STOCK_KERNELS') == '1' else ''}",
            device=device,
        )
        want_end = self.report.n_layer if end is None else end
        if (self.report.layer_begin, self.report.layer_end) != (begin, want_end):
            got = (self.report.layer_begin, self.report.layer_end)
            self.close()
            raise ModelLoadError(f"asked for layers [{begin}, {want_end}) but the engine loaded {list(got)}")

    def _check(self, rc: int, what: str) -> None:
        if rc != self._lib.ME_OK:
            _raise(rc, what)

    @property
    def handle(self) -> object:
        if self._handle == self._ffi.NULL:
            raise EngineError("model is closed")
        return self._handle

    def close(self) -> None:
        if self._handle != self._ffi.NULL:
            self._lib.me_model_free(self._handle)
            self._handle = self._ffi.NULL

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fill(self, what: str, ctype: str, capacity: int, call: Callable[[object, int, object], int]) -> list[int] | bytes:
        """The query-size-then-fill idiom: call(buffer, capacity, size_out), growing once if told to."""
        ffi, lib = self._ffi, self._lib
        n = ffi.new("int32_t *")
        while True:
            buf = ffi.new(f"{ctype}[]", capacity)
            rc = call(buf, capacity, n)
            if rc == lib.ME_ERR_BUFFER_TOO_SMALL and n[0] > capacity:
                capacity = n[0]
                continue
            self._check(rc, what)
            filled: list[int] | bytes = ffi.unpack(buf, n[0])
            return filled

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        raw = text.encode()
        return list(self._fill("tokenize", "int32_t", len(raw) + 8, lambda buf, cap, n: self._lib.me_tokenize(
            self.handle, raw, len(raw), add_special, parse_special, buf, cap, n)))

    def detokenize(self, tokens: Sequence[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        ids = self._checked_tokens(tokens)
        arr = self._ffi.new("int32_t[]", ids)
        return bytes(self._fill("detokenize", "char", 8 * len(ids) + 16, lambda buf, cap, n: self._lib.me_detokenize(
            self.handle, arr, len(ids), remove_special, unparse_special, buf, cap, n))).decode(errors="replace")

    def token_piece(self, token: int, special: bool = False) -> bytes:
        self._checked_tokens([token])
        return bytes(self._fill("token piece", "char", 64, lambda buf, cap, n: self._lib.me_token_piece(
            self.handle, token, special, buf, cap, n)))

    def is_eog(self, token: int) -> bool:
        return bool(self._lib.me_token_is_eog(self.handle, token))

    def apply_chat(self, messages: Sequence[dict[str, str]], add_assistant: bool = True) -> str:
        ffi, lib = self._ffi, self._lib
        keep = []  # cffi frees a string once unreferenced; the C call reads them later
        arr = ffi.new("me_chat_message[]", len(messages))
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidInput(f"message {i} needs string 'role' and 'content'")
            role, content = ffi.new("char[]", m["role"].encode()), ffi.new("char[]", m["content"].encode())
            keep += [role, content]
            arr[i].role, arr[i].content = role, content
        capacity = sum(len(m["content"]) + len(m["role"]) for m in messages) * 2 + 256
        text = self._fill("chat template", "char", capacity, lambda buf, cap, n: lib.me_chat_apply(
            self.handle, arr, len(messages), add_assistant, buf, cap, n))
        return bytes(text).decode(errors="replace")

    def chat_info(self) -> dict[str, Any]:
        """The file's chat templates (default and tool-use, "" where none), BOS and EOS pieces, and
        whether the tokenizer adds them: what ``meshd.engine.chat.render`` needs besides the request."""
        text = bytes(self._fill("chat info", "char", 16 << 10, lambda buf, cap, n: self._lib.me_model_chat_info(
            self.handle, buf, cap, n))).decode(errors="replace")
        info: dict[str, Any] = json.loads(text)
        return info

    def _checked_tokens(self, tokens: Sequence[int]) -> list[int]:
        ids = [int(t) for t in tokens]
        bad = [t for t in ids if not 0 <= t < self.report.n_vocab]
        if bad:
            raise InvalidInput(f"token id {bad[0]} is outside the vocabulary [0, {self.report.n_vocab})")
        return ids


class Context:
    """KV state and compute for one model range; sequences 0..n_seq_max-1 own n_ctx / n_seq_max cells each."""

    def __init__(self, model: Model, n_ctx: int = 2048, n_seq_max: int = 1, n_batch: int = 512,
                 n_threads: int | None = None, poll: int = -1) -> None:
        ffi, lib = model._ffi, model._lib
        self._ffi, self._lib, self.model = ffi, lib, model
        self._handle = ffi.NULL
        threads = n_threads or int(os.environ.get("MESHD_THREADS", "0")) or (os.cpu_count() or 1)
        params = ffi.new("me_context_params *", {
            "n_ctx": n_ctx, "n_seq_max": n_seq_max, "n_batch": n_batch, "n_threads": threads, "poll": poll,
        })
        out = ffi.new("me_context **")
        rc = lib.me_context_new(model.handle, params, out)
        if rc != lib.ME_OK:
            _raise(rc, "cannot create context")
        self._handle = out[0]
        self.n_ctx, self.n_seq_max, self.n_batch, self.n_threads = n_ctx, n_seq_max, n_batch, threads
        self.n_ctx_seq = n_ctx // n_seq_max
        report = model.report
        self.width = report.n_vocab if report.has_output else report.stage_width

    def close(self) -> None:
        if self._handle != self._ffi.NULL:
            self._lib.me_context_free(self._handle)
            self._handle = self._ffi.NULL

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def forward(
        self,
        seq_ids: Sequence[int] | np.ndarray,
        positions: Sequence[int] | np.ndarray,
        tokens: Sequence[int] | np.ndarray | None = None,
        hidden: np.ndarray | None = None,
        want_output: Sequence[bool] | np.ndarray | None = None,
    ) -> np.ndarray:
        """Runs rows through the owned layers, in chunks of n_batch.

        Returns the residual of every row (n x stage_width) before the tail, and at
        the tail the logits of the rows in `want_output` (default: the last row).
        """
        if self._handle == self._ffi.NULL:
            raise EngineError("context is closed")
        report = self.model.report
        seq = np.ascontiguousarray(seq_ids, dtype=np.int32).reshape(-1)
        pos = np.ascontiguousarray(positions, dtype=np.int32).reshape(-1)
        n = len(pos)
        if n == 0:
            raise InvalidInput("a batch needs at least one row")
        if len(seq) != n:
            raise InvalidInput(f"{len(seq)} sequence ids for {n} positions")
        if seq.min() < 0 or seq.max() >= self.n_seq_max:
            raise InvalidInput(f"sequence id outside [0, {self.n_seq_max}): {int(seq.min())}..{int(seq.max())}")
        if pos.min() < 0 or pos.max() >= self.n_ctx_seq:
            raise InvalidInput(f"position outside [0, {self.n_ctx_seq}): {int(pos.min())}..{int(pos.max())}")
        tok, emb = self._rows_in(n, tokens, hidden, report)
        if report.has_output:
            want = np.zeros(n, dtype=np.int8)
            if want_output is None:
                want[-1] = 1
            else:
                w = np.asarray(want_output, dtype=bool).reshape(-1)
                if len(w) != n:
                    raise InvalidInput(f"{len(w)} output flags for {n} rows")
                want[:] = w
        else:
            want = np.ones(n, dtype=np.int8)
        rows = np.count_nonzero(want)
        out = np.empty((rows, self.width), dtype=np.float32)
        done = 0
        for start in range(0, n, self.n_batch):
            stop = min(start + self.n_batch, n)
            done += self._forward_chunk(seq[start:stop], pos[start:stop], tok, emb, start, stop, want[start:stop],
                                        out[done:])
        return out

    def _rows_in(self, n: int, tokens: object, hidden: np.ndarray | None,
                 report: RangeReport) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The token ids and the residual rows this stage takes, checked (None where it takes none)."""
        if report.has_input:
            if hidden is not None or tokens is None:
                raise InvalidInput("this stage owns the embeddings: give token ids, not residual rows")
            return self._token_ids(n, tokens, report), None
        if not report.needs_tokens and (tokens is not None or hidden is None):
            raise InvalidInput("this stage starts after layer 0: give residual rows, not token ids")
        if report.needs_tokens and (tokens is None or hidden is None):
            raise InvalidInput("this stage routes experts by token id: give the token ids with the residual rows")
        if not isinstance(hidden, np.ndarray) or hidden.dtype != np.float32:
            raise InvalidInput(f"residual rows must be a float32 array, got {getattr(hidden, 'dtype', type(hidden))}")
        if hidden.shape != (n, report.stage_width):
            raise InvalidInput(f"residual has shape {hidden.shape}, this model needs ({n}, {report.stage_width})")
        tok = self._token_ids(n, tokens, report) if report.needs_tokens else None
        return tok, np.ascontiguousarray(hidden)

    @staticmethod
    def _token_ids(n: int, tokens: object, report: RangeReport) -> np.ndarray:
        tok = np.ascontiguousarray(tokens, dtype=np.int64).reshape(-1)
        if len(tok) != n:
            raise InvalidInput(f"{len(tok)} tokens for {n} positions")
        if tok.min() < 0 or tok.max() >= report.n_vocab:
            bad = int(tok.min()) if tok.min() < 0 else int(tok.max())
            raise InvalidInput(f"token id {bad} is outside the vocabulary [0, {report.n_vocab})")
        return tok.astype(np.int32)

    def _forward_chunk(self, seq: np.ndarray, pos: np.ndarray, tok: np.ndarray | None, emb: np.ndarray | None,
                       start: int, stop: int, want: np.ndarray, out: np.ndarray) -> int:
        ffi, lib = self._ffi, self._lib
        # from_buffer, not ffi.cast of .ctypes.data: a fifth of the cost, on every step
        buf = ffi.from_buffer
        tok_ptr = buf("int32_t[]", tok[start:stop]) if tok is not None else ffi.NULL
        emb_ptr = buf("float[]", emb[start:stop]) if emb is not None else ffi.NULL
        n_rows = ffi.new("int32_t *")
        rc = lib.me_forward(
            self._handle, stop - start, tok_ptr, emb_ptr, buf("int32_t[]", pos), buf("int32_t[]", seq),
            buf("int8_t[]", want), buf("float[]", out), out.size, n_rows,
        )
        if rc != lib.ME_OK:
            _raise(rc, "forward")
        return int(n_rows[0])

    def remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        """Frees positions [p0, p1) of a sequence (p1 < 0: to the end); seq_id < 0: all sequences."""
        if seq_id >= self.n_seq_max:
            raise InvalidInput(f"sequence id {seq_id} is outside [0, {self.n_seq_max})")
        rc = self._lib.me_seq_remove(self._handle, seq_id, p0, p1)
        if rc != self._lib.ME_OK:
            _raise(rc, "remove sequence")

    def clear(self) -> None:
        self.remove(-1)

    def pos_max(self, seq_id: int) -> int:
        out = self._ffi.new("int32_t *")
        rc = self._lib.me_seq_pos_max(self._handle, seq_id, out)
        if rc != self._lib.ME_OK:
            _raise(rc, "sequence position")
        return int(out[0])

    def copy_prefix(self, src: int, dst: int, n_pos: int) -> None:
        """Sequence ``dst`` is cleared, then holds the KV of positions [0, n_pos) of ``src`` (a prefix
        cache's hit); raises UnsupportedModel where a model's memory is more than its cells."""
        rc = self._lib.me_seq_copy(self._handle, src, dst, n_pos)
        if rc != self._lib.ME_OK:
            _raise(rc, "copy a sequence's prefix")


class Sampler:
    """llama.cpp's sampler chain for one session; seeded, so runs repeat."""

    def __init__(self, model: Model, params: SamplingParams = SamplingParams()) -> None:
        ffi, lib = model._ffi, model._lib
        self._ffi, self._lib = ffi, lib
        self.n_vocab = model.report.n_vocab
        self._handle = ffi.NULL
        p = ffi.new("me_sampler_params *", {
            "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
            "min_p": params.min_p, "repeat_penalty": params.repeat_penalty,
            "repeat_last_n": params.repeat_last_n, "seed": params.seed & 0xFFFFFFFF,
        })
        out = ffi.new("me_sampler **")
        rc = lib.me_sampler_new(model.handle, p, out)
        if rc != lib.ME_OK:
            _raise(rc, "sampler")
        self._handle = out[0]
        # me_sampler_new's chain is llama.cpp's greedy sampler alone: see sample()
        self._greedy = params.temperature <= 0 and params.repeat_penalty == 1.0

    def close(self) -> None:
        if self._handle != self._ffi.NULL:
            self._lib.me_sampler_free(self._handle)
            self._handle = self._ffi.NULL

    def __del__(self) -> None:
        self.close()

    def sample(self, logits: np.ndarray) -> int:
        row = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
        if len(row) != self.n_vocab:
            raise InvalidInput(f"logits have {len(row)} entries, the vocabulary {self.n_vocab}")
        if self._greedy and self._handle != self._ffi.NULL:
            # The greedy sampler takes the first of the highest logits, as argmax does, and keeps no state;
            # the chain first copies every logit into a candidate array: 59 µs a token against argmax's 5 µs
            # here (the tail's critical path at decode). A NaN, which argmax would pick, goes to the chain.
            best = int(np.argmax(row))
            if row[best] == row[best]:
                return best
        token = self._ffi.new("int32_t *")
        rc = self._lib.me_sampler_sample(self._handle, self._ffi.from_buffer("float[]", row), len(row), token)
        if rc != self._lib.ME_OK:
            _raise(rc, "sample")
        return int(token[0])

    def accept(self, token: int) -> None:
        rc = self._lib.me_sampler_accept(self._handle, token)
        if rc != self._lib.ME_OK:
            _raise(rc, "accept")

    def set_grammar(self, spec: dict[str, Any]) -> None:
        """Constrains every later pick by a grammar (``meshd.engine.chat``'s spec: GBNF, lazy, triggers,
        preserved tokens, generation prompt); before the first sample."""
        raw = json.dumps(spec).encode()
        rc = self._lib.me_sampler_set_grammar(self._handle, raw)
        if rc != self._lib.ME_OK:
            _raise(rc, "grammar")
        # the greedy shortcut would skip the grammar's mask
        self._greedy = False

    def grammar_accept(self, token: int) -> None:
        """A token generated before (a failover's re-prefill), fed to the grammar alone."""
        rc = self._lib.me_sampler_grammar_accept(self._handle, token)
        if rc != self._lib.ME_OK:
            _raise(rc, "grammar accept")
