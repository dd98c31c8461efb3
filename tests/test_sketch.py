"""Checks across numerics fingerprints (wire.sketch): a replica's sketch of its output against the route's.

On the GPU lane (tests/gpu_lane.py) with real rows and logits of one range on the CPU and on the GPU
(lavapipe), fed the same input: an honest pair always agrees, and the lies the attack tests tell (a
negated row, a changed token, another position's row, noise at the scale of a real change, a changed
pick) never do. Elsewhere with fake rows (random numbers, named so), for the format and a hostile sketch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshd.engine import Model
from meshd.engine.engine import Context
from wire.errors import ProtocolError
from wire.sketch import PICK_K, ROW_TOLERANCE, pick_sketch, row_sketch, rows_differ, tokens_differ

PROMPT = 12
STEPS = 36


def fake_rows(n: int = 5, width: int = 64, seed: int = 0) -> np.ndarray:
    """Fake rows: random numbers with a few large entries, as a residual's."""
    rows = np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)
    rows[:, 3] *= 40
    return rows


def test_a_row_sketch_holds_each_rows_largest_entries_and_agrees_within_the_tolerance() -> None:
    rows = fake_rows()
    sketch = row_sketch(rows, 16)
    assert len(sketch) == 5 * 16 * 8
    assert rows_differ(rows, sketch) is None
    # another backend's last bits: far inside the tolerance
    assert rows_differ(rows * np.float32(1 + 1e-3), sketch) is None
    moved = rows.copy()
    moved[2, 3] *= 1 + 2 * ROW_TOLERANCE
    assert rows_differ(moved, sketch) == (2, pytest.approx(2 * ROW_TOLERANCE, rel=1e-3))
    assert rows_differ(-rows, sketch) == (0, pytest.approx(2.0))
    # a NaN where the sketch looks is no agreement
    broken = rows.copy()
    broken[4, 3] = np.nan
    assert rows_differ(broken, sketch) is not None and rows_differ(broken, sketch)[0] == 4  # type: ignore[index]


@pytest.mark.parametrize("sketch", [b"", b"\x00" * 7, b"\x00" * (5 * 8 * 65),
                                    # an index past the row, a negative one, a NaN value
                                    np.asarray([[64] + [0] * 15] * 5, np.int32).tobytes()[:5 * 64] + b"\x00" * 5 * 64,
                                    (np.asarray([-1] * 16, np.int32).tobytes() + b"\x00" * 64) * 5,
                                    (np.arange(16, dtype=np.int32).tobytes() + np.full(16, np.nan, np.float32).tobytes()) * 5])
def test_a_sketch_that_does_not_fit_the_rows_is_the_replicas_fault(sketch: bytes) -> None:
    with pytest.raises(ProtocolError):
        rows_differ(fake_rows(), sketch)


def test_a_zero_sketch_is_no_agreement() -> None:
    # 0/0 at every entry: no leave to differ, and no agreement either
    sketch = (np.arange(16, dtype=np.int32).tobytes() + np.zeros(16, np.float32).tobytes()) * 5
    assert rows_differ(fake_rows(), sketch) is not None


def test_a_pick_agrees_with_the_replicas_own_or_a_near_tie_only() -> None:
    likeliest = [(7, -0.5), (9, -0.55), (2, -2.0)]
    sketch = pick_sketch(7, likeliest, scale=1.0)
    assert len(sketch) == 8 * PICK_K + 8
    assert tokens_differ([7], sketch) is None
    # a near tie (0.05 logit scales below): another backend may pick it honestly
    assert tokens_differ([9], sketch) is None
    assert tokens_differ([2], sketch) == (0, "token 2 is 1.5 logit scales below its likeliest (tolerance 0.2)")
    assert tokens_differ([5], sketch) == (0, "token 5 is not among its 8 likeliest (it picked 7)")
    # the same gap on logits of a smaller scale is a lie
    assert tokens_differ([9], pick_sketch(7, likeliest, scale=0.1)) is not None
    two = sketch + pick_sketch(3, [(3, -0.1)], scale=1.0)
    assert tokens_differ([7, 3], two) is None and tokens_differ([7, 4], two)[0] == 1  # type: ignore[index]
    # no rows sampled: nothing to compare, and picks of rows that sampled nothing are the replica's fault
    assert tokens_differ([], b"") is None and tokens_differ([], sketch) is not None
    for bad in (sketch[:-1], sketch + b"\x00" * 8, pick_sketch(7, likeliest, scale=0.0), b"\x00" * 8):
        assert tokens_differ([9], bad) is not None


