"""The MoE families and GLM-4: chains of three or more layer ranges give exactly the whole model's logits and tokens.

Tiny random-weight GGUFs (tests/gguf_moe.py) of qwen3moe, qwen2moe with its
gated shared expert, Mixtral-style llama, deepseek2 (MLA with a q LoRA, two
dense-lead layers, shared expert, sigmoid gating with a selection bias, one
nextn block), gpt-oss (sliding window on every other layer, attention sinks,
biased experts), glm4moe (dense lead, shared expert, nextn), glm4 (nextn) and
llama4 (MoE on every second layer, chunked attention with a no-RoPE layer;
a slow case runs past its 8192-token attention chunk and temperature floor).
The cuts sit where each architecture is tricky: right after the dense lead,
on either side of a sliding layer, one layer before the nextn block.

The nextn (MTP) block belongs to the tail (llama_hparams::owns_layer in
native/patches/0004), so a split keeps its MTP head where llama.cpp's
load_mtp asks for it. meshengine never sets load_mtp (nor does it for the
whole model), so here no stage holds those tensors and each stage's report is
exactly its blocks and endpoints, the tail's cut right beside the nextn block.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import trio
from gguf_factory import byte_level_vocab, owned_tensors
from gguf_moe import MOE_SPECS, UNSUPPORTED_MOE_SPEC, write_moe_gguf
from localmesh import Served, run_meshd, start_serve, stop_all
from parity import assert_same_logits
from test_engine_arch_parity import NEW_TOKENS, PROMPT_LENGTHS, Run, chain_runs

from meshd.client.ask import AskRequest, AskResult
from meshd.client.chat import ChatRequest
from meshd.client.route import route_at
from meshd.client.session import run_session
from meshd.engine import Model, Sampler, UnsupportedModel
from meshd.engine.chain import LocalChain
from meshd.net.peers import open_peers
from tests.conftest import greedy_chat_reference
from wire.identity import NodeIdentity

Chain = list[tuple[int, int]]

CHAINS: dict[str, list[Chain]] = {
    "qwen3moe": [[(0, 2), (2, 4), (4, 6)], [(0, 1), (1, 5), (5, 6)]],
    "qwen2moe-shexp": [[(0, 2), (2, 4), (4, 6)], [(0, 1), (1, 5), (5, 6)]],
    "mixtral": [[(0, 2), (2, 4), (4, 6)]],
    # dense lead is layers 0-1: a cut right after it, one inside it; a one-layer tail beside the nextn block
    "deepseek2-mla": [[(0, 2), (2, 4), (4, 6)], [(0, 1), (1, 3), (3, 5), (5, 6)]],
    # even layers slide, odd ones attend fully: stages that start on either kind
    "gpt-oss": [[(0, 1), (1, 3), (3, 6)], [(0, 2), (2, 5), (5, 6)]],
    "glm4moe": [[(0, 1), (1, 4), (4, 6)], [(0, 2), (2, 5), (5, 6)]],
    "glm4": [[(0, 2), (2, 4), (4, 6)], [(0, 1), (1, 5), (5, 6)]],
    # layers 0-2 and 4-5 chunked, 3 full without RoPE; MoE on 1, 3, 5: a head without a no-RoPE layer
    # (so without the temperature input), then the no-RoPE layer as a stage of its own
    "llama4": [[(0, 2), (2, 4), (4, 6)], [(0, 3), (3, 4), (4, 6)]],
}
CASES = [(name, chain) for name, chains in CHAINS.items() for chain in chains]


def _case_id(case: tuple[str, Chain]) -> str:
    name, chain = case
    return f"{name}-" + "-".join(str(end) for _, end in chain[:-1])


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-moe")
    return {name: write_moe_gguf(root / f"{name}.gguf", spec) for name, spec in MOE_SPECS.items()}


def prompts_for(name: str) -> list[list[int]]:
    # random ids, control tokens included: parity must hold for any input
    rng = np.random.default_rng(MOE_SPECS[name].seed + 1000)
    n_vocab = len(byte_level_vocab()[0])
    return [rng.integers(0, n_vocab, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def moe_whole_runs(moe_models: dict[str, Path]) -> dict[str, list[Run]]:
    return {name: chain_runs(path, None, prompts_for(name)) for name, path in moe_models.items()}


def test_every_architecture_has_a_chain_of_at_least_three_stages() -> None:
    assert set(CHAINS) == set(MOE_SPECS)
    for name, chains in CHAINS.items():
        n_layer = MOE_SPECS[name].n_layer
        assert any(len(c) >= 3 for c in chains), name
        for c in chains:
            assert c[0][0] == 0 and c[-1][1] == n_layer, (name, c)
            assert all(a[1] == b[0] for a, b in zip(c, c[1:], strict=False)), (name, c)


@pytest.mark.parametrize(("model_name", "ranges"), CASES, ids=[_case_id(c) for c in CASES])
def test_chain_of_ranges_matches_whole_model_logits_and_greedy_tokens(
    model_name: str, ranges: Chain, moe_models: dict[str, Path], moe_whole_runs: dict[str, list[Run]],
) -> None:
    whole = moe_whole_runs[model_name]
    split = chain_runs(moe_models[model_name], ranges, prompts_for(model_name))
    for p, (a, b) in enumerate(zip(whole, split, strict=True)):
        assert len(a.logits) == len(b.logits) == NEW_TOKENS + 1
        for step, (la, lb) in enumerate(zip(a.logits, b.logits, strict=True)):
            assert_same_logits(la, lb, f"prompt {p}, step {step}")
            if step < NEW_TOKENS:
                assert a.tokens[step] == b.tokens[step], f"prompt {p}, step {step}: greedy token differs"


def test_greedy_runs_wander_over_the_vocabulary(moe_whole_runs: dict[str, list[Run]]) -> None:
    # a model stuck on one token would let a broken split pass on tokens alone
    for name, runs in moe_whole_runs.items():
        assert max(len(set(r.tokens)) for r in runs) >= 4, name


@pytest.mark.parametrize("model_name", list(CHAINS))
def test_each_stage_loads_exactly_its_blocks_and_endpoints(model_name: str, moe_models: dict[str, Path]) -> None:
    path = moe_models[model_name]
    spec = MOE_SPECS[model_name]
    reader = gguf.GGUFReader(path)
    nextn = {t.name for t in reader.tensors if t.name.startswith(f"blk.{spec.n_layer}.")}
    assert bool(nextn) == bool(spec.n_nextn)
    for layers in [(0, spec.n_layer), *CHAINS[model_name][-1]]:
        expected = owned_tensors(reader, layers)
        assert not nextn & set(expected)
        with Model(path, layers) as m:
            r = m.report
        assert (r.arch, r.n_layer, r.layer_begin, r.layer_end) == (spec.arch, spec.n_layer, *layers)
        assert (r.has_input, r.has_output) == (layers[0] == 0, layers[1] == spec.n_layer)
        assert (r.n_tensors, r.n_bytes) == (len(expected), sum(expected.values())), layers


@pytest.mark.parametrize("layers", [(0, 3), (3, 6), (2, 4)], ids=["head", "tail", "middle"])
def test_partial_range_of_an_untested_moe_architecture_is_refused_by_name(
    layers: tuple[int, int], tmp_path: Path,
) -> None:
    path = write_moe_gguf(tmp_path / "deepseek.gguf", UNSUPPORTED_MOE_SPEC)
    with pytest.raises(UnsupportedModel, match="architecture 'deepseek' does not support partial layer ranges"):
        Model(path, layers)
    with Model(path, None) as m:
        assert (m.report.arch, m.report.has_input, m.report.has_output) == ("deepseek", True, True)


@pytest.mark.parametrize("arch", ["glm4", "glm4moe"])
def test_partial_range_of_an_m_rope_vision_variant_is_refused_by_name(arch: str, tmp_path: Path) -> None:
    # a later stage's rows carry one position each, M-RoPE needs four: refused, not misplaced
    spec = dataclasses.replace(MOE_SPECS[arch], rope_sections=(2, 1, 1, 0))
    path = write_moe_gguf(tmp_path / f"{arch}-mrope.gguf", spec)
    with pytest.raises(UnsupportedModel, match=f"architecture '{arch}' with M-RoPE .* does not support partial"):
        Model(path, (2, 4))
    with Model(path, None) as m:
        assert (m.report.arch, m.report.has_input, m.report.has_output) == (arch, True, True)


# a prompt both tiny models answer at length, without an early end-of-generation token
PIPELINE_PROMPT = "What is the capital of France?"
PIPELINE_TOKENS = 24
# every ask ends within this, however the pipeline breaks (a bound against hangs, not a speed claim)
ASK_DEADLINE = 120


@pytest.mark.slow  # three daemons and their workers per model
@pytest.mark.parametrize("model_name", ["qwen3moe", "deepseek2-mla"])
async def test_three_serve_processes_answer_token_for_token_like_the_whole_model(
    model_name: str, moe_models: dict[str, Path],
) -> None:
    path = moe_models[model_name]
    want = greedy_chat_reference(path, [PIPELINE_PROMPT], PIPELINE_TOKENS)[PIPELINE_PROMPT]
    with Model(path) as m:
        want_text = m.detokenize(want)
    stages: list[Served] = []
    try:
        for r in ("0:2", "2:4", "4:6"):
            stages.append(start_serve("--model", str(path), "--layers", r, "--threads", "1",
                                      "--max-sessions", "1", "--session-tokens", "128"))
        route = [s.address for s in stages]
        # the user's path: `meshd ask` prints the answer, then one line of figures
        asked = await trio.to_thread.run_sync(lambda: run_meshd(
            "ask", "--route", ",".join(route), "--max-tokens", str(PIPELINE_TOKENS), PIPELINE_PROMPT,
            timeout=ASK_DEADLINE))
        # the same pipeline token by token: random weights make much of the text U+FFFD, tokens they do not
        request = AskRequest(chat=ChatRequest(messages=[{"role": "user", "content": PIPELINE_PROMPT}]),
                             max_tokens=PIPELINE_TOKENS)
        async with open_peers(NodeIdentity.generate()) as peers:
            with trio.fail_after(ASK_DEADLINE):
                result = await run_session(peers, route_at(route), request, AskResult())
    finally:
        stop_all(stages)
    assert len(want) == PIPELINE_TOKENS
    assert result.tokens == want
    assert [(s.layer_begin, s.layer_end) for s in result.route] == [(0, 2), (2, 4), (4, 6)]
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout == want_text + "\n"
    assert f"{len(want)} new tokens" in asked.stderr


# llama4's attention chunk and temperature floor are fixed at 8192 positions by the loader: only a prompt
# past them reaches the chunk boundary and the temperature step, on both sides of a cut
LLAMA4_LONG_PROMPT = 8200
LLAMA4_LONG_STEPS = 4


@pytest.mark.slow  # a prompt of 8200 tokens through the whole model and through a chain
def test_llama4_chain_matches_whole_model_past_the_attention_chunk(tmp_path: Path) -> None:
    # one head of 8 dims instead of four of 16: the cost is attention over the long prompt (quadratic in it,
    # linear in heads and their width), the shapes stay llama4's
    spec = dataclasses.replace(MOE_SPECS["llama4"], n_head=1, n_head_kv=1, head_dim=8, n_ctx=16384)
    path = write_moe_gguf(tmp_path / "llama4-long.gguf", spec)
    prompt = np.random.default_rng(spec.seed).integers(0, len(byte_level_vocab()[0]), LLAMA4_LONG_PROMPT).tolist()
    runs = []
    for ranges in (None, [(0, 3), (3, 4), (4, 6)]):
        chain = LocalChain(path, ranges, n_ctx=LLAMA4_LONG_PROMPT + 64, n_threads=1)
        sampler = Sampler(chain.head)
        try:
            logits = [chain.forward(prompt, 0)[-1].copy()]
            for step in range(LLAMA4_LONG_STEPS):
                token = sampler.sample(logits[-1])
                logits.append(chain.forward([token], LLAMA4_LONG_PROMPT + step)[-1].copy())
        finally:
            sampler.close()
            chain.close()
        runs.append(logits)
    for step, (a, b) in enumerate(zip(*runs, strict=True)):
        assert_same_logits(a, b, f"step {step}")
