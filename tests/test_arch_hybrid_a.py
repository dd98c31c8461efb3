"""qwen35, qwen35moe, kimi-linear, lfm2 and lfm2moe split by layer ranges, bit-identical to the whole model.

Tiny random-weight GGUFs (tests/gguf_hybrid_a.py). Each stage keeps the recurrent states and
the KV cache of its own layers only (native/patches/0011: the range composed into the hybrid
memory's layer filters, the hybrid inputs set only where a stage's graph reads them). Every
architecture is cut into three stages twice, so that one stage holds no attention layer, one
holds no recurrent layer, and cuts fall on both sides of an attention layer:

- qwen35/qwen35moe (attention at 3 and 7, an MTP block after 7): recurrent-only, attention-only,
  mixed; and mixed, recurrent-only, mixed ending right beside the MTP block. A later stage's
  rows get the four interleaved M-RoPE positions a text token has (native/meshengine.cpp).
- kimi-linear (MLA at 3 and 6, layer 0 a dense lead): the dense lead alone, KDA-only, mixed;
  and KDA-only, MLA-only, mixed.
- lfm2 (attention at 2, 5, 6): convolution-only, attention-only, mixed; and mixed,
  convolution-only, attention-only; the sliding-window variant takes the hybrid-iswa memory;
  lfm2moe (two dense lead layers, then experts) is cut right after its dense lead too.

Prompts of one, a few and many tokens, 24 greedy decode steps, logits compared at every step.
llama.cpp's own log of each stage's memories shows the KV cache holding only the stage's
attention layers and no recurrent state allocated where the stage has no recurrent layer.
The MTP block belongs to the tail; meshengine never sets load_mtp, so no stage loads it and each
stage's report is exactly its own blocks and endpoints.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_factory import byte_level_vocab, owned_tensors
from gguf_hybrid_a import LFM2_ATTENTION, kimi_is_attention, qwen35_is_attention, write_kimi_linear, write_lfm2, write_qwen35
from parity import assert_same_logits
from test_engine_arch_parity import NEW_TOKENS, PROMPT_LENGTHS, Run, chain_runs

from meshd.engine import Model

Chain = list[tuple[int, int]]

WRITERS: dict[str, Callable[[Path], Path]] = {
    "qwen35": lambda p: write_qwen35(p, moe=False),
    "qwen35moe": lambda p: write_qwen35(p, moe=True),
    "kimi-linear": write_kimi_linear,
    "lfm2": write_lfm2,
    "lfm2-swa": lambda p: write_lfm2(p, n_swa=4),
    "lfm2moe": lambda p: write_lfm2(p, moe=True),
}
# every architecture this file checks for parity (tests/test_arch_supported.py counts them)
HYBRID_A_ARCHS = ("qwen35", "qwen35moe", "kimi-linear", "lfm2", "lfm2moe")

_QWEN35: list[Chain] = [[(0, 3), (3, 4), (4, 8)], [(0, 4), (4, 6), (6, 8)]]
CHAINS: dict[str, list[Chain]] = {
    "qwen35": _QWEN35,
    "qwen35moe": _QWEN35,
    "kimi-linear": [[(0, 1), (1, 3), (3, 7)], [(0, 3), (3, 4), (4, 7)]],
    "lfm2": [[(0, 2), (2, 3), (3, 7)], [(0, 3), (3, 5), (5, 7)]],
    "lfm2-swa": [[(0, 2), (2, 3), (3, 7)], [(0, 3), (3, 5), (5, 7)]],
    # the first cut falls right after the dense lead (layers 0-1)
    "lfm2moe": [[(0, 2), (2, 3), (3, 7)], [(0, 1), (1, 5), (5, 7)]],
}
CASES = [(name, chain) for name, chains in CHAINS.items() for chain in chains]
ROOT = Path(__file__).resolve().parent.parent
IS_ATTENTION: dict[str, Callable[[int], bool]] = {
    "qwen35": qwen35_is_attention,
    "qwen35moe": qwen35_is_attention,
    "kimi-linear": kimi_is_attention,
    "lfm2": lambda il: il in LFM2_ATTENTION,
    "lfm2-swa": lambda il: il in LFM2_ATTENTION,
    "lfm2moe": lambda il: il in LFM2_ATTENTION,
}
# loads each (path, begin, end) read from stdin and makes its context: the memories log their sizes
MEMORY_PROBE = """
import sys
from pathlib import Path
from meshd.engine import Context, Model
for line in sys.stdin:
    path, begin, end = line.split()
    print(f"=== {path} {begin} {end}", file=sys.stderr, flush=True)
    with Model(Path(path), (int(begin), int(end))) as m:
        Context(m, n_ctx=64).close()
    sys.stderr.flush()
