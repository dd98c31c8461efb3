"""`meshd status`: a table within 80 columns however wide the mesh, and JSON with stable keys."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from localmesh import Served, run_meshd, start_join

from meshd.status_table import WIDTH, as_json, clean, columns, render, size
from wire.meshrpc import MemberStatus, ModelCoverage, StatusReply
from wire.swim import MAX_ADDRESSES, MAX_MODELS, MAX_ROLES, MAX_SERVED
from wire.types import MAX_ADDRESS_LEN, MAX_NODE_ID_LEN

KEYS = {"node_id", "tracker", "term", "members", "coverage", "fetches"}
MEMBER_KEYS = {"node_id", "address", "state", "roles", "reachability", "memory_bytes", "served", "models",
               "relay_addresses"}
COVERAGE_KEYS = {"model", "name", "n_layers", "covered_layers", "covered", "replicas", "assigned", "reason",
                 "unverified"}


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
            relay_addresses=[relay[:MAX_ADDRESS_LEN]] * MAX_ADDRESSES if i % 2 else []))
    coverage = [ModelCoverage(
        model="c" * 128, name=("模型" * 200)[:256] if k % 2 else "\x1b[2J\x1b]0;pwned\x07" + "n" * 230,
        n_layers=4096, covered_layers=k, replicas=(1 << 63) - 1,
        assigned=[f"{'a' * 12} [{j}, {j + 4})" for j in range(1024)],
        reason=("the model needs 121 MiB of weights " * 40)[:1024] if k % 2 else "x" * 1024) for k in range(64)]
    return StatusReply(node_id="9" * MAX_NODE_ID_LEN, tracker="8" * MAX_NODE_ID_LEN, term=(1 << 63) - 1,
                       members=members, coverage=coverage)


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
