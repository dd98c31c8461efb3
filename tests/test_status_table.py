"""`meshd status`: a table within 80 columns however wide the mesh, and JSON with stable keys."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from localmesh import Served, run_meshd, start_join

from meshd.status_table import WIDTH, as_json, clean, columns, render, size
from wire.meshrpc import MAX_SECONDS_PER_LAYER, LinkStatus, MemberStatus, ModelCoverage, StageSpeed, StatusReply
from wire.swim import MAX_ADDRESSES, MAX_MODELS, MAX_ROLES, MAX_SERVED
from wire.types import MAX_ADDRESS_LEN, MAX_NODE_ID_LEN

KEYS = {"node_id", "tracker", "term", "members", "coverage", "fetches", "speeds_by", "speeds", "links",
        "relayed_bytes"}
SPEED_KEYS = {"node_id", "model", "start", "end", "ms_per_layer", "source", "samples", "declared_ms_per_layer"}
MEMBER_KEYS = {"node_id", "address", "state", "roles", "reachability", "memory_bytes", "served", "models",
               "relay_addresses", "offload"}
COVERAGE_KEYS = {"model", "name", "n_layers", "covered_layers", "covered", "replicas", "assigned", "reason",
                 "unverified", "file"}


def node(i: int) -> str:
    return f"{i:040x}"


def small_mesh() -> StatusReply:
    members = [MemberStatus(node_id=node(i), address=f"10.77.0.{i}:7000", state="alive", roles=["volunteer"],
                            reachability="direct", memory_bytes=64 << 20, served=[f"{'d' * 12} [{a}, {b})"],
                            models=["d" * 64]) for i, (a, b) in enumerate([(0, 10), (10, 20), (20, 30)], 1)]
    members.append(MemberStatus(node_id=node(9), address="10.77.0.9:7000", state="suspect", roles=["tracker"],
                                reachability="direct", memory_bytes=0, served=[], models=[]))
    return StatusReply(node_id=node(9), tracker=node(9), term=4, members=members, coverage=[ModelCoverage(
        model="d" * 64, name="SmolLM2 135M", n_layers=30, covered_layers=30, replicas=0,
        assigned=[f"{'1' * 12} [0, 10)", f"{'2' * 12} [10, 20)", f"{'3' * 12} [20, 30)"])])


def wide_mesh() -> StatusReply:
    """Every field at its schema's bound, and names no terminal likes: wide CJK, escapes, no spaces."""
    long_host = "h" * 242 + ".example:65535"
    relay = "r" * 200 + ":7400/p2p-circuit/" + "f" * MAX_NODE_ID_LEN
    members = []
    for i in range(300):
        members.append(MemberStatus(
            node_id=f"{i:0{MAX_NODE_ID_LEN}x}",
            address=[f"[2001:db8:ffff:ffff:ffff:ffff:ffff:{i:04x}]:65535", long_host, "", "1.2.3.4:5"][i % 4],
            state=["alive", "suspect", "dead", "left"][i % 4],
            roles=[("role-" + "x" * 27)[:32]] * (MAX_ROLES + 1) if i % 3 == 0 else ["volunteer", "relay"],
            reachability="nat" if i % 2 else "direct",
            memory_bytes=[(1 << 63) - 1, 0, 9999 << 30, 123][i % 4],
            served=[f"{'e' * 12} [{k}, {k + 1})" for k in range(MAX_SERVED)],
            models=["m" * 256] * MAX_MODELS,
            relay_addresses=[relay[:MAX_ADDRESS_LEN]] * MAX_ADDRESSES if i % 2 else [],
            offload=("\x1b[2Jlayers [0, 4096) on " + "G" * 300)[:256] if i % 5 == 0 else ""))
    coverage = [ModelCoverage(
        model="c" * 128, name=("模型" * 200)[:256] if k % 2 else "\x1b[2J\x1b]0;pwned\x07" + "n" * 230,
        n_layers=4096, covered_layers=k, replicas=(1 << 63) - 1,
        assigned=[f"{'a' * 12} [{j}, {j + 4})" for j in range(1024)],
        reason=("the model needs 121 MiB of weights " * 40)[:1024] if k % 2 else "x" * 1024) for k in range(64)]
    # the first model's ranges with figures at their bounds and a source no terminal likes
    speeds = [StageSpeed(node_id=f"{i:0{MAX_NODE_ID_LEN}x}", model="c" * 128, start=4095 - i, end=4096,
                         seconds_per_layer=[MAX_SECONDS_PER_LAYER, 0.0, 1e-300][i % 3],
                         source=["probe", "default", "\x1b[2J" + "s" * 28][i % 3], samples=(1 << 63) - 1,
                         declared=MAX_SECONDS_PER_LAYER) for i in range(64)]
    return StatusReply(node_id="9" * MAX_NODE_ID_LEN, tracker="8" * MAX_NODE_ID_LEN, term=(1 << 63) - 1,
                       members=members, coverage=coverage, speeds=speeds, speeds_by="7" * MAX_NODE_ID_LEN)