"""


def _case_id(case: tuple[str, Chain]) -> str:
    name, chain = case
    return f"{name}-" + "-".join(str(end) for _, end in chain[:-1])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-hybrid-a")
    return {name: write(root / f"{name}.gguf") for name, write in WRITERS.items()}


def prompts_for(name: str) -> list[list[int]]:
    # random ids, control tokens included: parity must hold for any input
    rng = np.random.default_rng(sorted(WRITERS).index(name) + 2000)
    n_vocab = len(byte_level_vocab()[0])
    return [rng.integers(0, n_vocab, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def whole(models: dict[str, Path]) -> dict[str, list[Run]]:
    return {name: chain_runs(path, None, prompts_for(name)) for name, path in models.items()}


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_a_chain_of_three_matches_the_whole_model(
    case: tuple[str, Chain], models: dict[str, Path], whole: dict[str, list[Run]],
) -> None:
    name, chain = case
    split = chain_runs(models[name], chain, prompts_for(name))
    for p, (a, b) in enumerate(zip(whole[name], split, strict=True)):
        assert len(a.logits) == len(b.logits) == NEW_TOKENS + 1
        for step, (la, lb) in enumerate(zip(a.logits, b.logits, strict=True)):
            assert_same_logits(la, lb, f"prompt {p}, step {step}")
            if step < NEW_TOKENS:
                assert a.tokens[step] == b.tokens[step], f"prompt {p}, step {step}: greedy token differs"


def _owned(reader: gguf.GGUFReader, layers: tuple[int, int], n_layer: int) -> dict[str, int]:
    own = owned_tensors(reader, layers)
    # LFM2's output norm goes by token_embd_norm: it belongs to the tail, beside the head
    for t in reader.tensors:
        if t.name == "token_embd_norm.weight" and layers[1] == n_layer:
            own[t.name] = int(t.n_bytes)
    return own


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_each_stage_loads_its_own_tensors(name: str, models: dict[str, Path]) -> None:
    reader = gguf.GGUFReader(models[name])
    arch = name.split("-swa")[0]
    for chain in CHAINS[name]:
        n_layer = chain[-1][1]
        for layers in chain:
            own = _owned(reader, layers, n_layer)
            with Model(models[name], layers) as m:
                assert (m.report.n_tensors, m.report.n_bytes) == (len(own), sum(own.values())), layers
                assert m.report.arch == arch and m.report.stage_width == 64


@pytest.mark.slow
def test_each_stage_keeps_the_memory_of_its_own_layers(models: dict[str, Path]) -> None:
    """The stage's KV caches (both of the SWA variant's) hold exactly its attention layers; a stage
    without a recurrent layer allocates no recurrent state, one with them does."""
    stages = [(name, layers) for name, chains in CHAINS.items() for chain in chains for layers in chain]
    env = {**os.environ, "MESHD_LLAMA_LOG": "info", "PYTHONPATH": str(ROOT)}
    probe = subprocess.run([sys.executable, "-c", MEMORY_PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                           input="".join(f"{models[n]} {b} {e}\n" for n, (b, e) in stages), timeout=120, check=False)
    assert probe.returncode == 0, probe.stderr[-2000:]
    logs = probe.stderr.split("=== ")[1:]
    assert len(logs) == len(stages)
    for (name, (begin, end)), log in zip(stages, logs, strict=True):
        attention = sum(IS_ATTENTION[name](il) for il in range(begin, end))
        kv_layers = [int(n) for n in re.findall(r"llama_kv_cache: size = .*?cells, +(\d+) layers", log)]
        assert kv_layers and sum(kv_layers) == attention, f"{name} {begin}-{end}: KV layers {kv_layers}"
        has_state = "RS buffer size" in log
        assert has_state == (attention < end - begin), f"{name} {begin}-{end}: recurrent state {has_state}"
