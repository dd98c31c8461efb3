"""Summaries of served work for the credit tests, and one gossip pull between two in-memory ledgers."""

from __future__ import annotations

from meshd.mesh.credit import Ledger
from wire.credit import LedgerFetch, LedgerIds, LedgerRoots, LedgerRootsRequest, WorkGive, WorkSummary
from wire.decode import decode
from wire.identity import NodeIdentity
from wire.message import encode
from wire.receipt import NO_PREV, Receipt, row_hash

MODEL = "ab" * 32
NOW = 1_800_000_000.0


def served(asker: NodeIdentity, stage: NodeIdentity, tokens: int, layers: int = 8, session: str = "s",
           checked: bool = True, at: float = NOW) -> WorkSummary:
    """`asker`'s countersigned summary of `stage` serving `tokens` prompt tokens through `layers` layers,
    over a last receipt the stage signed."""
    head = Receipt.build(session, 0, tokens - 1, 1, MODEL, 0, layers, row_hash(b"in"), row_hash(b"out"),
                         row_hash(session.encode()), NO_PREV, stage.public_key, stage)
    return WorkSummary.create(asker, MODEL, 0, layers, tokens, 0, checked, int(at), head)




def sync(mine: Ledger, theirs: Ledger, now: float, walk: bool = True) -> int:
    """`mine` pulls what it lacks from `theirs` as the daemon does (meshd.client.ledger), every message
    through the codec: the ids taken last, and with `walk` the buckets that differ; returns the bytes
    that crossed."""
    sent = 0

    def over(message: object) -> object:
        nonlocal sent
        data = encode(message)  # type: ignore[arg-type]
        sent += len(data)
        return decode(data)

    request = over(LedgerRootsRequest(root=mine.root, walk=walk))
    assert isinstance(request, LedgerRootsRequest)
    roots = over(theirs.roots(request.root, request.walk))
    assert isinstance(roots, LedgerRoots)
    if mine.missing(roots.recent):
        fetch = over(LedgerFetch(ids=mine.missing(roots.recent)))
        assert isinstance(fetch, LedgerFetch)
        give = over(WorkGive(summaries=theirs.fetch(fetch.ids)))
        assert isinstance(give, WorkGive)
        for summary in give.summaries:
            mine.add(now, summary)
    for bucket in mine.differing(roots):
        offset, total = 0, 1
        while offset < total:
            page = over(theirs.ids(bucket, offset))
            assert isinstance(page, LedgerIds)
            total, offset = page.total, offset + len(page.ids) or total
            wanted = mine.missing(page.ids)
            for k in range(0, len(wanted), 64):
                fetch = over(LedgerFetch(ids=wanted[k:k + 64]))
                assert isinstance(fetch, LedgerFetch)
                give = over(WorkGive(summaries=theirs.fetch(fetch.ids)))
                assert isinstance(give, WorkGive)
                for summary in give.summaries:
                    mine.add(now, summary)
    return sent
