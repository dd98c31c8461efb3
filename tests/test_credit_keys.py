"""A front door's API keys share its member's credit (issue 33, part 3): each key's asks rank at the
stages with the share of the member's priority its own use leaves it (meshd.mesh.credit.key_share),
carried in the member's signed voucher, so one key's flood cannot take another's part."""

from __future__ import annotations

import time

import pytest
import trio

from meshd.client.ledger import LedgerKeeper
from meshd.client.served import Served
from meshd.mesh.credit import HALF_LIFE, KeyShares, Standing, key_share, priority
from meshd.stage.books import StageBooks, StageLimits
from tests.credit_helpers import served
from wire.credit import SHARE_WHOLE, Voucher, WorkTaken
from wire.identity import NodeIdentity
from wire.message import Message


def test_each_key_ranks_with_an_equal_part_of_what_the_member_earned_less_its_own_use() -> None:
    untouched = Standing(earned=8000.0, spent=0.0, placed=True)
    # one key (or none) is the member itself
    assert key_share(untouched, True, 5000.0, 1) == key_share(untouched, True, 5000.0, 0) == 1.0
    # two keys that spent nothing: each ranks with half the member's earnings
    assert key_share(untouched, True, 0.0, 2) == pytest.approx(priority(4000.0, True) / priority(8000.0, True))
    # key A spent 5,000 of the member's 8,000: the member has 3,000 left, A's part is gone (it ranks as a
    # placed member with nothing), B's 4,000 is capped at what the member has left
    drained = Standing(earned=8000.0, spent=5000.0, placed=True)
    whole = priority(drained.balance, True)
    assert key_share(drained, True, 5000.0, 2) * whole == pytest.approx(priority(0.0, True))
    assert key_share(drained, True, 0.0, 2) == pytest.approx(1.0)
    # a member with nothing to share ranks every key alike
    assert key_share(None, False, 10.0, 3) == key_share(Standing(spent=50.0), False, 0.0, 3) == 1.0


def test_a_key_s_use_halves_each_half_life_and_the_keys_kept_are_bounded() -> None:
    use = KeyShares(most=2)
    use.spend("a", 100.0, 0.0)
    assert use.spent("a", HALF_LIFE) == pytest.approx(50.0)
    use.spend("b", 10.0, HALF_LIFE)
    use.spend("c", 10.0, HALF_LIFE)  # the third key: the one used longest ago ("a") is forgotten
    assert use.spent("a", HALF_LIFE) == 0.0 and use.spent("c", HALF_LIFE) == 10.0
    use.spend("b", -5.0, HALF_LIFE)  # nothing is ever paid back
    assert use.spent("b", HALF_LIFE) == 10.0


def test_a_voucher_s_share_is_signed_and_scales_the_rank_a_stage_gives() -> None:
    member, opener = NodeIdentity.generate(), NodeIdentity.generate()
    half = Voucher.create(member, opener.node_id, 2_000_000_000, 0.5)
    assert half.share == SHARE_WHOLE // 2 and half.valid_for(opener.node_id, 1_900_000_000.0)
    assert half.ranked(1000.0) == 500.0
    assert not half.model_copy(update={"share": SHARE_WHOLE}).valid_for(opener.node_id, 1_900_000_000.0)
    assert Voucher.create(member, opener.node_id, 2_000_000_000, 7.0).share == SHARE_WHOLE
    assert Voucher.create(member, opener.node_id, 2_000_000_000).ranked(1000.0) == 1000.0


async def test_a_key_that_spent_its_part_gives_up_a_one_slot_stage_to_one_that_did_not() -> None:
    me, payer, stage = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()

    async def rpc(peers: object, address: str | None, request: Message, node_id: str | None = None,
                  timeout: float = 5.0) -> Message:
        return WorkTaken(taken=1)

    keeper = LedgerKeeper(me, None, rpc, lambda: {payer.node_id, me.node_id})  # type: ignore[arg-type]
    # this member served a placed payer: 8 layers x 1,000 tokens, checked
    keeper.ledger.add(time.time(), served(payer, me, tokens=1000, at=time.time()))
    await keeper.reckon()
    assert keeper.standing()[me.node_id].earned == 8000.0
    # key A's asks have this member countersign 8 layers x 600 tokens of another stage's work
    summary = served(me, stage, tokens=600, at=time.time())
    work = Served(summary.model, summary.layer_begin, summary.layer_end, summary.prompt_tokens, 0, True, summary.head)
    async with trio.open_nursery() as nursery:
        assert len(keeper.countersign(nursery, [work], lambda node_id: None, key="key-a")) == 1
    await keeper.reckon()
    member = keeper.credit_of(me.node_id)
    assert member == priority(8000.0 - 4800.0, True)
    a, b = (keeper.voucher("f" * 40, key, 2) for key in ("key-a", "key-b"))
    # 4,000 - 4,800: nothing left (to the voucher's grain, 1/65,536 of the member's rank)
    assert a.ranked(member) == pytest.approx(priority(0.0, True), abs=member / SHARE_WHOLE)
    assert b.ranked(member) == pytest.approx(priority(3200.0, True), rel=1e-3)  # its 4,000, capped at 3,200
    # at a one-slot stage, B's ask takes the slot A's holds; A's would not take B's
    books: StageBooks[None] = StageBooks(StageLimits(max_sessions=1))
    held, _ = books.open("a", 0, 0, 16, (), 0.0, owner="f" * 40, source="10.0.0.1", credit=a.ranked(member))
    _, gone = books.open("b", 0, 0, 16, (), 0.1, owner="f" * 40, source="10.0.0.1", credit=b.ranked(member))
    assert gone == [held] and held.failure is not None and "more credit" in held.failure.message
