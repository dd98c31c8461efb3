"""A chain of layer ranges in one process: the reference the distributed pipeline must match."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshd.engine.engine import Context, Model, Sampler, SamplingParams


def parse_ranges(spec: str) -> list[tuple[int, int]]:
    """'0:10,10:20,20:30' -> [(0, 10), (10, 20), (20, 30)]."""
    ranges = []
    for part in spec.split(","):
        a, sep, b = part.strip().partition(":")
        if not sep or not a.strip().isdigit() or not b.strip().isdigit():
            raise ValueError(f"layer range '{part.strip()}' is not of the form START:END")
        ranges.append((int(a), int(b)))
    return ranges


def even_ranges(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    cuts = [round(i * n_layer / n_stages) for i in range(n_stages + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(n_stages)]


@dataclass
class LocalChain:
    """Stages [r0) -> [r1) -> ... run one after another, residual handed on in f32."""

    path: Path
    ranges: Sequence[tuple[int, int]] | None = None
    n_ctx: int = 2048
    n_threads: int | None = None
    n_batch: int = 512
    # --gpu-layers of each stage (None: 0 for all), so a CPU stage can chain to a GPU one
    gpu_layers: Sequence[int] | None = None
    models: list[Model] = field(init=False)
    contexts: list[Context] = field(init=False)

    def __post_init__(self) -> None:
        specs: list[tuple[int, int] | None] = list(self.ranges) if self.ranges else [None]
        offload = list(self.gpu_layers) if self.gpu_layers is not None else [0] * len(specs)
        if len(offload) != len(specs):
            raise ValueError(f"{len(offload)} gpu layer counts for {len(specs)} stages")
        self.models = [Model(self.path, r, n_gpu_layers=g) for r, g in zip(specs, offload, strict=True)]
        first, last = self.models[0].report, self.models[-1].report
        if not first.has_input or not last.has_output:
            raise ValueError("a chain must start at layer 0 and end at the last layer")
        for a, b in zip(self.models, self.models[1:], strict=False):
            if a.report.layer_end != b.report.layer_begin:
                raise ValueError(
                    f"ranges do not tile the model: [{a.report.layer_begin}, {a.report.layer_end}) "
                    f"then [{b.report.layer_begin}, {b.report.layer_end})"
                )
        self.contexts = [Context(m, n_ctx=self.n_ctx, n_batch=self.n_batch, n_threads=self.n_threads)
                         for m in self.models]

    @property
    def head(self) -> Model:
        return self.models[0]

    def close(self) -> None:
        for c in self.contexts:
            c.close()
        for m in self.models:
            m.close()

    def forward(self, tokens: Sequence[int], start_pos: int, want_all: bool = False,
                after_stage: Callable[[], None] | None = None) -> np.ndarray:
        """Logits of the last row (or of every row with want_all) after all stages; ``after_stage`` is
        called after each stage's call (tools/bench_engine.py waits a link's delay there)."""
        n = len(tokens)
        pos = np.arange(start_pos, start_pos + n, dtype=np.int32)
        seq = np.zeros(n, dtype=np.int32)
        want = np.ones(n, dtype=bool) if want_all else None
        hidden: np.ndarray | None = None
        for i, ctx in enumerate(self.contexts):
            last = i == len(self.contexts) - 1
            if i == 0:
                out = ctx.forward(seq, pos, tokens=tokens, want_output=want if last else None)
            else:
                # a stage whose layers route by token id takes the ids with the residual
                ids = tokens if ctx.model.report.needs_tokens else None
                out = ctx.forward(seq, pos, tokens=ids, hidden=hidden, want_output=want if last else None)
            hidden = out
            if after_stage is not None:
                after_stage()
        assert hidden is not None
        return hidden

    def generate(self, prompt: Sequence[int], max_new: int, params: SamplingParams = SamplingParams(),
                 on_logits: Callable[[np.ndarray], None] | None = None,
                 grammar: dict[str, Any] | None = None) -> Iterator[int]:
        """Yields new tokens until an end-of-generation token or max_new; with ``grammar`` (Sampler.set_grammar's
        spec) every pick obeys it."""
        for c in self.contexts:
            c.clear()
        sampler = Sampler(self.head, params)
        try:
            if grammar is not None:
                sampler.set_grammar(grammar)
            for t in prompt:
                sampler.accept(t)
            logits = self.forward(prompt, 0)
            pos = len(prompt)
            for _ in range(max_new):
                if on_logits:
                    on_logits(logits[-1])
                token = sampler.sample(logits[-1])
                yield token
                if self.head.is_eog(token):
                    return
                logits = self.forward([token], pos)
                pos += 1
        finally:
            sampler.close()
