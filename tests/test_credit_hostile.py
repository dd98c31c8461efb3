"""Attacks on the ledger's gossip (meshd.client.ledger): a peer whose id pages never end, one that
answers a fetch with more than was asked or with forgeries, one that answers nothing. Each costs the
puller one bounded pull and nothing held; the peer is a fake (named so), the puller real."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import trio

from meshd.client.ledger import PULL_PAGES, WALK_AFTER, LedgerKeeper
from meshd.mesh.credit import Ledger
from tests.credit_helpers import served
from wire.credit import IDS_PAGE, LedgerFetch, LedgerIds, LedgerIdsRequest, LedgerRootsRequest, WorkGive
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.message import ErrorMessage, Message


class FakeLedgerPeer:
    """A peer's ledger answers, as `answer(request)` makes them (an honest ledger's, or an attack's)."""

    def __init__(self, answer: Callable[[Message], Message]) -> None:
        self.answer = answer
        self.asked: list[Message] = []

    async def rpc(self, peers: object, address: str | None, request: Message, node_id: str | None = None,
                  timeout: float = 5.0) -> Message:
        self.asked.append(request)
        return self.answer(request)


def _keeper(peer: FakeLedgerPeer) -> LedgerKeeper:
    return LedgerKeeper(NodeIdentity.generate(), None, peer.rpc, lambda: ())  # type: ignore[arg-type]


def _honest(ledger: Ledger) -> Callable[[Message], Message]:
    def answer(request: Message) -> Message:
        if isinstance(request, LedgerRootsRequest):
            return ledger.roots(request.root, request.walk)
        if isinstance(request, LedgerIdsRequest):
            return ledger.ids(request.bucket, request.offset)
        assert isinstance(request, LedgerFetch)
        return WorkGive(summaries=ledger.fetch(request.ids))
    return answer


def _theirs(count: int) -> Ledger:
    ledger = Ledger()
    a, b = NodeIdentity.generate(), NodeIdentity.generate()
    for k in range(count):
        ledger.add(time.time(), served(a, b, tokens=10 + k, session=f"s{k}", at=time.time()))
    return ledger


async def test_an_honest_peer_s_ledger_is_taken_whole_in_a_few_bounded_pulls() -> None:
    theirs = _theirs(100)
    peer = FakeLedgerPeer(_honest(theirs))
    keeper = _keeper(peer)
    # the ids sent with the roots, then (plainly behind) a walk of up to PULL_BUCKETS buckets a pull
    taken = [await keeper.pull("peer", None) for _ in range(2 * WALK_AFTER + 2)]
    assert taken[0] >= 64 and sum(taken) == 100
    assert keeper.ledger.root == theirs.root


async def test_id_pages_that_never_end_cost_one_bounded_pull() -> None:
    theirs = _theirs(3)
    honest = _honest(theirs)
    endless = [bytes([b]) + bytes(15) for b in range(1)] * IDS_PAGE

    def answer(request: Message) -> Message:
        if isinstance(request, LedgerIdsRequest):
            # the same page again and again, of a bucket that claims to hold ever more
            return LedgerIds(bucket=request.bucket, ids=endless, total=1 << 62)
        return honest(request)

    peer = FakeLedgerPeer(answer)
    keeper = _keeper(peer)
    keeper.ledger.add(time.time(), served(NodeIdentity.generate(), NodeIdentity.generate(), tokens=5,
                                          at=time.time()))
    with trio.fail_after(10):
        await keeper.pull("peer", None)
    assert sum(isinstance(m, LedgerIdsRequest) for m in peer.asked) <= PULL_PAGES


@pytest.mark.parametrize("attack", ["more than asked", "forged", "nothing"])
async def test_a_peer_that_lies_in_its_answers_gives_the_puller_nothing(attack: str) -> None:
    theirs = _theirs(5)
    honest = _honest(theirs)
    stranger = served(NodeIdentity.generate(), NodeIdentity.generate(), tokens=7, session="x", at=time.time())

    def answer(request: Message) -> Message:
        if isinstance(request, LedgerFetch):
            if attack == "more than asked":
                return WorkGive(summaries=[*theirs.fetch(request.ids), stranger])
            if attack == "forged":
                return WorkGive(summaries=[s.model_copy(update={"signature": bytes(64)})
                                           for s in theirs.fetch(request.ids)])
            return ErrorMessage(code=ErrorCode.OVERLOADED, message="busy")
        return honest(request)

    keeper = _keeper(FakeLedgerPeer(answer))
    if attack == "forged":
        assert await keeper.pull("peer", None) == 0
    else:
        with pytest.raises(ProtocolError):
            await keeper.pull("peer", None)
    assert len(keeper.ledger) == 0
