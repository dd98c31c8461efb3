"""Seeded sampling under speculation, at the engine worker: drafted rows draw exactly what no drafts draw.

The tail's worker samples a step's rows in order. Where a row's pick is not the
token drafted after it, that session's later rows stay unsampled, so its seeded
sampler (random state and penalty history) is where it would be had the same
tokens come one step at a time. Checked against one-token-at-a-time decoding of
the same seed, in one process with the whole model (tiny random, and default).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshd.engine.engine import Context, Model
from meshd.engine.worker import Worker

PARAMS = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.3, "repeat_last_n": 64,
          "seed": 1234}


@pytest.fixture
def worker(tiny_models: dict[str, Path]) -> Iterator[Worker]:
    model = Model(tiny_models["llama-gqa-tied"], None)
    ctx = Context(model, n_ctx=256, n_seq_max=2, n_batch=64, n_threads=1)
    w = Worker(model, ctx)
    try:
        yield w
    finally:
        for sampler in w.samplers.values():
            sampler.close()
        ctx.close()
        model.close()


def forward(worker: Worker, seq: int, pos: int, tokens: list[int], sample: list[list[int]]) -> list[Any]:
    n = len(tokens)
    want = np.zeros(n, dtype=np.int8)
    want[n - len(sample):] = 1
    reply, _ = worker.handle({
        "op": "forward", "seq": np.full(n, seq, dtype=np.int32).tobytes(),
        "pos": np.arange(pos, pos + n, dtype=np.int32).tobytes(), "tokens": np.asarray(tokens, np.int32).tobytes(),
        "want": want.tobytes(), "sample": sample}, memoryview(b""))
    assert reply["ok"], reply
    return [None if p is None else p[0] for p in reply["picks"]]


def new_sampler(worker: Worker, sid: int, history: list[int]) -> None:
    reply, _ = worker.handle({"op": "sampler_new", "sid": sid, "params": PARAMS, "history": history}, memoryview(b""))
    assert reply["ok"], reply


def one_at_a_time(worker: Worker, seq: int, prompt: list[int], n: int) -> list[int]:
    worker.handle({"op": "remove", "seq": seq}, memoryview(b""))
    new_sampler(worker, seq, prompt)
    (token,) = forward(worker, seq, 0, prompt, [[0, seq]])
    out = [token]
    while len(out) < n:
        (token,) = forward(worker, seq, len(prompt) + len(out) - 1, [out[-1]], [[0, seq]])
        out.append(token)
    return out


def test_rows_after_a_rejected_draft_are_not_sampled_and_the_next_step_draws_as_without_drafts(
        worker: Worker) -> None:
    prompt = [1, 5, 9, 13, 17, 21]
    plain = one_at_a_time(worker, 0, prompt, 8)
    assert len(set(plain)) > 2  # a hot sampler, not a greedy one in disguise

    seq = 1
    worker.handle({"op": "remove", "seq": seq}, memoryview(b""))
    new_sampler(worker, seq, prompt)
    (first,) = forward(worker, seq, 0, prompt, [[0, seq]])
    assert first == plain[0]
    # drafts: the next two right, then a wrong one, then one more (never reached)
    wrong = (plain[3] + 1) % worker.model.report.n_vocab
    drafts = [plain[1], plain[2], wrong, plain[4]]
    rows = [first, *drafts]
    picks = forward(worker, seq, len(prompt), rows,
                    [[i, seq, d] for i, d in enumerate(drafts)] + [[len(drafts), seq]])
    assert picks == [plain[1], plain[2], plain[3], None, None]
    # the rejected rows' KV goes, and the step after the rejection draws what no drafts drew
    at = len(prompt) + 3
    worker.handle({"op": "remove", "seq": seq, "p0": at, "p1": -1}, memoryview(b""))
    got = forward(worker, seq, at, [plain[3]], [[0, seq]])
    assert got == [plain[4]]


def test_all_drafts_accepted_samples_every_row(worker: Worker) -> None:
    prompt = [2, 4, 6, 8]
    plain = one_at_a_time(worker, 0, prompt, 5)
    seq = 1
    worker.handle({"op": "remove", "seq": seq}, memoryview(b""))
    new_sampler(worker, seq, prompt)
    (first,) = forward(worker, seq, 0, prompt, [[0, seq]])
    drafts = plain[1:4]
    picks = forward(worker, seq, len(prompt), [first, *drafts],
                    [[i, seq, d] for i, d in enumerate(drafts)] + [[len(drafts), seq]])
    assert picks == plain[1:5]


def test_one_sessions_rejection_leaves_another_sessions_rows_sampled(worker: Worker) -> None:
    """Two sessions in one call: the first's rejected draft stops only its own sampling."""
    prompt = [3, 7, 11]
    plain = one_at_a_time(worker, 0, prompt, 3)
    for sid in (0, 1):
        worker.handle({"op": "remove", "seq": sid}, memoryview(b""))
        new_sampler(worker, sid, prompt)
        (first,) = forward(worker, sid, 0, prompt, [[0, sid]])
        assert first == plain[0]
    wrong = (plain[1] + 1) % worker.model.report.n_vocab
    n = 2
    reply, _ = worker.handle({
        "op": "forward", "seq": np.array([0, 0, 1, 1], np.int32).tobytes(),
        "pos": np.array([3, 4, 3, 4], np.int32).tobytes(),
        "tokens": np.array([plain[0], wrong, plain[0], plain[1]], np.int32).tobytes(),
        "want": np.ones(2 * n, np.int8).tobytes(),
        "sample": [[0, 0, wrong], [1, 0], [2, 1, plain[1]], [3, 1]]}, memoryview(b""))
    assert reply["ok"], reply
    picks = [None if p is None else p[0] for p in reply["picks"]]
    assert picks == [plain[1], None, plain[1], plain[2]]
