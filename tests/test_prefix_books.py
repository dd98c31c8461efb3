"""The prefix cache's books, sans-IO (meshd.stage.prefix, meshd.stage.books): entries per asker, the
longest shared prefix found, least recently used out within the budget, and never a live session's
slot or tokens taken for an entry."""

from __future__ import annotations

import pytest

from meshd.stage.books import LIVE, StageBooks, StageLimits
from meshd.stage.prefix import PrefixCache
from wire.errors import ErrorCode, ProtocolError
from wire.stage import PREFIX_BLOCK, prefix_keys

B = PREFIX_BLOCK


def keys(*blocks: int) -> list[bytes]:
    """Keys of a prompt made of the given blocks (block k: B copies of id k)."""
    return prefix_keys([b for block in blocks for b in [block] * B])


def test_keys_chain_so_equal_keys_mean_equal_prefixes() -> None:
    a, b = keys(1, 2, 3), keys(1, 2, 4)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    # the same block after another prefix is another key
    assert keys(5, 3)[1] != a[2]
    # a partial last block has no key
    assert len(prefix_keys([1] * (2 * B + B - 1))) == 2


def test_the_longest_prefix_of_the_same_asker_is_found() -> None:
    cache = PrefixCache(limit=100 * B)
    assert cache.add("alice", 0, keys(1, 2), now=0) == []
    assert cache.add("alice", 1, keys(1, 3, 4), now=1) == []
    entry, shared = cache.find("alice", keys(1, 3, 4, 5), now=2)
    assert entry is not None and (entry.slot, shared) == (1, 3)
    entry, shared = cache.find("alice", keys(1, 2, 9), now=3)
    assert entry is not None and (entry.slot, shared) == (0, 2)
    # another asker's keys find nothing of alice's, however equal
    assert cache.find("mallory", keys(1, 3, 4), now=4) == (None, 0)
    assert cache.counts.lookups == 3 and cache.counts.hits == 2 and cache.counts.hit_tokens == 5 * B


def test_entries_go_least_recently_used_first_within_the_budget() -> None:
    cache = PrefixCache(limit=4 * B)
    cache.add("a", 0, keys(1, 2), now=0)
    cache.add("a", 1, keys(3), now=1)
    cache.find("a", keys(1), now=2)  # entry 0 is used again: entry 1 is now the oldest
    assert cache.add("a", 2, keys(4, 5), now=3) == [1]
    assert sorted(e.slot for e in cache.entries) == [0, 2] and cache.tokens == 4 * B
    # an entry over the whole budget is not kept at all
    assert cache.add("a", 3, keys(*range(10, 15)), now=4) == [3]
    # a longer prefix of the same asker replaces the entries it covers; a shorter one adds nothing
    assert cache.add("a", 4, keys(1, 2, 6), now=5) == [0, 2]
    assert cache.add("a", 5, keys(1, 2), now=6) == [5]
    assert [e.slot for e in cache.entries] == [4]


def test_a_pinned_entry_is_not_taken_while_its_cells_are_copied() -> None:
    cache = PrefixCache(limit=10 * B)
    cache.add("a", 0, keys(1), now=0)
    cache.add("a", 1, keys(2), now=1)
    entry, _ = cache.find("a", keys(1), now=0)
    assert entry is not None
    cache.pin(entry)
    assert cache.take_slot() == 1
    assert cache.take_slot() is None
    cache.unpin(entry)
    assert cache.take_slot() == 0


def books(max_sessions: int = 3, cache_tokens: int = 8 * B) -> StageBooks[None]:
    return StageBooks(StageLimits(max_sessions=max_sessions, max_session_tokens=4 * B,
                                  max_total_tokens=max_sessions * 4 * B, cache_tokens=cache_tokens))


def opened(b: StageBooks[None], name: str, now: float, owner: str = "alice") -> None:
    book, gone = b.open(name, 0, 0, 8, [], now, owner=owner, source=f"10.0.0.{len(b.sessions) + 1}")
    assert gone == []
    b.opened(book)


