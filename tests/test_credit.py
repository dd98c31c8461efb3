"""The credit ledger's rules (meshd.mesh.credit), sans-IO: what a summary must prove, who pays, what
gossip converges to."""

from __future__ import annotations

import random

import pytest

from meshd.mesh.credit import (
    ASKER_WINDOW_CAP,
    FOLD_AFTER,
    HALF_LIFE,
    MAX_FUTURE,
    InvalidSummary,
    Ledger,
    Standing,
    check_summary,
)
from tests.credit_helpers import MODEL, NOW, served, sync
from wire.credit import WorkGive, WorkSummary
from wire.decode import decode
from wire.identity import NodeIdentity
from wire.message import encode
from wire.receipt import NO_PREV, Receipt


def test_a_summary_holds_with_both_signatures_and_the_stage_s_positions() -> None:
    asker, stage = NodeIdentity.generate(), NodeIdentity.generate()
    summary = served(asker, stage, tokens=100)
    assert check_summary(summary, NOW) == stage.node_id
    back = decode(encode(WorkGive(summaries=[summary])))
    assert isinstance(back, WorkGive) and check_summary(back.summaries[0], NOW) == stage.node_id


def _forged(summary: WorkSummary, **changes: object) -> WorkSummary:
    return summary.model_copy(update=changes)


def test_forged_summaries_earn_nothing() -> None:
    asker, stage, other = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
    good = served(asker, stage, tokens=100)
    # more tokens than the stage signed, re-signed by the asker: the stage's receipt says otherwise
    more = WorkSummary.create(asker, MODEL, 0, 8, 50, 100, True, int(NOW), good.head)
    # a receipt the stage never signed (the asker made one in the stage's name)
    unsigned = Receipt.build("s", 0, 0, 100, MODEL, 0, 8, b"1" * 16, b"2" * 16, b"3" * 16, NO_PREV,
                             stage.public_key, other)
    fake_head = WorkSummary.create(asker, MODEL, 0, 8, 100, 0, True, int(NOW), unsigned)
    cases = {
        "wrong asker signature": _forged(good, signature=bytes(64)),
        "asker key not its id": _forged(good, asker=other.node_id),
        "more tokens than signed": more,
        "chain head never signed": fake_head,
        "another range": WorkSummary.create(asker, MODEL, 0, 16, 100, 0, True, int(NOW), good.head),
        "future": WorkSummary.create(asker, MODEL, 0, 8, 100, 0, True, int(NOW + 2 * MAX_FUTURE), good.head),
        "self": served(stage, stage, tokens=100),
    }
    for name, summary in cases.items():
        with pytest.raises(InvalidSummary):
            check_summary(summary, NOW)
        ledger = Ledger()
        with pytest.raises(InvalidSummary):
            ledger.add(NOW, summary)
        assert len(ledger) == 0, name


def test_work_counts_from_placed_askers_and_credit_holders_only() -> None:
    placed, stage, stranger = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
    ledger = Ledger()
    ledger.add(NOW, served(placed, stage, tokens=100))
    ledger.add(NOW, served(stranger, stage, tokens=100, session="t"))
    standing = ledger.standing(NOW, placed={placed.node_id})
    # 8 layers x 100 tokens from the placed asker; the stranger's pays nothing
    assert standing[stage.node_id].earned == pytest.approx(800.0, rel=1e-3)
    assert standing[placed.node_id].balance == pytest.approx(-800.0, rel=1e-3)
    assert ledger.standing(NOW, placed=()).get(stage.node_id) is None or \
        ledger.standing(NOW, placed=())[stage.node_id].earned == 0.0


def test_a_ring_of_ten_asking_each_other_earns_nothing() -> None:
    ring = [NodeIdentity.generate() for _ in range(10)]
    ledger = Ledger()
    for i, asker in enumerate(ring):
        for j, stage in enumerate(ring):
            if i != j:
                ledger.add(NOW, served(asker, stage, tokens=500, session=f"{i}-{j}"))
    honest = NodeIdentity.generate()
    standing = ledger.standing(NOW, placed={honest.node_id})
    assert all(standing.get(m.node_id) is None or standing[m.node_id].earned == 0.0 for m in ring)


def test_a_stage_countersigning_itself_through_a_second_identity_moves_no_more_than_it_earned() -> None:
    placed, stage, alias = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
    ledger = Ledger()
    # the alias served a placed asker honestly once (8 x 10), then pays the stage for 8 x 1000 of made-up work
    ledger.add(NOW, served(placed, alias, tokens=10))
    ledger.add(NOW, served(alias, stage, tokens=1000, session="self"))
    standing = ledger.standing(NOW, placed={placed.node_id})
    assert standing[stage.node_id].earned == pytest.approx(80.0, rel=1e-3)
    # the two together hold no more than the alias earned (the alias spent all it asked for)
    assert standing[stage.node_id].balance + standing[alias.node_id].balance <= 80.0