# ----- real rows: one range on the CPU and on the GPU (lavapipe), the GPU lane's


def run_range(path: Path, layers: tuple[int, int], gpu: int, tokens: np.ndarray | None = None,
              hidden: np.ndarray | None = None) -> np.ndarray:
    """The range's output rows (logits at the tail) for a prompt in one batch, then a decode step a row."""
    with Model(path, layers, n_gpu_layers=gpu) as m, Context(m, n_ctx=256, n_batch=256, n_threads=1) as c:
        n = len(tokens) if tokens is not None else len(hidden)  # type: ignore[arg-type]
        out = []
        for a, b in [(0, PROMPT)] + [(i, i + 1) for i in range(PROMPT, n)]:
            want = np.ones(b - a, bool) if m.report.has_output else None
            out.append(np.array(c.forward(np.zeros(b - a, np.int32), np.arange(a, b, dtype=np.int32),
                                          tokens=None if tokens is None else tokens[a:b],
                                          hidden=None if hidden is None else hidden[a:b], want_output=want)))
        return np.concatenate(out)


def picks_of(logits: np.ndarray) -> bytes:
    """The replica's picks' sketches, as a check session's tail sends them (meshd.engine.worker)."""
    out = []
    for row in logits.astype(np.float64):
        lse = row.max() + np.log(np.exp(row - row.max()).sum())
        best = np.argsort(-row, kind="stable")[:PICK_K]
        out.append(pick_sketch(int(best[0]), [(int(t), float(row[t] - lse)) for t in best], float(row.std())))
    return b"".join(out)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama-gqa-tied", "llama-gqa-untied", "qwen2-bias", "qwen3-qknorm"])
def test_an_honest_cpu_and_gpu_pair_agrees_and_lies_do_not(tiny_models: dict[str, Path], name: str) -> None:
    path = tiny_models[name]
    with Model(path, None) as m:
        n_layer, n_vocab = m.report.n_layer, m.report.n_vocab
    cut = n_layer // 2
    tokens = np.random.default_rng(5).integers(3, n_vocab, PROMPT + STEPS).astype(np.int32)
    cpu, gpu = (run_range(path, (0, cut), g, tokens=tokens) for g in (0, -1))
    assert not np.array_equal(cpu, gpu), "the CPU and the GPU computed the same bytes: nothing to tolerate"
    sketch = row_sketch(gpu)
    assert rows_differ(cpu, sketch) is None
    other = tokens.copy()
    other[20] = (other[20] + 7) % n_vocab
    changed = run_range(path, (0, cut), 0, tokens=other)
    noise = np.random.default_rng(1).standard_normal(cpu.shape).astype(np.float32)
    # noise as far from the row as another position's row is (the smallest real change measured)
    noise *= 0.5 * np.linalg.norm(cpu, axis=1, keepdims=True) / np.linalg.norm(noise, axis=1, keepdims=True)
    for lie, rows, at in (("negated", -cpu, 0), ("a changed token", changed[20:21], 20),
                          ("another position's", np.roll(cpu, 1, 0)[1:], 1), ("noise", cpu + noise, 0)):
        replica = gpu[at:at + len(rows)]
        for k in range(len(rows)):
            assert rows_differ(rows[k:k + 1], row_sketch(replica[k:k + 1])) is not None, (lie, at + k)

    # the tail fed the CPU's rows: its picks agree with the GPU's; a changed pick does not
    logits_cpu, logits_gpu = (run_range(path, (cut, n_layer), g, hidden=cpu) for g in (0, -1))
    picks = picks_of(logits_gpu[PROMPT - 1:])
    route = logits_cpu[PROMPT - 1:].argmax(axis=1).tolist()
    assert tokens_differ(route, picks) is None
    worst = logits_gpu[PROMPT - 1:].argmin(axis=1).tolist()
    for k in range(len(route)):
        assert tokens_differ(route[:k] + [worst[k]] + route[k + 1:], picks) is not None