def test_a_finished_session_leaves_its_sequence_as_an_entry_and_a_new_one_takes_it_back() -> None:
    b = books()
    for i, name in enumerate(("s1", "s2", "s3")):
        opened(b, name, now=i)
    done = b.sessions["s1"]
    assert b.keep(done, keys(1, 2), now=5)
    # the sequence is the entry's: not free, not to be cleared
    assert b.dirty == [] and b.cache.entries[0].slot == done.slot and "s1" not in b.sessions
    # every slot is taken (two sessions, one entry): a new session gets the entry's, nobody is evicted
    opened(b, "s4", now=6)
    assert b.sessions["s4"].slot == done.slot and b.cache.entries == []
    assert b.counts.evictions == 0 and all(s.phase in LIVE for s in b.sessions.values())


def test_entries_never_count_against_the_sessions_tokens() -> None:
    b = books(max_sessions=2)
    opened(b, "s1", now=0)
    b.enqueue(b.sessions["s1"], 0, 4 * B, None, now=0)
    assert b.keep(b.sessions["s1"], keys(1, 2, 3, 4), now=1)
    assert b.total_tokens == 0 and b.cache.tokens == 4 * B
    opened(b, "s2", now=2)
    # the whole KV budget of the live sessions is still theirs
    b.enqueue(b.sessions["s2"], 0, 4 * B, None, now=2)
    assert b.counts.evictions == 0 and len(b.cache.entries) == 1


def test_without_a_cache_a_finished_session_is_cleared() -> None:
    b = books(cache_tokens=0)
    opened(b, "s1", now=0)
    slot = b.sessions["s1"].slot
    assert b.keep(b.sessions["s1"], keys(1), now=1)
    assert b.dirty == [(slot, 0)] and b.cache.entries == []


def test_rows_begin_past_the_prefix_a_lookup_found_and_no_further() -> None:
    b = books()
    opened(b, "s1", now=0)
    book = b.sessions["s1"]
    b.set_prompt(book, 3 * B)
    book.found = 2 * B
    with pytest.raises(ProtocolError) as missed:
        b.start_at(book, 2 * B + 1, now=1)
    assert missed.value.code is ErrorCode.CACHE_MISS
    assert b.start_at(book, 2 * B, now=1) == []
    assert (book.next_pos, book.start, b.total_tokens) == (2 * B, 2 * B, 2 * B)
    # its rows come from there on; a second start is refused
    b.enqueue(book, 2 * B, B, None, now=2)
    with pytest.raises(ProtocolError) as again:
        b.start_at(book, 0, now=3)
    assert again.value.code is ErrorCode.BAD_REQUEST


def test_a_start_at_or_past_the_prompt_end_is_refused() -> None:
    b = books()
    opened(b, "s1", now=0)
    book = b.sessions["s1"]
    b.set_prompt(book, 2 * B)
    book.found = 2 * B
    with pytest.raises(ProtocolError) as refused:
        b.start_at(book, 2 * B, now=1)
    assert refused.value.code is ErrorCode.BAD_REQUEST


def test_a_lost_worker_takes_the_entries_with_it() -> None:
    b = books()
    opened(b, "s1", now=0)
    slot = b.sessions["s1"].slot
    b.keep(b.sessions["s1"], keys(1), now=1)
    b.fail_all(ProtocolError(ErrorCode.INTERNAL, "worker gone"))
    assert b.cache.entries == [] and (slot, -1) in b.dirty


def test_the_load_routes_see_counts_live_sessions_in_halves_and_no_entry() -> None:
    b = books(max_sessions=4)
    assert b.load == 0.0
    opened(b, "s1", now=0)
    assert b.load == 0.0
    opened(b, "s2", now=1)
    assert b.load == 0.5
    b.keep(b.sessions["s2"], keys(1), now=2)
    assert b.load == 0.0 and len(b.cache.entries) == 1
    for i, name in enumerate(("s3", "s4", "s5")):
        opened(b, name, now=3 + i)
    assert b.load == 1.0
