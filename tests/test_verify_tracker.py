"""The tracker and the status view with proofs of lies (sans-IO): a proof that holds keeps its
culprit out of placements and routes; a forged one (or one whose witnesses the tracker never placed
on that range) gets no honest node excluded; a range one node alone serves shows as unverified."""

from __future__ import annotations

import pytest
from instant_net import identity
from test_mesh_duty import MODEL, Mesh, duty

from meshd.mesh.proofs import InvalidProof
from meshd.mesh.status import status_view
from meshd.stage.receipts import SessionReceipts, Signer
from meshd.status_table import as_json, render
from wire.identity import NodeIdentity
from wire.receipt import Proof, Receipt, row_hash


def receipt(layers: tuple[int, int], out: bytes, signer: Signer | None = None) -> Receipt:
    who = signer or Signer(NodeIdentity.generate())
    return SessionReceipts(who, f"s{who.node_id[:4]}", 0, MODEL.digest, *layers).sign(0, 3, row_hash(b"in"),
                                                                                      row_hash(out))


def placed_mesh() -> Mesh:
    mesh = Mesh(*[duty(i) for i in range(6)])
    mesh.run_until(10.0)
    return mesh


def test_a_proven_liar_leaves_placements_and_routes_and_a_forged_proof_excludes_no_one() -> None:
    mesh = placed_mesh()
    tracker = mesh.tracker
    ranges = tracker.assignments[MODEL.digest].ranges()
    by_id = {d.node_id: d for d in mesh.duties.values()}
    layers = max(set(ranges.values()), key=lambda r: sum(1 for v in ranges.values() if v == r))
    liar, *honest = [n for n, r in ranges.items() if r == layers]
    assert len(honest) >= 2, ranges
    signer = {identity(i).node_id: Signer(identity(i)) for i in range(6)}
    lie = receipt(layers, b"lie", signer[liar])
    truth = [receipt(layers, b"truth", signer[n]) for n in honest[:2]]
    # an attacker frames an honest node with two identities of its own, which no one placed on the range
    framed = receipt(layers, b"truth", signer[honest[0]])
    sybils = [receipt(layers, b"lie") for _ in range(2)]
    with pytest.raises(InvalidProof, match="does not serve"):
        tracker.accept_proof(mesh.net.now, Proof(kind="divergence", culprit=framed, witnesses=sybils))
    # two placed nodes whose signatures do not hold
    forged = [t.model_copy(update={"h_out": row_hash(b"other")}) for t in truth]
    with pytest.raises(InvalidProof):
        tracker.accept_proof(mesh.net.now, Proof(kind="divergence", culprit=lie, witnesses=forged))
    assert tracker.liars == {}
    route = tracker.route(MODEL.digest, (), lambda r: r.addresses[0])
    proof = Proof(kind="divergence", culprit=lie, witnesses=truth)
    assert tracker.accept_proof(mesh.net.now, proof) == liar
    assert tracker.accept_proof(mesh.net.now, proof) is None  # known: not passed on again
    mesh.run_until(mesh.net.now + 5.0)
    assert liar not in tracker.assignments[MODEL.digest].ranges()
    for _ in range(8):
        route = tracker.route(MODEL.digest, (), lambda r: r.addresses[0])
        assert liar not in {s.node_id for s in route.stages}
    # any other member checks the proof itself before it acts on it, and routes around the liar
    other = by_id[honest[1]]
    assert other.accept_proof(mesh.net.now, proof) == liar


def test_a_range_one_node_alone_serves_is_unverified_in_status_and_its_json() -> None:
    mesh = placed_mesh()
    tracker = mesh.tracker
    members = tracker.node.membership.members()
    live = tracker.node.membership.live_records()
    (cov,) = status_view(tracker.node_id, members, live, tracker.node.tracker).coverage
    assert cov.unverified == []
    # of the two nodes serving [5, 8), one is gone
    only = [r for r in live if r.served and (r.served[0].start, r.served[0].end) == (5, 8)][:1]
    rest = [r for r in live if not (r.served and (r.served[0].start, r.served[0].end) == (5, 8))]
    (cov,) = status_view(tracker.node_id, members, rest + only, tracker.node.tracker).coverage
    assert cov.unverified == ["[5, 8)"]
    reply = status_view(tracker.node_id, members, rest + only, tracker.node.tracker)
    assert as_json(reply)["coverage"][0]["unverified"] == ["[5, 8)"]
    assert "unverified (no replica to check on): [5, 8)" in render(reply)
