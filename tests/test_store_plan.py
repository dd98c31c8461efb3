"""The fetch planner: sharing chunks between sources, failures, liars, partial sources and timeouts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.store.manifest import Chunk
from meshd.store.plan import Assign, FetchPlan

CHUNKS = [Chunk(i, 100 + 10 * i, 10, bytes(32), f"t{i}") for i in range(12)]


def bitmap(indices: set[int], n: int = len(CHUNKS)) -> bytes:
    out = bytearray(-(-n // 8))
    for i in indices:
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def by_source(assigned: list[Assign]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for a in assigned:
        out.setdefault(a.source, []).append(a.chunk.index)
    return out


def test_two_sources_share_the_chunks_within_their_in_flight_limit() -> None:
    plan = FetchPlan(CHUNKS, in_flight=3)
    plan.add_source("a")
    plan.add_source("b")
    first = by_source(plan.assign(0.0))
    assert first == {"a": [0, 2, 4], "b": [1, 3, 5]}
    assert plan.assign(0.0) == []  # both full
    plan.chunk_verified("a", CHUNKS[0])
    assert plan.assign(0.0) == [Assign("a", CHUNKS[6])]


def test_a_lost_source_has_its_chunks_fetched_elsewhere_and_verified_ones_stay_done() -> None:
    plan = FetchPlan(CHUNKS, in_flight=2)
    plan.add_source("a")
    plan.add_source("b")
    plan.assign(0.0)  # a: 0, 2; b: 1, 3
    plan.chunk_verified("a", CHUNKS[0])
    back = plan.source_lost("a", "link lost")
    assert [c.index for c in back] == [2]
    plan.chunk_verified("b", CHUNKS[1])
    assert by_source(plan.assign(1.0)) == {"b": [2]}
    # b's slot for chunk 2 is freed when its answer comes (below), verified or not.
    # A late answer from the lost source, verified, counts: chunk 2 is not fetched again.
    assert plan.chunk_verified("a", CHUNKS[2])
    assert not plan.chunk_verified("b", CHUNKS[2])
    assert plan.verified == 3
    seen = {0, 1, 2, 3}
    for c in plan.in_flight("b"):
        plan.chunk_verified("b", c)
    assert plan.in_flight("b") == []
    for _ in range(len(CHUNKS)):
        for a in plan.assign(2.0):
            assert a.chunk.index not in seen, "a verified chunk was fetched again"
            seen.add(a.chunk.index)
            plan.chunk_verified(a.source, a.chunk)
    assert plan.done and plan.lost == {"a": "link lost"}


def test_a_source_that_sends_a_bad_chunk_is_never_asked_again() -> None:
    plan = FetchPlan(CHUNKS, in_flight=2)
    plan.add_source("liar")
    plan.add_source("honest")
    plan.assign(0.0)
    back = plan.chunk_bad("liar", CHUNKS[0], "hash mismatch")
    assert sorted(c.index for c in back) == [0, 2]
    assert "hash mismatch" in plan.excluded["liar"]
    plan.add_source("liar")  # it reconnects: still out
    assert plan.sources == ["honest"]
    for c in plan.in_flight("honest"):
        plan.chunk_verified("honest", c)
    for _ in range(len(CHUNKS)):
        for a in plan.assign(0.0):
            assert a.source == "honest"
            plan.chunk_verified(a.source, a.chunk)
    assert plan.done


def test_a_partial_source_is_asked_only_for_what_it_holds_and_a_missing_chunk_goes_elsewhere() -> None:
    plan = FetchPlan(CHUNKS, in_flight=12)
    plan.add_source("part", bitmap({5, 6}))
    assigned = plan.assign(0.0)
    assert by_source(assigned) == {"part": [5, 6]}
    plan.chunk_missing("part", CHUNKS[6])  # it dropped that one meanwhile
    assert plan.assign(0.0) == []
    assert [c.index for c in plan.stuck] == []  # chunk 5 is still in flight
    plan.chunk_verified("part", CHUNKS[5])
    assert 6 in [c.index for c in plan.stuck]
    plan.add_source("whole")
    assert 6 in by_source(plan.assign(0.0))["whole"]


def test_a_source_silent_past_its_deadline_is_lost_and_progress_keeps_a_slow_one() -> None:
    plan = FetchPlan(CHUNKS, in_flight=2, request_timeout=5.0)
    assert plan.next_timer() is None
    plan.add_source("silent")
    plan.add_source("slow")
    plan.assign(10.0)
    assert plan.next_timer() == 15.0
    # The slow one sends a frame now and then: its deadline moves; the silent one's does not.
    plan.progressed("slow", 14.0)
    plan.progressed("slow", 18.0)
    assert plan.handle_timer(14.9) == []
    assert plan.handle_timer(15.0) == ["silent"]
    assert plan.lost["silent"] == "sent nothing for 5 s while owing chunks"
    assert plan.next_timer() == 23.0
    plan.chunk_verified("slow", CHUNKS[1])
    plan.chunk_verified("slow", CHUNKS[3])
    # Nothing in flight: no deadline, however long it stays quiet.
    assert plan.next_timer() is None and plan.handle_timer(1000.0) == []
    assert by_source(plan.assign(1000.0)) == {"slow": [0, 2]}
    assert plan.next_timer() == 1005.0


def test_a_source_lost_before_it_was_added_is_still_named() -> None:
    plan = FetchPlan(CHUNKS)
    plan.source_lost("never", "this node holds no model")
    assert plan.lost == {"never": "this node holds no model"}


def test_with_no_source_left_the_rest_is_stuck() -> None:
    plan = FetchPlan(CHUNKS[:3])
    plan.add_source("a")
    plan.assign(0.0)
    plan.source_lost("a", "gone")
    assert [c.index for c in plan.stuck] == [0, 1, 2]
    assert not plan.done


@settings(max_examples=200)
@given(st.data())
def test_whatever_happens_a_chunk_is_in_flight_once_and_an_honest_source_finishes(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 30))
    chunks = [Chunk(i, 10 * i + 100, 10, bytes(32), None) for i in range(n)]
    limit = data.draw(st.integers(1, 4))
    plan = FetchPlan(chunks, in_flight=limit)
    names = ["s0", "s1", "s2"]
    for name in names:
        plan.add_source(name, bitmap(set(data.draw(st.lists(st.integers(0, n - 1)))), n))
    plan.add_source("honest")
    flying: dict[int, str] = {}
    verified: set[int] = set()
    for _ in range(400):
        if plan.done:
            break
        for a in plan.assign(0.0):
            assert a.chunk.index not in flying and a.chunk.index not in verified
            flying[a.chunk.index] = a.source
        for name in plan.sources:
            assert len(plan.in_flight(name)) <= limit
        if not flying:
            break
        index = data.draw(st.sampled_from(sorted(flying)))
        source = flying.pop(index)
        outcome = "ok" if source == "honest" else data.draw(st.sampled_from(["ok", "missing", "bad", "lost"]))
        if outcome == "ok":
            plan.chunk_verified(source, chunks[index])
            verified.add(index)
        elif outcome == "missing":
            plan.chunk_missing(source, chunks[index])
        else:
            back = plan.chunk_bad(source, chunks[index], "x") if outcome == "bad" else plan.source_lost(source, "x")
            assert index in {c.index for c in back}
            for c in back:
                flying.pop(c.index, None)
            assert source not in flying.values()
    assert plan.done and verified == set(range(n))
