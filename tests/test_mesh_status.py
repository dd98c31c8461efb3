"""The status view (`meshd status`): a pure function of a node's membership view, tested without trio."""

from __future__ import annotations

import pytest
from instant_net import record

from meshd.mesh.election import Tracker
from meshd.mesh.membership import MemberInfo, MemberState
from meshd.mesh.records import ROLE_RELAY, CapabilityRecord, ModelInfo, ServedRange
from meshd.mesh.route_reply import pick_model
from meshd.mesh.status import held_models, status_view
from wire.decode import decode
from wire.errors import ProtocolError
from wire.meshrpc import StatusReply
from wire.message import encode

MODEL = ModelInfo(digest="sha256:m", name="m", n_layers=10, bytes_per_layer=1, kv_bytes_per_token=1)


def served(*ranges: tuple[int, int]) -> list[ServedRange]:
    return [ServedRange(model=MODEL.digest, start=a, end=b) for a, b in ranges]


def info(r: CapabilityRecord, state: MemberState = MemberState.ALIVE) -> MemberInfo:
    return MemberInfo(r.node_id, state, r.version, r, None)


def test_members_states_roles_and_the_tracker() -> None:
    own = record(0, models=[MODEL], served=served((0, 10)))
    relay = record(1, roles=[ROLE_RELAY], reachability="public")
    gone = record(2, memory_bytes=7)
    view = status_view(own.node_id, [info(own), info(relay), info(gone, MemberState.DEAD)], [own, relay],
                       Tracker(3, relay.node_id))
    assert view.node_id == own.node_id and view.tracker == relay.node_id and view.term == 3
    assert [(m.node_id, m.state) for m in view.members] == [
        (own.node_id, "alive"), (relay.node_id, "alive"), (gone.node_id, "dead")]
    assert view.members[1].roles == [ROLE_RELAY, "tracker"] and view.members[0].roles == []
    assert view.members[0].served == [f"{MODEL.digest[:12]} [0, 10)"] and view.members[0].models == ["m"]
    assert view.members[0].address == own.addresses[0] and view.members[2].memory_bytes == 7
    assert status_view(own.node_id, [info(own)], [own], None).tracker is None


def test_coverage_counts_live_serving_layers_and_the_stages_that_repeat_a_range() -> None:
    a = record(1, models=[MODEL], served=served((0, 4)))
    b = record(2, models=[MODEL], served=served((4, 10)))
    # a replica of one range, none of the other: one replica (the whole model's spare copies, 0, were shown)
    c = record(3, models=[MODEL], served=served((0, 4)))
    leaving = record(4, models=[MODEL], served=served((0, 10)), leaving=True)
    dead = record(5, models=[MODEL], served=served((0, 10)))
    members = [info(r) for r in (a, b, c, leaving)] + [info(dead, MemberState.DEAD)]
    (cov,) = status_view(a.node_id, members, [a, b, c, leaving], None).coverage
    assert (cov.model, cov.n_layers, cov.covered_layers, cov.replicas) == (MODEL.digest, 10, 10, 1)
    assert len(cov.assigned) == 3  # neither the leaving nor the dead member counts
    (half,) = status_view(a.node_id, [info(a)], [a], None).coverage
    assert (half.covered_layers, half.replicas) == (4, 0)


def test_a_view_larger_than_a_reply_comes_in_pages_of_whole_records() -> None:
    # 32 served ranges fit a record and a status line. 4100 members: pages of 1024.
    wide = record(1, models=[MODEL], served=[ServedRange(model=f"sha256:{i}", start=0, end=1) for i in range(32)])
    members = [info(wide)] * 4100
    view = status_view(wide.node_id, members, [wide], None)
    assert len(view.members) == 1024 and len(view.members[0].served) == 32 and view.total_members == 4100
    assert view.coverage
    again = decode(encode(view))
    assert isinstance(again, StatusReply) and again == view
    last = status_view(wide.node_id, members, [wide], None, offset=4096)
    assert len(last.members) == 4 and not last.coverage
    assert status_view(wide.node_id, members, [wide], None, offset=5000).members == []


def test_held_models_lists_each_digest_once() -> None:
    other = ModelInfo(digest="sha256:o", name="o", n_layers=2, bytes_per_layer=1, kv_bytes_per_token=1)
    models = held_models([record(1, models=[MODEL]), record(2, models=[MODEL, other]), record(3)])
    assert list(models) == [MODEL.digest, other.digest]


def test_an_ask_names_a_model_by_its_own_name_its_files_or_its_id() -> None:
    """Issue 32: `ask --model` of the file's name (the GGUF's own is rarely the one its user knows)."""
    mine = MODEL.model_copy(update={"file": "SmolLM2-135M-Instruct-Q4_1"})
    other = MODEL.model_copy(update={"digest": "sha256:o", "name": "o"})
    models = {m.digest: m for m in (mine, other)}
    assert pick_model(models, "SmolLM2-135M-Instruct-Q4_1") is mine
    assert pick_model(models, "m") is mine and pick_model(models, "sha256:o") is other
    with pytest.raises(ProtocolError, match=r"^NOT_FOUND: no member holds model ;"):  # no file name told: a blank name names none
        pick_model(models, "")