@pytest.fixture(scope="module")
def wide() -> str:
    return render(wide_mesh())


def test_a_wide_mesh_fits_80_columns_on_every_line(wide: str) -> None:
    shown = wide
    lines = shown.splitlines()
    assert len(lines) > 1000
    too_wide = [line for line in lines if columns(line) > WIDTH]
    assert too_wide == []
    # nothing a peer named is dropped for being long: the wrapped text holds all of it
    assert "h" * 242 in shown.replace("\n" + " " * 20, "")
    assert shown.count("behind NAT, reachable via:") == 150


def test_no_escape_sequence_from_a_peer_reaches_the_terminal(wide: str) -> None:
    shown = wide
    assert "\x1b" not in shown and "\x07" not in shown
    assert "?[2J?]0;pwned?" in shown
    assert clean("a\tb\u202ec\u2028d") == "a?b?c?d"


def test_wide_characters_count_two_columns(wide: str) -> None:
    assert columns("模型") == 4 and columns("e\u0301") == 1
    lines = wide.splitlines()
    cjk = [line for line in lines if "模" in line]
    assert cjk and all(columns(line) <= WIDTH for line in cjk)
    assert any(len(line) < columns(line) for line in cjk)


def test_a_small_mesh_reads_as_a_table() -> None:
    lines = render(small_mesh()).splitlines()
    assert lines[0] == f"tracker: {node(9)[:16]} (term 4); 4 members; asked node {node(9)[:16]}"
    header = next(line for line in lines if line.startswith("NODE"))
    assert header.split() == ["NODE", "ADDRESS", "STATE", "MEMORY", "ROLES"]
    row = next(line for line in lines if line.startswith(node(1)[:16]))
    assert row.split() == [node(1)[:16], "10.77.0.1:7000", "alive", "64", "MiB", "volunteer"]
    assert f"serves: {'d' * 12} [0, 10)" in "\n".join(lines)
    assert "model SmolLM2 135M (dddddddddddd): 30/30 layers covered, 0 spare replicas;" in lines
    assert f"  stages: {'1' * 12} [0, 10); {'2' * 12} [10, 20); {'3' * 12} [20, 30)" in lines
    assert not any("not covered" in line for line in lines)


def test_an_uncovered_model_says_why_on_lines_that_wrap() -> None:
    reason = "the model needs 121 MiB of weights + 90 MiB of KV for 4 sessions x 1024 tokens; " \
             "the 3 volunteers offer 3 × 64 MiB: raise --memory to 72M, or lower --max-sessions"
    s = small_mesh().model_copy(update={"coverage": [ModelCoverage(
        model="d" * 64, name="m", n_layers=30, covered_layers=0, replicas=0, assigned=[], reason=reason)]})
    lines = render(s).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  not covered: the model needs"))
    assert lines[at + 1].startswith("    ") and len(lines[at + 1]) <= WIDTH
    assert " ".join(" ".join(lines[at:]).split()) == "not covered: " + reason
    assert "  stages: none yet" in lines