def test_one_asker_credits_a_stage_at_most_a_cap_an_hour_and_credit_decays() -> None:
    placed, stage = NodeIdentity.generate(), NodeIdentity.generate()
    ledger = Ledger()
    for k in range(20):
        ledger.add(NOW, served(placed, stage, tokens=2000, layers=32, session=f"s{k}"))
    assert ledger.standing(NOW, {placed.node_id})[stage.node_id].earned == pytest.approx(ASKER_WINDOW_CAP, rel=1e-3)
    later = ledger.standing(NOW + HALF_LIFE, {placed.node_id})[stage.node_id].earned
    assert later == pytest.approx(ASKER_WINDOW_CAP / 2, rel=1e-2)
    # a mesh's own cap (a test mesh's --asker-window-cap) caps it there
    small = Ledger(cap=ASKER_WINDOW_CAP / 8)
    for k in range(20):
        small.add(NOW, served(placed, stage, tokens=2000, layers=32, session=f"s{k}"))
    assert small.standing(NOW, {placed.node_id})[stage.node_id].earned == pytest.approx(ASKER_WINDOW_CAP / 8, rel=1e-3)


def test_the_same_receipt_countersigned_twice_counts_once() -> None:
    placed, other, stage = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
    first = served(placed, stage, tokens=100)
    again = WorkSummary.create(other, MODEL, 0, 8, 100, 0, True, int(NOW), first.head)
    ledger = Ledger()
    ledger.add(NOW, first)
    ledger.add(NOW, again)
    assert ledger.standing(NOW, {placed.node_id, other.node_id})[stage.node_id].earned == pytest.approx(800.0, rel=1e-3)


def test_a_full_ledger_drops_the_summaries_of_askers_that_do_not_pay_first() -> None:
    placed, stage = NodeIdentity.generate(), NodeIdentity.generate()
    ledger = Ledger(most=4)
    for k in range(2):
        ledger.add(NOW, served(placed, stage, tokens=10, session=f"p{k}"))
    ledger.standing(NOW, {placed.node_id})
    flood = [NodeIdentity.generate() for _ in range(6)]
    for k, asker in enumerate(flood):
        ledger.add(NOW, served(asker, stage, tokens=10, session=f"f{k}"))
    assert len(ledger) == 4
    assert sum(1 for fact in ledger.facts() if fact[3] == placed.node_id) == 2


def test_gossip_pulls_make_every_ledger_the_same() -> None:
    rng = random.Random(3)
    ids = [NodeIdentity.generate() for _ in range(6)]
    ledgers = [Ledger() for _ in ids]
    for k in range(60):
        asker, stage = rng.sample(range(6), 2)
        summary = served(ids[asker], ids[stage], tokens=rng.randint(1, 300), session=f"a{k}")
        ledgers[asker].add(NOW, summary)
        ledgers[stage].add(NOW, summary)
    rounds = 0
    while len({ledger.root for ledger in ledgers}) > 1:
        rounds += 1
        assert rounds <= 10
        for i, ledger in enumerate(ledgers):
            sync(ledger, ledgers[rng.choice([j for j in range(6) if j != i])], NOW)
    assert all(len(ledger) == 60 for ledger in ledgers)


# ----- priority by credit at a stage's slots (meshd.stage.books)

def test_a_member_with_credit_takes_a_one_slot_stage_from_a_newcomer_and_not_the_reverse() -> None:
    from meshd.stage.books import StageBooks, StageLimits
    from wire.errors import ProtocolError

    books: StageBooks[None] = StageBooks(StageLimits(max_sessions=1))
    newcomer, _ = books.open("a", 0, 0, 16, (), 0.0, owner="n" * 40, source="10.0.0.1")
    book, gone = books.open("b", 0, 0, 16, (), 0.1, owner="s" * 40, source="10.0.0.2", credit=800.0)
    assert gone == [newcomer] and newcomer.failure is not None and "more credit" in newcomer.failure.message
    with pytest.raises(ProtocolError, match="busy"):
        books.open("c", 0, 0, 16, (), 0.2, owner="m" * 40, source="10.0.0.3")
    assert books.sessions == {"b": book}


