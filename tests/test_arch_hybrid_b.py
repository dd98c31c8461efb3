"""granite-hybrid, nemotron-h (and its MoE), jamba and falcon-h1 split by layer ranges, bit-identical to the whole model.

Each runs on a tiny random-weight GGUF (tests/gguf_hybrid_b.py) cut into three or four
stages where a hybrid is tricky: a stage with no attention layer, one with no recurrent
layer, one (nemotron-h) with only MLP layers, cuts between a recurrent and an attention
layer, a tail just before nemotron-h-moe's MTP block, a head that applies Granite's
embedding scale (which no later stage may apply again). After the prefill and after each
of 16 greedy decode steps the logits must equal the whole model's bit for bit. Each stage
loads only its own tensors, and its KV cache and recurrent states hold only its own
attention and recurrent layers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_factory import byte_level_vocab, owned_tensors
from gguf_hybrid_b import HYBRID_B_SPECS, HybridSpec, write_hybrid_b_gguf
from parity import assert_same_logits

from meshd.engine import Context, Model
from meshd.engine.chain import LocalChain

ROOT = Path(__file__).resolve().parent.parent
# every architecture this file checks for parity (tests/test_arch_supported.py counts them)
HYBRID_B_ARCHS = sorted({s.arch for s in HYBRID_B_SPECS.values()})
# a one-token, a short and a long prefill (longer than the conv kernel and several ubatch rows)
PROMPT_LENGTHS = (1, 9, 40)
DECODE_STEPS = 16
N_CTX = 128

CHAINS = [(name, i) for name, spec in HYBRID_B_SPECS.items() for i in range(len(spec.chains))]
STAGES = sorted({(name, stage) for name, spec in HYBRID_B_SPECS.items() for chain in spec.chains for stage in chain})


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid-b-gguf")
    return {name: write_hybrid_b_gguf(root / f"{name}.gguf", spec) for name, spec in HYBRID_B_SPECS.items()}


def _prompts(spec: HybridSpec) -> list[list[int]]:
    # random ids, control tokens included: parity must hold for any input
    rng = np.random.default_rng(spec.seed)
    n_vocab = len(byte_level_vocab()[0])
    return [rng.integers(0, n_vocab, size=n).tolist() for n in PROMPT_LENGTHS]


def _logits_over_greedy_run(chain: LocalChain, prompt: list[int]) -> list[np.ndarray]:
    """Logits after the prefill, then after each greedy step (argmax: no sampler state to share)."""
    for c in chain.contexts:
        c.clear()
    seen = [chain.forward(prompt, 0)[-1].copy()]
    for step in range(DECODE_STEPS):
        token = int(np.argmax(seen[-1]))
        seen.append(chain.forward([token], len(prompt) + step)[-1].copy())
    return seen


def _runs(path: Path, ranges: list[tuple[int, int]] | None, prompts: list[list[int]]) -> list[list[np.ndarray]]:
    chain = LocalChain(path, ranges, n_ctx=N_CTX, n_threads=1)
    try:
        return [_logits_over_greedy_run(chain, p) for p in prompts]
    finally:
        chain.close()


@cache
def _whole(path: Path, name: str) -> list[list[np.ndarray]]:
    return _runs(path, None, _prompts(HYBRID_B_SPECS[name]))


@pytest.mark.parametrize(("name", "chain_index"), CHAINS, ids=[f"{n}-{i}" for n, i in CHAINS])
def test_a_chain_of_ranges_matches_the_whole_model(models: dict[str, Path], name: str, chain_index: int) -> None:
    spec = HYBRID_B_SPECS[name]
    chain = list(spec.chains[chain_index])
    whole, split = _whole(models[name], name), _runs(models[name], chain, _prompts(spec))
    for p, (want_run, got_run) in enumerate(zip(whole, split, strict=True)):
        # a greedy run that never leaves one token would not exercise the decode path
        assert len({int(np.argmax(x)) for x in want_run}) > 1, f"{name}: prompt {p} decodes a single token"
        for step, (want, got) in enumerate(zip(want_run, got_run, strict=True)):
            assert_same_logits(want, got, f"{name} {chain}: prompt {p}, step {step}")


@pytest.mark.parametrize(("name", "layers"), STAGES, ids=[f"{n}-{a}-{b}" for n, (a, b) in STAGES])
def test_a_stage_loads_its_own_tensors(models: dict[str, Path], name: str, layers: tuple[int, int]) -> None:
    path = models[name]
    own = owned_tensors(gguf.GGUFReader(path), layers)
    with Model(path, layers) as m:
        r = m.report
        assert (r.n_tensors, r.n_bytes) == (len(own), sum(own.values()))
        assert (r.arch, r.stage_width, r.n_layer) == (HYBRID_B_SPECS[name].arch, 64, HYBRID_B_SPECS[name].n_layer)


def _two_sessions(path: Path, ranges: list[tuple[int, int]] | None, prompts: list[list[int]]) -> list[np.ndarray]:
    """Two sessions on one set of stages, as a stage serves them: each prefilled on its own sequence, then
    decoded together, one row of each in every batch. The logits of both rows after each step."""
    models = [Model(path, r) for r in (ranges or [None])]
    contexts = [Context(m, n_ctx=2 * N_CTX, n_seq_max=2, n_threads=1) for m in models]
    try:
        def run(seq: list[int], pos: list[int], tokens: list[int], want: list[bool] | None) -> np.ndarray:
            out = contexts[0].forward(seq, pos, tokens=tokens, want_output=want if len(contexts) == 1 else None)
            for i, ctx in enumerate(contexts[1:], start=2):
                out = ctx.forward(seq, pos, hidden=out, want_output=want if i == len(contexts) else None)
            return out

        last = [run([s] * len(p), list(range(len(p))), p, None)[-1] for s, p in enumerate(prompts)]
        seen = [np.stack(last)]
        for step in range(DECODE_STEPS):
            tokens = [int(np.argmax(row)) for row in seen[-1]]
            seen.append(run([0, 1], [len(p) + step for p in prompts], tokens, [True, True]).copy())
        return seen
    finally:
        for c in contexts:
            c.close()
        for m in models:
            m.close()


@pytest.mark.parametrize("name", list(HYBRID_B_SPECS))
def test_two_sessions_decoded_in_one_batch_match_the_whole_model(models: dict[str, Path], name: str) -> None:
    # each stage's recurrent states and KV cells are per sequence: a batch mixing two must keep them apart
    spec = HYBRID_B_SPECS[name]
    prompts = _prompts(spec)[1:]
    whole, split = _two_sessions(models[name], None, prompts), _two_sessions(models[name], list(spec.chains[0]), prompts)
    for step, (want, got) in enumerate(zip(whole, split, strict=True)):
        assert_same_logits(want, got, f"{name}: step {step}")


# run in a child: llama.cpp's log level is set once per process, and only its info lines say what a memory holds
_MEMORY_PROBE = """
import json, sys
from meshd.engine import Context, Model
for path, begin, end in json.loads(sys.argv[1]):
    print(f"@@ {begin} {end}", file=sys.stderr, flush=True)
    with Model(path, (begin, end)) as m:
        Context(m, n_ctx=512, n_seq_max=128, n_threads=1).close()
