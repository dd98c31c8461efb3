"""`meshd bench`: what this machine would give a mesh for the model it offers, in one screen.

The speed is timed here: the whole model loaded in this process, as a stage's engine runs it, a greedy
decode and a prefill, each divided over the model's layers (the unit the tracker plans with: seconds per
layer). The memory is the tracker's count from the model's header (weights of a layer, its KV at the
session budget, the head's and tail's extra) beside what loading the model took here (resident memory),
and what the memory offered holds.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from meshd.engine import Sampler
from meshd.engine.chain import LocalChain
from meshd.engine.engine import EngineError
from meshd.mesh.assignment import ModelSpec
from meshd.mesh.models import ModelNotFound, default_model_path
from meshd.mesh.records import ModelInfo
from meshd.stage.model_file import describe_model

MIB = 1 << 20
# tokens of the prefill prompt: long enough that the per-call cost is not what is timed
PREFILL_TOKENS = 64
PROMPT = ("A volunteer lends its machine to a mesh that runs one model across many computers; each member "
          "serves a range of the model's layers, and the tracker places the ranges by speed and by memory. ") * 4


@dataclass(frozen=True)
class Timed:
    decode_s: float  # per generated token, the whole model
    prefill_s: float  # per prompt token, the whole model
    tokens: int
    prompt_tokens: int
    loaded_bytes: int  # resident memory that loading the model and its context added to this process


def resident_bytes() -> int:
    """This process's resident memory (VmRSS), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def time_model(path: Path, threads: int, tokens: int, n_ctx: int) -> Timed:
    """Greedy decode and prefill of the whole model at ``path`` in this process (blocking: seconds)."""
    before = resident_bytes()
    chain = LocalChain(path, None, n_ctx=n_ctx, n_threads=threads or None)
    try:
        ids = chain.head.tokenize(PROMPT)[:PREFILL_TOKENS]
        chain.forward(ids[:8], 0)  # first touch of the weights and the compute buffers: not timed
        chain.contexts[0].clear()
        t0 = time.perf_counter()
        logits = chain.forward(ids, 0)
        prefill = (time.perf_counter() - t0) / len(ids)
        loaded = resident_bytes() - before
        sampler = Sampler(chain.head)
        try:
            pos = len(ids)
            t0 = time.perf_counter()
            for _ in range(tokens):
                logits = chain.forward([sampler.sample(logits[-1])], pos)
                pos += 1
            decode = (time.perf_counter() - t0) / tokens
        finally:
            sampler.close()
    finally:
        chain.close()
    return Timed(decode, prefill, tokens, len(ids), loaded)


def layers_held(spec: ModelSpec, memory: int) -> int:
    """The most layers of a middle stage (no head, no tail) that ``memory`` holds, weights and KV."""
    held = 0
    while held < spec.n_layers and spec.weights(0, held + 1) + (held + 1) * spec.kv_bytes_per_layer <= memory:
        held += 1
    return held


def screen(info: ModelInfo, path: Path, spec: ModelSpec, timed: Timed, args: argparse.Namespace) -> str:
    n = info.n_layers
    per_layer = spec.weights(0, n) / n
    whole = spec.stage_bytes(0, n)
    budget = f"{args.max_sessions} × {args.session_tokens} tokens"
    held = layers_held(spec, args.memory)
    if whole <= args.memory:
        offer = f"the whole model ({whole / MIB:.1f} MiB with KV for {budget})"
    elif held:
        offer = f"{held} of {n} layers of a middle stage (a layer is {spec.layer_bytes / MIB:.1f} MiB with its KV)"
    else:
        offer = f"no layer: a layer needs {spec.layer_bytes / MIB:.1f} MiB with KV for {budget}"
    ms = 1000.0
    lines = [
        f"meshd bench: {info.name} ({path.name}), {n} layers, {args.threads or 'all'} thread(s)",
        f"speed   decode {timed.decode_s * ms / n:.3f} ms a layer per token ({timed.decode_s * ms:.1f} ms a token for "
        f"all {n}, {1 / timed.decode_s:.1f} tok/s, {timed.tokens} tokens)",
        f"        prefill {timed.prefill_s * ms / n:.4f} ms a layer per prompt token ({1 / timed.prefill_s:.0f} tok/s, "
        f"{timed.prompt_tokens}-token prompt)",
        f"memory  a layer: {per_layer / MIB:.2f} MiB of weights (largest {info.bytes_per_layer / MIB:.2f}) + "
        f"{spec.kv_bytes_per_layer / MIB:.2f} MiB of KV for {budget}",
        f"        the first stage adds {info.head_bytes / MIB:.1f} MiB (embeddings), the last {info.tail_bytes / MIB:.1f} "
        f"MiB (output head)",
        f"        measured: loading the whole model took {timed.loaded_bytes / MIB:.0f} MiB resident here",
        f"offer   --memory {args.memory / MIB:.0f} MiB holds {offer}",
    ]
    return "\n".join(lines)


async def bench(args: argparse.Namespace) -> int:
    """The `meshd bench` command: ``args.model`` (a checked GGUF, or None for the default model), ``memory``,
    ``threads``, ``max_sessions``, ``session_tokens`` and ``tokens``."""
    path: Path = args.model or default_model_path()
    info = describe_model(path, "bench")
    spec = ModelSpec.from_info(info, args.max_sessions * args.session_tokens)
    try:
        timed = await trio.to_thread.run_sync(time_model, path, args.threads, args.tokens,
                                              PREFILL_TOKENS + args.tokens + 8)
    except EngineError as exc:
        # the engine's word, in the one line a user's mistake gets (an architecture it cannot run, say)
        raise ModelNotFound(f"{path.name} does not run here: {exc}") from None
    print(screen(info, path, spec, timed, args))
    return 0