def test_newcomers_keep_their_floor_of_slots_and_near_equals_do_not_take_each_other_s() -> None:
    from meshd.stage.books import StageBooks, StageLimits
    from wire.errors import ProtocolError

    books: StageBooks[None] = StageBooks(StageLimits(max_sessions=4, evict_after=1e9, tenure=1e9))
    books.open("new", 0, 0, 16, (), 0.0, owner="n" * 40, source="10.0.0.1")
    for k in range(3):
        books.open(f"rich{k}", 0, 0, 16, (), 0.0, owner=f"{k}" * 40, source=f"10.0.1.{k}", credit=1000.0)
    # the one newcomer holds the floor (a quarter of 4 slots); a richer claimant takes no slot from it,
    # and members with credit within the margin of its own keep theirs
    with pytest.raises(ProtocolError, match="busy"):
        books.open("x", 0, 0, 16, (), 1.0, owner="x" * 40, source="10.0.2.1", credit=1500.0)
    assert "new" in books.sessions
    _, gone = books.open("y", 0, 0, 16, (), 1.0, owner="y" * 40, source="10.0.2.2", credit=5000.0)
    assert [g.id for g in gone] == ["rich0"]


def test_a_member_in_step_takes_what_is_new_from_the_roots_alone_and_an_equal_pull_is_small() -> None:
    ids = [NodeIdentity.generate() for _ in range(3)]
    mine, theirs = Ledger(), Ledger()
    for k in range(40):
        summary = served(ids[k % 2], ids[2], tokens=10 + k, session=f"old{k}")
        mine.add(NOW, summary)
        theirs.add(NOW, summary)
    assert sync(mine, theirs, NOW, walk=False) < 200
    fresh = [served(ids[0], ids[1], tokens=5 + k, session=f"new{k}") for k in range(3)]
    for summary in fresh:
        theirs.add(NOW, summary)
    # the three new ones come with the roots: no bucket walked
    sync(mine, theirs, NOW, walk=False)
    assert mine.root == theirs.root


def test_summaries_fold_after_two_days_into_the_same_credit_and_are_never_counted_again() -> None:
    payer, stage, other = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
    ledger = Ledger()
    held = [served(payer, stage, tokens=100 + k, session=f"s{k}", at=NOW + 600 * k) for k in range(12)]
    held += [served(stage, other, tokens=50, session="o", at=NOW)]
    for summary in held:
        ledger.add(NOW + 7200, summary)
    placed = {payer.node_id}
    later = NOW + FOLD_AFTER + 3 * 3600
    before = ledger.standing(later, placed)
    assert ledger.expire(later) == len(held) and len(ledger) == 0
    after = ledger.standing(later, placed)
    for member in (stage.node_id, payer.node_id, other.node_id):
        assert after.get(member, Standing()).earned == pytest.approx(before.get(member, Standing()).earned)
        assert after.get(member, Standing()).spent == pytest.approx(before.get(member, Standing()).spent)
    assert after[stage.node_id].earned > 0 and after[other.node_id].earned > 0
    # a week on, it has halved like any credit
    assert ledger.standing(later + HALF_LIFE, placed)[stage.node_id].earned == \
        pytest.approx(after[stage.node_id].earned / 2)
    # a peer that gives a folded summary again gets it refused: it is counted already
    with pytest.raises(InvalidSummary, match="folded"):
        ledger.add(NOW + 7200, held[0])


def test_a_full_ledger_folds_its_oldest_hour_early_and_refuses_that_hour_after() -> None:
    payer, stage = NodeIdentity.generate(), NodeIdentity.generate()
    ledger = Ledger(most=4)
    ledger.standing(NOW, {payer.node_id})  # the payer pays: its summaries fold, not drop
    for k in range(4):
        ledger.add(NOW, served(payer, stage, tokens=10, session=f"a{k}", at=NOW - 7200 + k))
    ledger.add(NOW, served(payer, stage, tokens=10, session="b", at=NOW))
    assert len(ledger) == 1
    assert ledger.standing(NOW, {payer.node_id})[stage.node_id].earned == pytest.approx(400, rel=1e-2)  # 5 x 8 x 10, an hour old
    with pytest.raises(InvalidSummary, match="folded"):
        ledger.add(NOW, served(payer, stage, tokens=10, session="c", at=NOW - 7200 + 9))


async def test_the_keeper_reckons_what_its_ledger_folded_too() -> None:
    import time

    from meshd.client.ledger import LedgerKeeper

    payer, stage = NodeIdentity.generate(), NodeIdentity.generate()
    keeper = LedgerKeeper(stage, None, None, lambda: {payer.node_id})  # type: ignore[arg-type]
    now = time.time()
    keeper.ledger.add(now, served(payer, stage, tokens=100, at=now))
    keeper.ledger.standing(now, {payer.node_id})
    assert keeper.ledger.fold(now, now + 7200) == 1 and len(keeper.ledger) == 0
    await keeper.reckon()
    assert keeper.standing()[stage.node_id].earned == pytest.approx(800, rel=1e-3)