def test_each_stage_shows_the_speed_routes_count_and_where_it_came_from() -> None:
    def speed(i: int, start: int, end: int, seconds: float, source: str, **more: object) -> StageSpeed:
        return StageSpeed.model_validate({"node_id": node(i), "model": "d" * 64, "start": start, "end": end,
                                          "seconds_per_layer": seconds, "source": source, **more})

    s = small_mesh().model_copy(update={"speeds_by": node(9), "speeds": [
        speed(2, 10, 20, 1e-3, "default", declared=1e-9),
        speed(1, 0, 10, 3.14e-4, "probe", samples=8),
        speed(3, 20, 30, 5e-3, "declared", declared=5e-3),
        speed(9, 0, 30, 2e-4, "own"),
    ]})
    lines = render(s).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  RANGE"))
    assert lines[at].split() == ["RANGE", "NODE", "MS/LAYER", "FROM"]
    # by range, then node: the tracker's probe, its own stage, the default for the unmeasured (beside
    # the 1e-9 s/layer the member says), and a member's word against itself
    assert [line.split(None, 4) for line in lines[at + 1:at + 5]] == [
        ["[0,", "10)", node(1)[:16], "0.314", "probe by tracker, median of 8"],
        ["[0,", "30)", node(9)[:16], "0.2", "the tracker's own stage"],
        ["[10,", "20)", node(2)[:16], "1", "unmeasured: default; it says 1e-06"],
        ["[20,", "30)", node(3)[:16], "5", "self-declared (unmeasured)"]]
    assert all(columns(line) <= WIDTH for line in lines)
    # figures some other node counts (the tracker did not answer it) say whose they are
    elsewhere = render(s.model_copy(update={"speeds_by": node(2)}))
    assert f"probe by node {node(2)[:12]}, median of 8" in " ".join(elsewhere.split())  # (on two lines)
    doc = as_json(s)
    assert doc["speeds_by"] == node(9) and all(set(p) == SPEED_KEYS for p in doc["speeds"])
    assert doc["speeds"][0] == {"node_id": node(2), "model": "d" * 64, "start": 10, "end": 20, "ms_per_layer": 1.0,
                                "source": "default", "samples": 0, "declared_ms_per_layer": pytest.approx(1e-6)}
    assert doc["speeds"][3]["declared_ms_per_layer"] is None
    # what real asks saw (meshd.mesh.traffic): the tracker's own asks', or the median of several askers'
    asked = s.model_copy(update={"speeds": [speed(2, 10, 20, 0.05, "traffic", samples=1, declared=1e-9),
                                            speed(1, 0, 10, 0.04, "traffic", samples=3)]})
    shown = " ".join(render(asked).split())
    assert "50 traffic seen by askers, the tracker's own asks; it says 1e-06" in shown
    assert "40 traffic seen by askers, median of 3 askers" in shown
    # a node that predates the figures sends none: no table, nothing else changes
    assert render(small_mesh()) == render(s.model_copy(update={"speeds": []}))


def test_a_member_shows_what_it_offloaded_and_where() -> None:
    reply = small_mesh()
    gpu = "layers [20, 30) and the output head on Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits)), 24.0 MiB"
    reply.members[2] = reply.members[2].model_copy(update={"offload": gpu})
    table = render(reply)
    assert table.count("GPU: ") == 1 and "GPU: layers [20, 30) and the output head on Vulkan0" in table
    assert [m["offload"] for m in as_json(reply)["members"]] == [None, None, gpu, None]


def test_sizes_fit_their_column() -> None:
    assert size(64 << 20) == "64 MiB" and size(9999 << 20) == "9999 MiB" and size(10000 << 20) == "10 GiB"
    assert max(len(size(n)) for n in [0, 1, (1 << 63) - 1, 9999 << 50, 10000 << 50, 123456789]) <= 8