"""
_KV_LAYERS = re.compile(r"llama_kv_cache: size = .*?\(\s*\d+ cells,\s*(\d+) layers")
_RS_MIB = re.compile(r"llama_memory_recurrent: size =\s*([\d.]+) MiB")


def _memories(loads: list[tuple[str, int, int]]) -> list[tuple[int, float]]:
    """(KV cache layers, recurrent state MiB) of each load, as llama.cpp reports them at context creation."""
    env = os.environ | {"MESHD_LLAMA_LOG": "info", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, json.dumps(loads)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=True).stderr
    sections = out.split("@@ ")[1:]
    assert len(sections) == len(loads), out[-2000:]
    found = []
    for text in sections:
        kv, rs = _KV_LAYERS.findall(text), _RS_MIB.findall(text)
        assert len(kv) == 1 and len(rs) == 1, text[-2000:]
        found.append((int(kv[0]), float(rs[0])))
    return found


@pytest.mark.slow
def test_each_stage_keeps_the_caches_and_states_of_its_own_layers_only(models: dict[str, Path]) -> None:
    loads: list[tuple[str, int, int]] = []
    expected: list[tuple[str, tuple[int, int], int, int]] = []  # name, layers, attention layers, recurrent layers
    for name, spec in HYBRID_B_SPECS.items():
        kinds = spec.pattern + "A" * spec.n_nextn
        for begin, end in [(0, spec.n_layer), *spec.chains[0]]:
            # the MTP block past the trunk keeps its KV with the tail, as in the whole model
            owned = kinds[begin:end] + (kinds[spec.n_layer:] if end == spec.n_layer else "")
            n_attn = sum(k == "A" for k in owned)
            n_recr = len(owned) if spec.arch == "falcon-h1" else sum(k == "M" for k in owned)
            loads.append((str(models[name]), begin, end))
            expected.append((name, (begin, end), n_attn, n_recr))
    found = _memories(loads)
    whole_state: dict[str, float] = {}
    for (name, layers, n_attn, n_recr), (kv_layers, rs_mib) in zip(expected, found, strict=True):
        spec = HYBRID_B_SPECS[name]
        assert kv_layers == n_attn, f"{name} {layers}: KV cache of {kv_layers} layers, {n_attn} attention layers owned"
        if layers == (0, spec.n_layer):
            whole_state[name] = rs_mib
        # every recurrent layer's state is the same size: a stage's share is its count of them
        n_recr_all = len(spec.pattern) if spec.arch == "falcon-h1" else spec.pattern.count("M")
        want = whole_state[name] * n_recr / n_recr_all
        assert abs(rs_mib - want) <= 0.02, f"{name} {layers}: {rs_mib} MiB of recurrent state, {want:.2f} for {n_recr} layers"
