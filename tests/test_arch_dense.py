"""The dense families (and their MoE siblings): a chain of three layer ranges gives exactly the whole model's logits.

Each architecture runs on a tiny random-weight GGUF (tests/gguf_dense.py) cut where
it is tricky: inside sliding-window patterns, after a dense lead, just before the MTP
layers, right after the head of a model whose head scales the embeddings. After the
prefill and after each of 16 greedy decode steps the logits must equal the whole
model's bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_dense import DENSE_SPECS, DenseSpec, write_dense_gguf
from gguf_factory import byte_level_vocab, owned_tensors
from parity import assert_same_logits

from meshd.engine import Model, UnsupportedModel
from meshd.engine.chain import LocalChain

ROOT = Path(__file__).resolve().parent.parent
# a one-token, a shorter-than-the-window and a longer-than-the-window prefill
PROMPT_LENGTHS = (1, 5, 30)
DECODE_STEPS = 16
N_CTX = 96


@pytest.fixture(scope="module")
def dense_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dense-gguf")
    return {name: write_dense_gguf(root / f"{name}.gguf", spec) for name, spec in DENSE_SPECS.items()}


def _prompts(spec: DenseSpec) -> list[list[int]]:
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


@pytest.mark.parametrize("name", list(DENSE_SPECS))
def test_three_stage_chain_gives_the_whole_models_logits(name: str, dense_models: dict[str, Path]) -> None:
    spec = DENSE_SPECS[name]
    assert len(spec.chain) >= 3 and spec.chain[0][0] == 0 and spec.chain[-1][1] == spec.n_layer
    prompts = _prompts(spec)
    whole = _runs(dense_models[name], None, prompts)
    split = _runs(dense_models[name], list(spec.chain), prompts)
    for p, (a, b) in enumerate(zip(whole, split, strict=True)):
        for step, (la, lb) in enumerate(zip(a, b, strict=True)):
            assert_same_logits(la, lb, f"{name}, prompt {p}, step {step}")


# tensors outside any block that every layer's graph references: each stage holds its own copy
SHARED_BY_EVERY_STAGE = {"rope_factors_long.weight", "rope_factors_short.weight"}


@pytest.mark.parametrize("name", [n for n, s in DENSE_SPECS.items() if not s.n_nextn])  # nextn: its own test
def test_each_stage_loads_exactly_its_own_tensors(name: str, dense_models: dict[str, Path]) -> None:
    spec = DENSE_SPECS[name]
    reader = gguf.GGUFReader(dense_models[name])
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    shared = {n: sizes[n] for n in SHARED_BY_EVERY_STAGE if n in sizes}
    for begin, end in spec.chain:
        want = owned_tensors(reader, (begin, end)) | shared
        with Model(dense_models[name], (begin, end)) as m:
            r = m.report
        assert (r.arch, r.n_layer, r.layer_begin, r.layer_end) == (name, spec.n_layer, begin, end)
        assert (r.has_input, r.has_output) == (begin == 0, end == spec.n_layer)
        assert (r.n_tensors, r.n_bytes) == (len(want), sum(want.values())), f"[{begin}, {end}): {sorted(want)}"


def test_mtp_layers_are_owned_by_no_stage_as_the_whole_model_runs_none(dense_models: dict[str, Path]) -> None:
    # exaone4's nextn layer sits after the trunk; llama.cpp never runs it, whole or split, so the
    # tail loads the trunk's last layer and the head, not the MTP layer's tensors
    spec = DENSE_SPECS["exaone4"]
    path = dense_models["exaone4"]
    reader = gguf.GGUFReader(path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    mtp = [n for n in sizes if n.startswith(f"blk.{spec.n_layer}.")]
    assert any(".nextn." in n for n in mtp)
    begin = spec.chain[-1][0]
    want = [n for n in sizes if n.startswith("blk.") and begin <= int(n.split(".")[1]) < spec.n_layer]
    want += ["output_norm.weight", "token_embd.weight"]  # tied head
    with Model(path, (begin, spec.n_layer)) as m:
        r = m.report
    assert (r.n_layer, r.layer_end, r.has_output) == (spec.n_layer, spec.n_layer, True)
    assert (r.n_tensors, r.n_bytes) == (len(want), sum(sizes[n] for n in want))


def test_granite_with_deepstack_inputs_refuses_a_partial_range_by_name(tmp_path: Path) -> None:
    # the vision variant adds slices of the input embedding in later layers: a stage after the
    # head has only the residual, so it could not compute them
    path = write_dense_gguf(tmp_path / "granite-deepstack.gguf", DENSE_SPECS["granite"],
                            extra_kv={"deepstack_mapping": [0, 1, -1, -1, -1, -1]})
    for layers in ((0, 3), (3, 6)):
        with pytest.raises(UnsupportedModel, match=r"'granite' with deepstack \(vision\) inputs"):
            Model(path, layers)
    with Model(path) as m:
        assert (m.report.layer_begin, m.report.layer_end) == (0, 6)


def test_the_tracker_plans_the_trunk_without_the_mtp_layers(dense_models: dict[str, Path]) -> None:
    # block_count counts the nextn layer; a plan over it would hand the tail a range the engine refuses
    from meshd.stage.model_file import describe_model

    spec = DENSE_SPECS["exaone4"]
    path = dense_models["exaone4"]
    info = describe_model(path, "exaone4")
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    trunk = sum(v for n, v in sizes.items() if n.startswith("blk.") and int(n.split(".")[1]) < spec.n_layer)
    assert info.n_layers == spec.n_layer
    assert info.bytes_per_layer == -(-trunk // spec.n_layer)
    with Model(path, (spec.chain[-1][0], info.n_layers)) as m:
        assert m.report.has_output
