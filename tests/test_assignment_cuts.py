"""A model that may be cut only at some layers (glm-dsa: just before a full-indexer layer).

The cuts come from the file (meshd.mesh.models.allowed_cuts, the engine's rule and
defaults), travel in ModelInfo.cuts, and the tracker places every range with both ends
at an allowed cut or an end of the model: the primary chain, its replicas, the groups of
small nodes covering a segment, and a repair of an older placement. A volunteer too
small for the smallest piece gets none, and the coverage reason says why in one line.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from gguf_dsa import DSA_SPECS, write_dsa_gguf
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from meshd.mesh.assignment import Assignment, CoverageError, ModelSpec, NodeCapacity, Stage
from meshd.mesh.models import ModelNotFound, allowed_cuts, model_info
from meshd.mesh.placement import assign
from meshd.mesh.records import ModelInfo
from meshd.mesh.shortfall import coverage_shortfall
from meshd.stage.model_file import describe_model
from wire.decode import decode
from wire.message import encode
from wire.swim import Alive, Ping

GB = 2**30
CUTS = (2, 5, 7)
# 8 layers of 1 GiB (+ 0.1 GiB of KV each), a 0.5 GiB embedding and output head: the pieces between
# the cuts need 2.7 (head, 0:2), 3.3 (2:5), 2.2 (5:7) and 1.6 GiB (tail, 7:8)
MODEL = ModelSpec("m", 8, GB, kv_bytes_per_layer=GB // 10, head_bytes=GB // 2, tail_bytes=GB // 2, cuts=CUTS)
ENDS = {0, *CUTS, 8}


def node(name: str, memory_gib: float, seconds_per_layer: float = 0.01) -> NodeCapacity:
    return NodeCapacity(name, int(memory_gib * GB), seconds_per_layer)


def check_cut_where_allowed(result: Assignment, nodes: list[NodeCapacity], model: ModelSpec) -> None:
    """Every stage starts and ends at an allowed cut or an end, fits its node, and lies in a segment;
    the chain meets end to end over every layer."""
    memory = {n.node_id: n.memory_bytes for n in nodes}
    ends = {0, *(model.cuts or ()), model.n_layers}
    assert set(result.boundaries) <= ends and result.boundaries[0] == 0 and result.boundaries[-1] == model.n_layers
    assert len({stage.node_id for stage in result.stages}) == len(result.stages)
    for stage in result.stages:
        assert {stage.start, stage.end} <= ends, stage
        assert model.stage_bytes(stage.start, stage.end) <= memory[stage.node_id], stage
        assert any(a <= stage.start < stage.end <= b for a, b in zip(result.boundaries, result.boundaries[1:], strict=False))
    assert [s.start for s in result.chain] == [0] + [s.end for s in result.chain[:-1]]
    assert result.chain[-1].end == model.n_layers


def coverable(nodes: list[NodeCapacity], model: ModelSpec) -> bool:
    """Brute force: some partition of the layers at the allowed cuts whose ranges go to distinct nodes
    that hold them."""
    inner = list(model.cuts or ())
    for k in range(len(inner) + 1):
        for chosen in itertools.combinations(inner, k):
            points = [0, *chosen, model.n_layers]
            if matched(list(zip(points, points[1:], strict=False)), nodes, model):
                return True
    return False


def matched(ranges: list[tuple[int, int]], nodes: list[NodeCapacity], model: ModelSpec) -> bool:
    """Whether each range gets a distinct node that holds it (a bipartite matching, by augmenting paths)."""
    owner: dict[int, int] = {}

    def place(r: int, seen: set[int]) -> bool:
        for j, n in enumerate(nodes):
            if j not in seen and model.stage_bytes(*ranges[r]) <= n.memory_bytes:
                seen.add(j)
                if j not in owner or place(owner[j], seen):
                    owner[j] = r
                    return True
        return False

    return all(place(r, set()) for r in range(len(ranges)))


def test_assorted_volunteers_get_ranges_only_between_allowed_cuts() -> None:
    nodes = [node("a", 3.6, 0.004), node("b", 3.4), node("c", 2.3, 0.02), node("d", 1.7), node("e", 2.9),
             node("f", 9.5, 0.05), node("tiny", 1.2)]
    result = assign(nodes, MODEL)
    check_cut_where_allowed(result, nodes, MODEL)
    assert len(result.chain) >= 3  # no node but the slow one holds more than one piece and its neighbour
    # 1.2 GiB holds no piece (the smallest, the tail's 7:8, takes 1.6 GiB): it gets none
    assert "tiny" not in result.ranges()
    # every other volunteer holds a piece, so each serves one (a replica where the chain has its host)
    assert set(result.ranges()) == {"a", "b", "c", "d", "e", "f"}


def test_without_cuts_the_same_volunteers_are_cut_anywhere() -> None:
    # the control: with every cut allowed the chain search cuts inside the pieces
    nodes = [node("a", 3.6, 0.004), node("b", 3.4), node("c", 2.3, 0.02), node("d", 1.7), node("e", 2.9)]
    free = assign(nodes, ModelSpec("m", 8, GB, kv_bytes_per_layer=GB // 10, head_bytes=GB // 2,
                                   tail_bytes=GB // 2))
    assert not set(free.boundaries) <= ENDS


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0.5, 10.0), st.sampled_from([0.005, 0.01, 0.02])), min_size=1, max_size=6))
def test_any_volunteers_are_placed_at_allowed_cuts_whenever_some_placement_exists(
    volunteers: list[tuple[float, float]],
) -> None:
    nodes = [node(f"n{i}", memory, speed) for i, (memory, speed) in enumerate(volunteers)]
    possible = coverable(nodes, MODEL)
    if not possible:
        with pytest.raises(CoverageError) as refused:
            assign(nodes, MODEL)
        assert "\n" not in str(refused.value) and "cut only before layers 2, 5 and 7" in str(refused.value)
        return
    result = assign(nodes, MODEL)
    check_cut_where_allowed(result, nodes, MODEL)
    assert coverage_shortfall(nodes, MODEL) is None


def test_a_volunteer_too_small_for_the_smallest_piece_gets_none_and_the_reason_says_so() -> None:
    # two 1.5 GiB volunteers would hold a layer each, but the smallest piece (7:8 with the output head) is 1.6 GiB
    reason = coverage_shortfall([node("a", 1.5), node("b", 1.5)], MODEL)
    assert reason is not None and "\n" not in reason
    assert "none of which holds the smallest piece it may be cut into (layers 7:8, 1.6 GiB: " \
        "it may be cut only before layers 2, 5 and 7)" in reason
    # the fix it names is enough
    assert "raise --memory to " in reason
    wanted = reason.split("raise --memory to ")[1].split(" ")[0]
    size = float(wanted[:-1]) * (GB if wanted.endswith("G") else 2**20)
    check_cut_where_allowed(assign([node("a", size / GB), node("b", size / GB)], MODEL),
                            [node("a", size / GB), node("b", size / GB)], MODEL)


def test_a_model_that_may_not_be_cut_goes_whole_to_one_node() -> None:
    whole = ModelSpec("m", 8, GB, head_bytes=GB // 2, tail_bytes=GB // 2, cuts=())
    nodes = [node("a", 9.5), node("b", 5)]
    result = assign(nodes, whole)
    assert result.ranges() == {"a": (0, 8)}
    reason = coverage_shortfall([node("a", 5), node("b", 5)], whole)
    assert reason is not None and "(layers 0:8, 9.0 GiB: it may not be cut)" in reason


def test_small_volunteers_cover_a_segment_together_at_allowed_cuts() -> None:
    big = [node("big", 12, 0.001)]  # holds every layer alone: one segment, [0, 8)
    small = [node(f"s{i}", 3.4, 0.01) for i in range(4)]
    result = assign(big + small, MODEL)
    check_cut_where_allowed(result, big + small, MODEL)
    assert result.boundaries == (0, 8)
    group = [stage for stage in result.stages if stage.node_id != "big"]
    assert group and {stage.start for stage in group} <= ENDS - {8}


def test_an_older_placement_cut_where_the_model_may_not_be_is_replaced() -> None:
    nodes = [node("a", 6), node("b", 6)]
    old = Assignment("m", 8, (0, 4, 8), (Stage("a", 0, 4), Stage("b", 4, 8)), (Stage("a", 0, 4), Stage("b", 4, 8)), 1.0)
    result = assign(nodes, MODEL, current=old)
    check_cut_where_allowed(result, nodes, MODEL)
    assert result.boundaries != (0, 4, 8)


def test_the_spec_takes_the_cuts_from_the_model_info() -> None:
    info = ModelInfo(digest="ab" * 32, name="g", n_layers=8, bytes_per_layer=GB, kv_bytes_per_token=0, cuts=[2, 5, 7])
    assert ModelSpec.from_info(info, 0).cuts == CUTS
    assert ModelSpec.from_info(info.model_copy(update={"cuts": None}), 0).cuts is None
    with pytest.raises(ValueError, match="not ascending layers"):
        ModelSpec("m", 8, GB, cuts=(5, 2))


# ----- ModelInfo.cuts on the wire: bounded and checked

def _info(**fields: object) -> dict[str, object]:
    return {"digest": "ab" * 32, "name": "g", "n_layers": 8, "bytes_per_layer": 1, "kv_bytes_per_token": 0, **fields}


@pytest.mark.parametrize(("cuts", "fragment"), [
    ([0, 2], "greater than or equal to 1"),
    ([2, 8], "outside the 8 layers"),
    ([2, 9000], "less than or equal to 4096"),
    ([-1], "greater than or equal to 1"),
    ([5, 2], "not strictly increasing"),
    ([2, 2], "not strictly increasing"),
    (list(range(1, 4098)), "at most 4096 items"),
    ([2.5], "valid integer"),
    ("2,5", "valid list"),
])
def test_a_hostile_cut_list_is_refused(cuts: object, fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        ModelInfo.model_validate(_info(cuts=cuts))


def test_a_record_carrying_cuts_round_trips_and_a_hostile_one_fails_its_decode() -> None:
    from instant_net import record

    good = record(1, models=[ModelInfo.model_validate(_info(cuts=[2, 5, 7]))])
    ping = Ping(seq=1, version=1, gossip=[Alive(record=good)])
    back = decode(encode(ping))
    assert isinstance(back, Ping) and back.gossip[0].record.models[0].cuts == [2, 5, 7]  # type: ignore[union-attr]
    # the same record with its cut list turned hostile (unsigned bytes on the wire): a typed ProtocolError
    bad = good.model_copy(update={"models": [ModelInfo.model_construct(**_info(cuts=[7, 5]))]})
    from wire.errors import ProtocolError
    with pytest.raises(ProtocolError, match=r"^BAD_REQUEST: invalid swim\.ping v1 message: .*cuts are not strictly increasing"):
        decode(encode(Ping(seq=1, version=1, gossip=[Alive(record=bad)])))


# ----- the cuts come from the file

@pytest.fixture(scope="module")
def dsa_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cuts-dsa")
    return {name: write_dsa_gguf(root / f"{name}.gguf", spec) for name, spec in DSA_SPECS.items()}


def test_the_header_gives_glm_dsa_its_cuts_and_deepseek32_none(dsa_files: dict[str, Path]) -> None:
    glm = describe_model(dsa_files["glm-dsa"], "ab" * 32)
    assert glm.n_layers == 8 and glm.cuts == DSA_SPECS["glm-dsa"].allowed_cuts() == [1, 2, 5, 7]
    assert describe_model(dsa_files["deepseek32"], "cd" * 32).cuts is None


def test_the_header_keeps_only_short_integer_arrays_and_boundedly_many(tmp_path: Path) -> None:
    # a hostile header's arrays: each of up to 512 items is kept while fewer than 16384 items are, none longer,
    # none of floats
    import gguf

    from meshd.store.gguf_header import read_layout

    path = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(path, "llama")
    for i in range(40):
        w.add_array(f"x.many.{i:02}", list(range(500)))
    w.add_array("x.long", list(range(513)))
    w.add_array("x.floats", [0.5, 1.5])
    w.add_array("x.short", [3, 1, 2])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(path, "rb") as f:
        arrays = read_layout(f).arrays
    assert sum(len(v) for v in arrays.values()) <= 1 << 14
    assert arrays["x.many.31"] == tuple(range(500)) and "x.many.32" not in arrays
    assert "x.long" not in arrays and "x.floats" not in arrays
    assert arrays["x.short"] == (3, 1, 2)  # what room the many left is still for short ones


def test_the_cut_rule_follows_the_engine_defaults() -> None:
    meta = {"glm-dsa.context_length": 4096}
    key = "glm-dsa.attention.indexer.types"
    assert allowed_cuts("llama", meta, {key: (1, 0, 0, 1)}, 4) is None
    assert allowed_cuts("glm-dsa", meta, {key: (1, 0, 0, 1, 1)}, 5) == [3, 4]
    assert allowed_cuts("glm-dsa", meta, {key: (1, 1, 1)}, 3) is None  # every layer indexes: cut anywhere
    assert allowed_cuts("glm-dsa", {**meta, key: 0}, {}, 4) == []  # one scalar for every layer
    assert allowed_cuts("glm-dsa", {**meta, key: 1}, {}, 4) is None
    # no indexer types: GLM 5 and 5.1 index every layer, GLM 5.2 (a 2**20 context) on 0, 1 and every 4th from 2
    assert allowed_cuts("glm-dsa", meta, {}, 8) is None
    assert allowed_cuts("glm-dsa", {"glm-dsa.context_length": 1 << 20}, {}, 12) == [1, 2, 6, 10]
    assert allowed_cuts("glm-dsa", {"glm-dsa.context_length": 1 << 20}, {}, 80)[-2:] == [70, 74]  # type: ignore[index]
    with pytest.raises(ValueError, match="has 3 entries for 4 layers"):
        allowed_cuts("glm-dsa", meta, {key: (1, 0, 1)}, 4)


def test_a_glm_dsa_file_whose_indexer_types_do_not_fit_its_layers_is_no_usable_model() -> None:
    metadata = {"general.architecture": "glm-dsa", "glm-dsa.block_count": 4, "glm-dsa.embedding_length": 8,
                "glm-dsa.attention.head_count": 1, "glm-dsa.context_length": 4096}
    with pytest.raises(ModelNotFound, match="x.gguf is not a usable GGUF model .*has 2 entries for 4 layers"):
        model_info("id", "x.gguf", metadata, {}, {"glm-dsa.attention.indexer.types": (1, 1)})
    assert model_info("id", "x.gguf", metadata, {}, {"glm-dsa.attention.indexer.types": (1, 0, 1, 0)}).cuts == [2]


# ----- a real mesh of the tiny glm-dsa: the tracker cuts it where the engine loads it

PROMPT = "What is the capital of France?"
NEW_TOKENS = 16
# At 2 sessions of 512 tokens the chain search counts a layer at 0.2 MiB: 1000K holds 4 layers as the head
# or the tail, 1400K holds 6, neither the whole 8. Cut anywhere, 4:4 would be a chain; at glm-dsa's cuts
# (1, 2, 5 and 7) only 0:5 + 5:8 or 0:2 + 2:8 are.
VOLUNTEERS = [["--memory", "1000K"], ["--memory", "1400K"]]
SESSIONS = ["--threads", "1", "--max-sessions", "2", "--session-tokens", "512"]


@pytest.mark.slow  # a seed, two volunteers and their workers
def test_a_seed_and_two_volunteers_serve_the_tiny_glm_dsa_cut_where_it_may_be_like_the_whole_model(
    dsa_files: dict[str, Path], tmp_path: Path,
) -> None:
    from localmesh import Served, run_meshd, start_join, stop_all

    from meshd.engine import Model
    from tests.conftest import greedy_chat_reference

    path = dsa_files["glm-dsa"]
    want = greedy_chat_reference(path, [PROMPT], NEW_TOKENS)[PROMPT]
    with Model(path) as m:
        want_text = m.detokenize(want)
    nodes: list[Served] = []
    try:
        nodes.append(start_join("--no-model", "--state-dir", str(tmp_path / "seed")))
        # the volunteers start side by side: each waits only for its own ready line
        with ThreadPoolExecutor(len(VOLUNTEERS)) as pool:
            starting = [pool.submit(start_join, "--seed", nodes[0].address, "--model", str(path), "--state-dir",
                                    str(tmp_path / f"v{i}"), *memory, *SESSIONS) for i, memory in enumerate(VOLUNTEERS)]
            for future in starting:
                with contextlib.suppress(RuntimeError):  # one that did not start fails the ask below
                    nodes.append(future.result())
        # `ask --wait` waits for the mesh to cover the model (the volunteers load what the tracker
        # assigns after they are up), then asks along the tracker's chain
        asked = run_meshd("ask", "--seed", nodes[0].address, "--wait", "60", "--max-tokens", str(NEW_TOKENS), PROMPT,
                          timeout=120)
        shown = run_meshd("status", "--seed", nodes[0].address, "--json")
    finally:
        stop_all(nodes)
    assert len(nodes) == 1 + len(VOLUNTEERS)
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout == want_text + "\n"
    served = sorted(r.split(" ", 1)[1] for member in json.loads(shown.stdout)["members"] for r in member["served"])
    assert served in (["[0, 5)", "[5, 8)"], ["[0, 2)", "[2, 8)"]), served


def test_a_volunteer_refuses_a_range_cut_where_its_model_may_not_be() -> None:
    from test_mesh_duty import MODEL as DUTY_MODEL
    from test_mesh_duty import Mesh, duty

    from meshd.mesh.duty_events import LoadRange, RangeRefused
    from wire.meshrpc import AssignmentReply

    cut = DUTY_MODEL.model_copy(update={"cuts": [2, 5, 7]})
    mesh = Mesh(*(duty(i, volunteer=cut) for i in range(2)))
    mesh.answer_asks = False
    mesh.run_until(10.0)
    volunteer = mesh.volunteers[0]
    term = volunteer.node.tracker.term  # type: ignore[union-attr]
    volunteer.assignment_reply(mesh.net.now, AssignmentReply(term=term, model=cut.digest, start=0, end=4))
    mesh.run_until(mesh.net.now + 5.0)
    (refused,) = mesh.of(volunteer, RangeRefused)
    assert refused.reason == "m may be cut only before layers 2, 5, 7" and not mesh.of(volunteer, LoadRange)
    volunteer.assignment_reply(mesh.net.now, AssignmentReply(term=term, model=cut.digest, start=0, end=5))
    mesh.run_until(mesh.net.now + 5.0)
    assert [(load.start, load.end) for load in mesh.of(volunteer, LoadRange)] == [(0, 5)]