def test_json_has_the_documented_keys_and_round_trips_the_reply() -> None:
    reply = wide_mesh()
    doc = json.loads(json.dumps(as_json(reply)))
    assert set(doc) == KEYS and doc["term"] == reply.term and doc["tracker"] == reply.tracker
    assert all(set(m) == MEMBER_KEYS for m in doc["members"]) and all(set(c) == COVERAGE_KEYS for c in doc["coverage"])
    assert sorted(m["node_id"] for m in doc["members"]) == [m["node_id"] for m in doc["members"]]
    assert doc["members"][2]["address"] is None
    assert doc["coverage"][0]["reason"] == "x" * 1024 and doc["coverage"][0]["covered"] is False
    small = as_json(small_mesh())
    assert small["coverage"][0]["covered"] is True and small["coverage"][0]["reason"] is None


@pytest.fixture(scope="module")
def first_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Path]]:
    state = tmp_path_factory.mktemp("status-node") / "state"
    served = start_join("--no-model", "--state-dir", str(state))
    try:
        yield served, state
    finally:
        served.stop()


@pytest.mark.slow
def test_meshd_status_prints_the_table_and_json_from_a_daemon(first_node: tuple[Served, Path]) -> None:
    served, state = first_node
    table = run_meshd("status", "--state-dir", str(state))
    assert table.returncode == 0, table.stderr
    assert served.node_id[:16] in table.stdout and all(columns(line) <= WIDTH for line in table.stdout.splitlines())
    scripted = run_meshd("status", "--state-dir", str(state), "--json")
    assert scripted.returncode == 0, scripted.stderr
    doc = json.loads(scripted.stdout)
    assert set(doc) == KEYS and doc["node_id"] == served.node_id
    assert [m["node_id"] for m in doc["members"]] == [served.node_id]


def test_the_coverage_figures_stay_whole_however_the_name_wraps() -> None:
    for name in ["m", "Smollm2 135M 8k Lc100K Mix1 Ep2", "a very long model name " * 5, "x" * 200]:
        s = small_mesh().model_copy(update={"coverage": [ModelCoverage(
            model="d" * 64, name=name, n_layers=30, covered_layers=30, replicas=2, assigned=[])]})
        lines = render(s).splitlines()
        assert any("30/30 layers covered, 2 spare replicas;" in line for line in lines), lines


def test_each_link_says_whether_it_is_direct_punched_or_relayed() -> None:
    links = [LinkStatus(node_id=node(1), path="punched", address="203.0.113.7:7100", rtt_ms=12.25),
             LinkStatus(node_id=node(2), path="relayed", address="198.51.100.1:7001/p2p-circuit/" + node(2)),
             LinkStatus(node_id=node(3), path="direct", address="")]
    s = small_mesh().model_copy(update={"links": links, "relayed_bytes": 4096})
    lines = render(s).splitlines()
    at = lines.index(f"links of node {s.node_id[:16]}:")
    assert lines[at + 2].split() == [node(1)[:16], "punched", "12.2", "203.0.113.7:7100"]
    assert lines[at + 3].split()[:3] == [node(2)[:16], "relayed", "-"]
    # a circuit's address goes on below, in its column
    assert "".join(lines[at + 3:at + 5]).replace(" ", "").endswith("/p2p-circuit/" + node(2))
    assert lines[at + 5].split() == [node(3)[:16], "direct", "-", "-"]
    assert "relayed through this node: 4096 bytes" in lines
    assert all(columns(line) <= WIDTH for line in lines)
    doc = as_json(s)
    assert doc["links"][0] == {"node_id": node(1), "path": "punched", "address": "203.0.113.7:7100", "rtt_ms": 12.25}
    assert doc["links"][2]["address"] is None and doc["relayed_bytes"] == 4096
    assert as_json(small_mesh())["links"] == [] and as_json(small_mesh())["relayed_bytes"] is None
