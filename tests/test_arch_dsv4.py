"""DeepSeek V4 (deepseek4): chains of three or more layer ranges give exactly the whole model's logits and tokens.

The tiny random-weight model (tests/gguf_dsv4.py) has four hyper-connection streams
between its layers, hash routing by token id on layers 0-2, a shared expert, both
compressed attentions (ratio 4 with the indexer on layers 1 and 4, ratio 128 on
layer 3) and the sliding window. The cuts fall inside the hash-routed layers, so a
later stage owns some of them and routes by the token ids that ride with the
residual, and right after them.

What native/patches/0009 makes true, and these tests check: a stage boundary carries
hc_mult x n_embd floats per token (the engine reports that width), only the tail
mixes the streams, a stage that owns a hash-routed layer after the head takes the
token ids with the residual rows (and refuses to run without them), and the dsv4 KV
cache holds only the owned layers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio
from attacks import stranger_error
from gguf_dsv4 import DSV4_SPEC, stage_width, write_dsv4_gguf
from gguf_factory import byte_level_vocab, owned_tensors
from localmesh import Served, run_meshd, start_serve, stop_all
from parity import assert_same_logits
from test_engine_arch_parity import N_CTX, NEW_TOKENS, PROMPT_LENGTHS, Run, chain_runs

from meshd.client.ask import AskRequest, AskResult
from meshd.client.chat import ChatRequest
from meshd.client.route import route_at
from meshd.client.session import run_session
from meshd.engine import Context, InvalidInput, Model
from meshd.net.peers import open_peers
from tests.conftest import greedy_chat_reference
from wire.errors import ErrorCode
from wire.identity import NodeIdentity

Chain = list[tuple[int, int]]

# hash-routed layers are 0-2: cuts after 1 and 2 put some of them on a later stage, a cut after 3
# starts a stage right behind them; one chain gives each of three stages one hash-routed layer
CHAINS: list[Chain] = [
    [(0, 1), (1, 3), (3, 6)],
    [(0, 2), (2, 4), (4, 6)],
    [(0, 1), (1, 2), (2, 3), (3, 6)],
]


@pytest.fixture(scope="module")
def dsv4_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dsv4_gguf(tmp_path_factory.mktemp("tiny-dsv4") / "deepseek4.gguf")


def prompts() -> list[list[int]]:
    # random ids, control tokens included: parity must hold for any input
    rng = np.random.default_rng(DSV4_SPEC.seed + 1000)
    n_vocab = len(byte_level_vocab()[0])
    return [rng.integers(0, n_vocab, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def whole_runs(dsv4_model: Path) -> list[Run]:
    return chain_runs(dsv4_model, None, prompts())


def test_every_chain_has_three_stages_and_cuts_inside_the_hash_routed_layers() -> None:
    for chain in CHAINS:
        assert len(chain) >= 3 and chain[0][0] == 0 and chain[-1][1] == DSV4_SPEC.n_layer
        assert all(a[1] == b[0] for a, b in zip(chain, chain[1:], strict=False))
        assert any(0 < begin < DSV4_SPEC.n_hash_layers for begin, _ in chain), chain


@pytest.mark.parametrize("ranges", CHAINS, ids=["-".join(str(e) for _, e in c[:-1]) for c in CHAINS])
def test_chain_of_ranges_matches_whole_model_logits_and_greedy_tokens(
    ranges: Chain, dsv4_model: Path, whole_runs: list[Run],
) -> None:
    split = chain_runs(dsv4_model, ranges, prompts())
    for p, (a, b) in enumerate(zip(whole_runs, split, strict=True)):
        assert len(a.logits) == len(b.logits) == NEW_TOKENS + 1
        for step, (la, lb) in enumerate(zip(a.logits, b.logits, strict=True)):
            assert_same_logits(la, lb, f"prompt {p}, step {step}")
            if step < NEW_TOKENS:
                assert a.tokens[step] == b.tokens[step], f"prompt {p}, step {step}: greedy token differs"


def test_greedy_runs_wander_over_the_vocabulary(whole_runs: list[Run]) -> None:
    # a model stuck on one token would let a broken split pass on tokens alone
    assert max(len(set(r.tokens)) for r in whole_runs) >= 4


@pytest.mark.parametrize("layers", [(0, 6), *CHAINS[0], (2, 4)])
def test_each_stage_reports_its_width_its_token_need_and_loads_exactly_its_tensors(
    layers: tuple[int, int], dsv4_model: Path,
) -> None:
    import gguf

    reader = gguf.GGUFReader(dsv4_model)
    expected = owned_tensors(reader, layers)
    # the hyper-connection head (output_hc_*) mixes the streams at the tail, beside output_norm
    hc_head = {t.name: int(t.n_bytes) for t in reader.tensors if t.name.startswith("output_hc_")}
    assert len(hc_head) == 3
    if layers[1] == DSV4_SPEC.n_layer:
        expected |= hc_head
    else:
        assert not set(hc_head) & set(expected)
    with Model(dsv4_model, layers) as m:
        r = m.report
    assert (r.arch, r.layer_begin, r.layer_end, r.n_embd) == ("deepseek4", *layers, DSV4_SPEC.n_embd)
    assert r.stage_width == stage_width(DSV4_SPEC) == 4 * DSV4_SPEC.n_embd
    assert r.needs_tokens == (0 < layers[0] < DSV4_SPEC.n_hash_layers)
    assert (r.n_tensors, r.n_bytes) == (len(expected), sum(expected.values()))


def test_a_hash_routed_stage_refuses_rows_without_their_token_ids(dsv4_model: Path) -> None:
    rows = np.zeros((2, stage_width(DSV4_SPEC)), dtype=np.float32)
    with Model(dsv4_model, (1, 3)) as m, Context(m, n_ctx=N_CTX, n_threads=1) as ctx:
        with pytest.raises(InvalidInput, match="routes experts by token id"):
            ctx.forward([0, 0], [0, 1], hidden=rows)
        with pytest.raises(InvalidInput, match="outside the vocabulary"):
            ctx.forward([0, 0], [0, 1], tokens=[1, m.report.n_vocab], hidden=rows)
        with pytest.raises(InvalidInput, match=r"needs \(2, 512\)"):
            ctx.forward([0, 0], [0, 1], tokens=[1, 2], hidden=np.zeros((2, DSV4_SPEC.n_embd), dtype=np.float32))
    # right behind the hash-routed layers the ids are not taken: a caller that sends them is told so
    with Model(dsv4_model, (3, 6)) as m, Context(m, n_ctx=N_CTX, n_threads=1) as ctx:
        with pytest.raises(InvalidInput, match="not token ids"):
            ctx.forward([0, 0], [0, 1], tokens=[1, 2], hidden=rows)


def test_the_middle_stage_routes_by_the_ids_it_is_given(dsv4_model: Path) -> None:
    # the ids change which experts layers 1-2 run, so other ids with the same residual give other rows:
    # a stage that ignored them (or read the residual as media) would give the same rows
    prompt = prompts()[1]
    with Model(dsv4_model, (0, 1)) as head_m, Context(head_m, n_ctx=N_CTX, n_threads=1) as head:
        hidden = head.forward(np.zeros(len(prompt), np.int32), np.arange(len(prompt)), tokens=prompt)
    assert hidden.shape == (len(prompt), stage_width(DSV4_SPEC))
    outs = []
    for ids in (prompt, [(t + 1) % head_m.report.n_vocab for t in prompt]):
        with Model(dsv4_model, (1, 3)) as m, Context(m, n_ctx=N_CTX, n_threads=1) as ctx:
            outs.append(ctx.forward(np.zeros(len(prompt), np.int32), np.arange(len(prompt)), tokens=ids,
                                    hidden=hidden))
    assert not np.array_equal(outs[0], outs[1])


# a prompt the tiny model answers at length, without an early end-of-generation token
PIPELINE_PROMPT = "Why is the sky blue?"
PIPELINE_TOKENS = 24
# every ask ends within this, however the pipeline breaks (a bound against hangs, not a speed claim)
ASK_DEADLINE = 120


@pytest.mark.slow  # three daemons and their workers
async def test_three_serve_processes_answer_token_for_token_like_the_whole_model(dsv4_model: Path) -> None:
    want = greedy_chat_reference(dsv4_model, [PIPELINE_PROMPT], PIPELINE_TOKENS)[PIPELINE_PROMPT]
    with Model(dsv4_model) as m:
        want_text = m.detokenize(want)
    stages: list[Served] = []
    try:
        # the middle stage owns hash-routed layers 1-2: the ids ride with every activation to it
        for r in ("0:1", "1:3", "3:6"):
            stages.append(start_serve("--model", str(dsv4_model), "--layers", r, "--threads", "1",
                                      "--max-sessions", "1", "--session-tokens", "128"))
        route = [s.address for s in stages]
        asked = await trio.to_thread.run_sync(lambda: run_meshd(
            "ask", "--route", ",".join(route), "--max-tokens", str(PIPELINE_TOKENS), PIPELINE_PROMPT,
            timeout=ASK_DEADLINE))
        request = AskRequest(chat=ChatRequest(messages=[{"role": "user", "content": PIPELINE_PROMPT}]),
                             max_tokens=PIPELINE_TOKENS)
        async with open_peers(NodeIdentity.generate()) as peers:
            with trio.fail_after(ASK_DEADLINE):
                result = await run_session(peers, route_at(route), request, AskResult())
            # a stranger's session to the hash-routed middle stage that sends it no ids, its activation
            # without the ids, or with an id past the vocabulary: a typed error for that session, and the
            # pipeline answers the same after
            for ids, carry, why in ((None, 0, "the session must send it the token ids"),
                                    (None, 1, "must carry the token ids"), ([1, 300], 1, "outside the vocabulary")):
                err = await stranger_error(peers, stages[1].address, stage_width(DSV4_SPEC), ids, carry)
                assert err.code == ErrorCode.BAD_REQUEST and why in err.message, err
            with trio.fail_after(ASK_DEADLINE):
                again = await run_session(peers, route_at(route), request, AskResult())
    finally:
        stop_all(stages)
    assert len(want) == PIPELINE_TOKENS
    assert result.tokens == want == again.tokens
    assert [(s.layer_begin, s.layer_end) for s in result.route] == [(0, 1), (1, 3), (3, 6)]
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout == want_text + "\n"
    assert f"{len(want)} new tokens" in asked.stderr


