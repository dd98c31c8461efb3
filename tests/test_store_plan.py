"""The fetch planner: sharing chunks between sources, failures, liars, partial sources and timeouts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.store.manifest import Chunk
from meshd.store.plan import COPIES, Assign, FetchPlan

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
    plan.chunk_verified("a", CHUNKS[0], 0.0)
    assert plan.assign(0.0) == [Assign("a", CHUNKS[6])]


def test_a_lost_source_has_its_chunks_fetched_elsewhere_and_verified_ones_stay_done() -> None:
    plan = FetchPlan(CHUNKS, in_flight=2)
    plan.add_source("a")
    plan.add_source("b")
    plan.assign(0.0)  # a: 0, 2; b: 1, 3
    plan.chunk_verified("a", CHUNKS[0], 0.0)
    back = plan.source_lost("a", "link lost")
    assert [c.index for c in back] == [2]
    plan.chunk_verified("b", CHUNKS[1], 0.0)
    assert by_source(plan.assign(1.0)) == {"b": [2]}
    # b's slot for chunk 2 is freed when its answer comes (below), verified or not.
    # A late answer from the lost source, verified, counts: chunk 2 is not fetched again.
    assert plan.chunk_verified("a", CHUNKS[2], 0.0)
    assert not plan.chunk_verified("b", CHUNKS[2], 0.0)
    assert plan.verified == 3
    seen = {0, 1, 2, 3}
    for c in plan.in_flight("b"):
        plan.chunk_verified("b", c, 0.0)
    assert plan.in_flight("b") == []
    for _ in range(len(CHUNKS)):
        for a in plan.assign(2.0):
            assert a.chunk.index not in seen, "a verified chunk was fetched again"
            seen.add(a.chunk.index)
            plan.chunk_verified(a.source, a.chunk, 0.0)
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
        plan.chunk_verified("honest", c, 0.0)
    for _ in range(len(CHUNKS)):
        for a in plan.assign(0.0):
            assert a.source == "honest"
            plan.chunk_verified(a.source, a.chunk, 0.0)
    assert plan.done


def test_a_partial_source_is_asked_only_for_what_it_holds_and_a_missing_chunk_goes_elsewhere() -> None:
    plan = FetchPlan(CHUNKS, in_flight=12)
    plan.add_source("part", bitmap({5, 6}))
    assigned = plan.assign(0.0)
    assert by_source(assigned) == {"part": [5, 6]}
    plan.chunk_missing("part", CHUNKS[6], 0.0)  # it dropped that one meanwhile
    assert plan.assign(0.0) == []
    assert [c.index for c in plan.stuck] == []  # chunk 5 is still in flight
    plan.chunk_verified("part", CHUNKS[5], 0.0)
    assert 6 in [c.index for c in plan.stuck]
    plan.add_source("whole")
    assert 6 in by_source(plan.assign(0.0))["whole"]


def test_a_source_silent_past_its_deadline_is_lost_and_progress_keeps_a_slow_one() -> None:
    # 10-byte chunks at 1 byte a second: 10 s a chunk, past the first 5 s of grace
    plan = FetchPlan(CHUNKS, in_flight=2, request_timeout=5.0, min_rate=1.0)
    assert plan.next_timer() is None
    plan.add_source("silent")
    plan.add_source("slow")
    plan.assign(10.0)
    assert plan.next_timer() == 15.0
    # The slow one sends a frame now and then: its silence deadline moves; the silent one's does not.
    plan.progressed("slow", 14.0, 4)
    plan.progressed("slow", 18.0, 4)
    assert plan.handle_timer(14.9) == []
    assert plan.handle_timer(15.0) == ["silent"]
    assert plan.lost["silent"] == "sent nothing for 5 s while owing chunks"
    assert plan.next_timer() == 23.0
    plan.chunk_verified("slow", CHUNKS[1], 20.0)
    # the next chunk is due from when the last was whole: 5 s of grace and 10 at 1 byte a second
    assert plan.next_timer() == 23.0
    plan.progressed("slow", 22.0, 10)
    assert plan.next_timer() == 27.0
    plan.chunk_verified("slow", CHUNKS[3], 22.0)
    # Nothing in flight: no deadline, however long it stays quiet.
    assert plan.next_timer() is None and plan.handle_timer(1000.0) == []
    assert by_source(plan.assign(1000.0)) == {"slow": [0, 2]}
    assert plan.next_timer() == 1005.0


def test_frames_are_not_progress_a_source_that_delivers_too_slowly_is_lost() -> None:
    # a byte every 4 s keeps the frame deadline (5 s) but not the chunk's: 5 s plus 10 bytes at 1 B/s
    plan = FetchPlan(CHUNKS, in_flight=1, request_timeout=5.0, min_rate=1.0)
    plan.add_source("dribbler")
    plan.assign(0.0)
    for t in range(4, 15, 4):
        plan.progressed("dribbler", float(t), 1)
        assert plan.handle_timer(float(t)) == []
    assert plan.next_timer() == 15.0
    assert plan.handle_timer(15.0) == ["dribbler"]
    assert "did not deliver chunk 0 (10 bytes) within 15 s" in plan.lost["dribbler"]
    assert [c.index for c in plan.stuck] == list(range(len(CHUNKS)))


def test_a_source_slower_than_the_best_by_far_is_asked_one_chunk_at_a_time_and_the_fastest_first() -> None:
    plan = FetchPlan(CHUNKS, in_flight=3)
    plan.add_source("slow")
    plan.add_source("fast")
    assert by_source(plan.assign(0.0)) == {"slow": [0, 2, 4], "fast": [1, 3, 5]}
    for c in (1, 3, 5):
        plan.progressed("fast", 0.1, 10)
        plan.chunk_verified("fast", CHUNKS[c], 0.1)
    plan.progressed("slow", 1.0, 10)
    plan.chunk_verified("slow", CHUNKS[0], 1.0)
    plan.chunk_verified("slow", CHUNKS[2], 1.0)
    # fast: 30 bytes in 0.1 s; slow: 10 bytes in 1 s, 30 times slower: it keeps the one it has
    assert by_source(plan.assign(1.0)) == {"fast": [6, 7, 8]}


def test_the_end_game_asks_a_second_source_for_what_a_slow_one_holds_and_the_first_answer_counts() -> None:
    plan = FetchPlan(CHUNKS[:4], in_flight=2)
    plan.add_source("slow")
    plan.add_source("fast")
    assert by_source(plan.assign(0.0)) == {"slow": [0, 2], "fast": [1, 3]}
    plan.progressed("fast", 0.1, 20)
    plan.chunk_verified("fast", CHUNKS[1], 0.1)
    plan.chunk_verified("fast", CHUNKS[3], 0.1)
    # nothing pending: the idle fast source is asked for the slow one's chunks too, once each
    assert by_source(plan.assign(0.1)) == {"fast": [0, 2]}
    assert plan.assign(0.2) == []
    assert plan.chunk_verified("fast", CHUNKS[2], 0.2)
    # the slow one owes chunk 2 no more: its answer, when it comes, is dropped
    assert [c.index for c in plan.in_flight("slow")] == [0]
    assert not plan.chunk_verified("slow", CHUNKS[2], 0.3)
    # a copy's source lost: the chunk stays with the other, not re-queued
    assert plan.source_lost("fast", "gone") == []
    assert plan.chunk_verified("slow", CHUNKS[0], 0.4)
    assert plan.done


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
def test_whatever_happens_a_chunk_is_in_flight_at_most_twice_and_an_honest_source_finishes(
        data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 30))
    chunks = [Chunk(i, 10 * i + 100, 10, bytes(32), None) for i in range(n)]
    limit = data.draw(st.integers(1, 4))
    plan = FetchPlan(chunks, in_flight=limit)
    names = ["s0", "s1", "s2"]
    for name in names:
        plan.add_source(name, bitmap(set(data.draw(st.lists(st.integers(0, n - 1)))), n))
    plan.add_source("honest")
    flying: set[tuple[int, str]] = set()
    verified: set[int] = set()
    for _ in range(400):
        if plan.done:
            break
        for a in plan.assign(0.0):
            assert a.chunk.index not in verified and (a.chunk.index, a.source) not in flying
            flying.add((a.chunk.index, a.source))
        assert all(sum(1 for i, _ in flying if i == index) <= COPIES for index, _ in flying)
        for name in plan.sources:
            assert len(plan.in_flight(name)) <= limit
        if not flying:
            break
        index, source = data.draw(st.sampled_from(sorted(flying)))
        flying.discard((index, source))
        outcome = "ok" if source == "honest" else data.draw(st.sampled_from(["ok", "missing", "bad", "lost"]))
        if outcome == "ok":
            plan.chunk_verified(source, chunks[index], 0.0)
            verified.add(index)
            # another copy's answer is dropped when it comes: it owes it no more
            flying = {(i, s) for i, s in flying if i != index}
        elif outcome == "missing":
            plan.chunk_missing(source, chunks[index], 0.0)
        else:
            back = plan.chunk_bad(source, chunks[index], "x") if outcome == "bad" else plan.source_lost(source, "x")
            assert {c.index for c in back} <= {index} | {i for i, s in flying if s == source}
            flying = {(i, s) for i, s in flying if s != source}
        assert {(c.index, name) for name in plan.sources for c in plan.in_flight(name)} == \
            {(i, s) for i, s in flying if s in plan.sources}
    assert plan.done and verified == set(range(n))
