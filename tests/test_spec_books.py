"""Speculation in the stage's books and the drafter, sans-IO: rewinds only into drafts that ran, bounded drafts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from meshd.engine.draft import DraftLength, DraftModelKV, NgramDrafter
from meshd.stage.books import StageBooks, StageLimits
from wire.errors import ErrorCode, ProtocolError
from wire.tensors import MAX_DRAFT, Activation


def decoding(prompt: int = 4) -> tuple[StageBooks[None], object]:
    books: StageBooks[None] = StageBooks(StageLimits(max_sessions=2, max_session_tokens=64, max_total_tokens=128))
    book, _ = books.open("s", 0, 0, 32, [], 0.0)
    books.opened(book)
    books.set_prompt(book, prompt)
    books.enqueue(book, 0, prompt, None, 0.0)
    for work in books.next_batch():
        books.ran(work, 0.0)
    return books, book


def run_all(books: StageBooks[None]) -> None:
    for work in books.next_batch():
        books.ran(work, 0.0)


def test_rows_may_start_inside_drafts_that_ran_and_their_kv_is_trimmed() -> None:
    books, book = decoding()
    books.enqueue(book, 4, 5, None, 0.0, drafts=4)  # token at 4, drafts at 5..8
    assert book.draft_from == 5 and books.total_tokens == 9
    run_all(books)
    books.enqueue(book, 7, 1, None, 0.0)  # drafts at 5, 6 accepted, 7 and 8 rejected
    assert books.take_trims() == [(book.slot, 0, 7)]
    assert book.next_pos == 8 and book.draft_from is None and books.total_tokens == 8
    assert books.counts.rewinds == 1


@pytest.mark.parametrize("pos", [3, 4, 10, 11])
def test_rows_outside_the_drafts_are_a_cache_miss(pos: int) -> None:
    books, book = decoding()
    books.enqueue(book, 4, 5, None, 0.0, drafts=4)
    run_all(books)
    with pytest.raises(ProtocolError) as exc:
        books.enqueue(book, pos, 1, None, 0.0)
    assert exc.value.code is ErrorCode.CACHE_MISS and book.next_pos == 9


def test_no_rewind_into_drafts_still_in_flight_or_without_drafts() -> None:
    books, book = decoding()
    books.enqueue(book, 4, 3, None, 0.0, drafts=2)
    with pytest.raises(ProtocolError, match="position 5"):
        books.enqueue(book, 5, 1, None, 0.0)  # the drafted rows have not run yet
    run_all(books)
    books.enqueue(book, 7, 1, None, 0.0)
    run_all(books)
    with pytest.raises(ProtocolError, match="position 6"):
        books.enqueue(book, 6, 1, None, 0.0)  # verified rows are never rewound


@pytest.mark.parametrize(("pos", "n", "drafts"), [(4, 2, 2), (4, 1, 1), (0, 3, 1)])
def test_drafts_follow_a_verified_row_after_the_prompt(pos: int, n: int, drafts: int) -> None:
    books: StageBooks[None] = StageBooks(StageLimits())
    book, _ = books.open("s", 0, 0, 32, [], 0.0)
    books.opened(book)
    books.set_prompt(book, 4)
    if pos:
        books.enqueue(book, 0, 4, None, 0.0)
        run_all(books)
    with pytest.raises(ProtocolError) as exc:
        books.enqueue(book, pos, n, None, 0.0, drafts=drafts)
    assert exc.value.code is ErrorCode.BAD_REQUEST


def test_drafts_count_against_the_session_budget() -> None:
    books, book = decoding(prompt=60)
    with pytest.raises(ProtocolError) as exc:
        books.enqueue(book, 60, 5, None, 0.0, drafts=4)
    assert exc.value.code is ErrorCode.OVERLOADED


def test_a_released_slot_drops_its_pending_trims() -> None:
    books, book = decoding()
    books.enqueue(book, 4, 3, None, 0.0, drafts=2)
    run_all(books)
    books.enqueue(book, 5, 1, None, 0.0)
    books.release(book)
    assert books.trims == []


def test_activation_bounds_its_drafts() -> None:
    base = {"session": "ab", "epoch": 0, "step": 0, "pos": 4, "tensors": [], "tokens": [1] * (MAX_DRAFT + 2)}
    with pytest.raises(ValidationError):
        Activation.model_validate(base | {"n_tokens": MAX_DRAFT + 2, "drafts": MAX_DRAFT + 1})
    with pytest.raises(ValidationError, match="at least one verified row"):
        Activation.model_validate(base | {"n_tokens": 2, "tokens": [1, 2], "drafts": 2})
    assert Activation.model_validate(base | {"n_tokens": MAX_DRAFT + 1, "tokens": [1] * (MAX_DRAFT + 1),
                                             "drafts": MAX_DRAFT}).drafts == MAX_DRAFT


def test_drafter_follows_the_longest_suffix_seen_before() -> None:
    d = NgramDrafter()
    d.extend([1, 2, 3, 9, 2, 3, 4, 5, 6, 7])
    assert d.draft(3) == []  # 7 was never seen before
    d.extend([1, 2, 3])
    # [1, 2, 3] was followed by 9; [2, 3] most recently by 4
    assert d.draft(3) == [9, 2, 3]
    d.extend([4])
    assert d.draft(2) == [5, 6]
    assert d.draft(0) == []


def test_draft_length_adapts_to_acceptance() -> None:
    k = DraftLength(max_k=8)
    assert k.k == 4
    k.record(4, 4)
    assert k.k == 8
    k.record(8, 8)
    assert k.k == 8
    k.record(8, 2)
    assert k.k == 3
    k.record(3, 0)
    assert k.k == 1 and (k.drafted, k.accepted) == (23, 14)


def test_drafting_pauses_longer_after_each_step_whose_drafts_all_failed() -> None:
    k = DraftLength(max_k=8)
    assert k.next_k() == 4
    k.record(4, 0)
    assert [k.next_k() for _ in range(2)] == [0, 1]
    k.record(1, 0)
    assert [k.next_k() for _ in range(3)] == [0, 0, 1]
    k.record(1, 1)
    assert k.pause == 0 and k.next_k() == 2


def test_a_single_recurring_token_drafts_nothing() -> None:
    d = NgramDrafter()
    d.extend([5, 1, 6, 7, 1])
    assert d.draft(4) == []


def test_draft_model_kv_keeps_the_held_prefix_and_feeds_the_rest() -> None:
    kv = DraftModelKV()
    # nothing held: the whole prompt is fed
    assert kv.plan([1, 2, 3]) == (0, [1, 2, 3])
    kv.ran([1, 2, 3], [4, 5, 6])
    # it ran 4 and 5 (6 was never fed); the ring accepted 4 and picked 9 after it
    assert kv.held == [1, 2, 3, 4, 5]
    assert kv.plan([1, 2, 3, 4, 9]) == (4, [9])
    # every draft accepted, and the token after: the last draft and that token are fed
    kv.ran([1, 2, 3, 4, 9], [7, 8])
    assert kv.plan([1, 2, 3, 4, 9, 7, 8, 10]) == (6, [8, 10])
    # the session's tokens all held (a step without drafts): the last is fed again for its logits
    kv.held = [1, 2, 3]
    assert kv.plan([1, 2, 3]) == (2, [3])
