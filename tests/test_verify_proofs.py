"""Receipts, chains and proofs without a network: what an honest stage signs holds, and what an
attacker forges, moves or pads is refused before anyone acts on it."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import msgpack
import numpy as np
import pytest
import trio

from meshd.cli.figures import figures_line
from meshd.client.ask import AskResult, Gap, StageError, first_error
from meshd.client.audit import Audit, StageLied, blamed
from meshd.client.route import Stage
from meshd.client.session import _watch_for_errors
from meshd.client.verifier import Verifier
from meshd.client.verify import CheckPlan, Draws, KeptInputs, RangeCheck
from meshd.mesh.proofs import BrokenChain, InvalidProof, Step, check_chain, check_proof
from meshd.stage.receipts import SessionReceipts, Signer, chain_of, check_incoming
from wire.decode import decode
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.limits import protocol_limits
from wire.message import Message, encode, error_message
from wire.receipt import (
    MAX_CHAIN,
    MAX_WITNESSES,
    WIRE_BYTES,
    PackedChain,
    Proof,
    ProofGossip,
    Receipt,
    Receipts,
    pack_chain,
    read_chain,
    row_hash,
    unpack_chain,
)
from wire.stage import STAGE_PROTOCOL, Inputs, InputsRequest, Sampling, StageInfo, StepInput
from wire.tensors import Activation, TensorEntry
from wire.types import MAX_LAYERS, MAX_TOKENS

STAGE = protocol_limits(STAGE_PROTOCOL)
MODEL = "ab" * 32
RANGES = [(0, 2), (2, 4), (4, 6)]
SIGNERS = [Signer(NodeIdentity.generate()) for _ in RANGES]
REPLICAS = [Signer(NodeIdentity.generate()) for _ in range(3)]


def ledger(signer: Signer, layers: tuple[int, int], session: str = "s1") -> SessionReceipts:
    return SessionReceipts(signer, session, 0, MODEL, *layers)


def tokens_hash(ids: list[int]) -> bytes:
    return row_hash(np.asarray(ids, np.int32).tobytes())


def packed(chain: list[Receipt], session: str = "s1") -> PackedChain:
    """``chain`` as a stage or the asker reads it off a message."""
    return read_chain(pack_chain(chain), session, 0, MODEL)


def honest_chain(pos: int, n: int, h_in: bytes, outs: list[bytes], ledgers: list[SessionReceipts],
                 ring: Receipt | None = None) -> list[Receipt]:
    """Each stage's receipt of one step, the head's after ``ring`` (the tail's receipt of its token)."""
    chain: list[Receipt] = []
    for ledger_, out in zip(ledgers, outs, strict=True):
        chain.append(ledger_.sign(pos, n, h_in, out, chain[-1] if chain else ring))
        h_in = out
    return chain


def test_an_honest_chain_holds_and_each_forgery_breaks_it() -> None:
    ledgers = [ledger(s, r) for s, r in zip(SIGNERS, RANGES, strict=True)]
    outs = [row_hash(b"rows after head"), row_hash(b"rows after mid"), tokens_hash([])]
    chain = honest_chain(0, 5, tokens_hash([1, 2, 3, 4, 5]), outs, ledgers)
    step = Step("s1", 0, 0, 5, 6, SIGNERS[2].node_id, outs[2], decode=False)
    check_chain(packed(chain), step)
    # a receipt changed after signing, moved rows, a gap in the layers, another sender, other rows
    tampered = chain[1].model_copy(update={"h_out": row_hash(b"other")})
    attacks = {
        "bad signature": [chain[0], tampered.model_copy(update={"h_in": chain[0].h_out}), chain[2]],
        "another step": [c.model_copy(update={"pos": 1}) for c in chain],
        "layers": [chain[0], chain[2]],
        "took in other rows": [chain[0], chain[2].model_copy(update={"layer_begin": 2}), chain[2]],
        "sender": chain,
    }
    for what, forged in attacks.items():
        s = step if what != "sender" else Step("s1", 0, 0, 5, 6, SIGNERS[1].node_id, outs[2], decode=False)
        with pytest.raises(BrokenChain):
            check_chain(packed(forged), s)
    with pytest.raises(BrokenChain, match="not the ones"):
        check_chain(packed(chain), Step("s1", 0, 0, 5, 6, SIGNERS[2].node_id, row_hash(b"x"), decode=False))
    # a decode step must start with the tail's receipt of the token the head took in
    with pytest.raises(BrokenChain, match="without the tail's receipt"):
        check_chain(packed(chain), Step("s1", 0, 0, 5, 6, SIGNERS[2].node_id, outs[2], decode=True))


def test_a_decode_chain_links_the_head_to_the_tails_last_token() -> None:
    ledgers = [ledger(s, r) for s, r in zip(SIGNERS, RANGES, strict=True)]
    prompt = honest_chain(0, 3, tokens_hash([1, 2, 3]), [row_hash(b"a"), row_hash(b"b"), tokens_hash([9])], ledgers)
    ring = prompt[-1]
    step = honest_chain(3, 1, tokens_hash([9]), [row_hash(b"c"), row_hash(b"d"), tokens_hash([7])], ledgers, ring)
    check_chain(packed([ring, *step]), Step("s1", 0, 3, 1, 6, SIGNERS[2].node_id, step[-1].h_out, decode=True))
    other = honest_chain(3, 1, tokens_hash([8]), [row_hash(b"c"), row_hash(b"d"), tokens_hash([7])],
                         [ledger(s, r) for s, r in zip(SIGNERS, RANGES, strict=True)], ring)
    with pytest.raises(BrokenChain, match="another token"):
        check_chain(packed([ring, *other]), Step("s1", 0, 3, 1, 6, SIGNERS[2].node_id, other[-1].h_out, decode=True))


def test_the_asker_blames_the_tail_for_a_token_its_receipt_does_not_sign() -> None:
    ledgers = [ledger(s, r) for s, r in zip(SIGNERS, RANGES, strict=True)]
    result = AskResult(prompt_tokens=[1, 2, 3])
    audit = Audit("s1", 0, [s.node_id for s in SIGNERS], 6, result, prompt_len=3, model=MODEL)
    chain = honest_chain(0, 3, tokens_hash([1, 2, 3]), [row_hash(b"a"), row_hash(b"b"), tokens_hash([9])], ledgers)
    audit.on_packed("s1", 0, pack_chain(chain))
    with pytest.raises(StageLied) as lie:
        audit.on_token(8)
    assert lie.value.culprit == SIGNERS[2].node_id and lie.value.retryable


def test_the_asker_blames_the_head_for_a_prompt_it_did_not_tokenize_as_it_said() -> None:
    ledgers = [ledger(s, r) for s, r in zip(SIGNERS, RANGES, strict=True)]
    audit = Audit("s1", 0, [s.node_id for s in SIGNERS], 6, AskResult(prompt_tokens=[1, 2, 3]), prompt_len=3, model=MODEL)
    chain = honest_chain(0, 3, tokens_hash([1, 2, 4]), [row_hash(b"a"), row_hash(b"b"), tokens_hash([9])], ledgers)
    with pytest.raises(StageLied) as lie:
        audit.on_packed("s1", 0, pack_chain(chain))
    assert lie.value.culprit == SIGNERS[0].node_id


def test_a_tail_giving_the_head_another_token_leaves_an_equivocation_proof() -> None:
    ledgers = [ledger(s, r) for s, r in zip(SIGNERS, RANGES, strict=True)]
    audit = Audit("s1", 0, [s.node_id for s in SIGNERS], 6, AskResult(prompt_tokens=[1, 2, 3]), prompt_len=3, model=MODEL)
    first = honest_chain(0, 3, tokens_hash([1, 2, 3]), [row_hash(b"a"), row_hash(b"b"), tokens_hash([9])], ledgers)
    audit.on_packed("s1", 0, pack_chain(first))
    audit.on_token(9)
    # the tail signed token 9 to the asker and token 5 (same step, same history) to the head
    to_head = first[2].model_copy(update={"h_out": tokens_hash([5]), "signature": b""})
    to_head = to_head.signed(SIGNERS[2].identity)
    second = honest_chain(3, 1, tokens_hash([5]), [row_hash(b"c"), row_hash(b"d"), tokens_hash([7])],
                          [ledger(s, r) for s, r in zip(SIGNERS, RANGES, strict=True)], to_head)
    with pytest.raises(StageLied) as lie:
        audit.on_packed("s1", 0, pack_chain([to_head, *second]))
    assert lie.value.proof is not None and check_proof(lie.value.proof) == SIGNERS[2].node_id


def divergence(culprit_out: bytes = b"lie") -> tuple[Receipt, list[Receipt]]:
    h_in = row_hash(b"rows in")
    culprit = ledger(SIGNERS[1], (2, 4)).sign(0, 4, h_in, row_hash(culprit_out))
    witnesses = [ledger(r, (2, 4), session=f"check{k}").sign(0, 4, h_in, row_hash(b"truth"))
                 for k, r in enumerate(REPLICAS[:2])]
    return culprit, witnesses


def test_a_divergence_proof_names_the_culprit_and_any_node_can_check_it() -> None:
    culprit, witnesses = divergence()
    proof = Proof(kind="divergence", culprit=culprit, witnesses=witnesses)
    gossiped = decode(encode(ProofGossip(proof=proof)), protocol_limits(STAGE_PROTOCOL))
    assert isinstance(gossiped, ProofGossip) and check_proof(gossiped.proof) == SIGNERS[1].node_id


def test_forged_proofs_are_refused() -> None:
    culprit, witnesses = divergence()
    sybil = Signer(NodeIdentity.generate())
    forged_sig = witnesses[1].model_copy(update={"h_out": row_hash(b"lie")})
    other_history = ledger(REPLICAS[2], (2, 4)).sign(0, 4, row_hash(b"other rows"), row_hash(b"truth"))
    stolen_key = witnesses[1].model_copy(update={"public_key": sybil.public_key})
    forgeries = {
        "bad signature": Proof(kind="divergence", culprit=culprit, witnesses=[witnesses[0], forged_sig]),
        "another key": Proof(kind="divergence", culprit=culprit, witnesses=[witnesses[0], stolen_key]),
        "one witness": Proof(kind="divergence", culprit=culprit, witnesses=witnesses[:1]),
        "the same witness twice": Proof(kind="divergence", culprit=culprit, witnesses=[witnesses[0]] * 2),
        "different steps": Proof(kind="divergence", culprit=culprit, witnesses=[witnesses[0], other_history]),
        "an honest culprit": Proof(kind="divergence", culprit=witnesses[0], witnesses=[witnesses[1], culprit]),
        "agreeing receipts": Proof(kind="equivocation", culprit=culprit, witnesses=[culprit]),
        "two signers": Proof(kind="equivocation", culprit=culprit, witnesses=[witnesses[0]]),
    }
    for what, proof in forgeries.items():
        with pytest.raises(InvalidProof):
            check_proof(proof)
        assert what
    # sybils that serve no such range (as the tracker's assignment says) cannot outvote an honest stage
    honest = ledger(SIGNERS[1], (2, 4)).sign(0, 4, row_hash(b"rows in"), row_hash(b"truth"))
    sybils = [ledger(Signer(NodeIdentity.generate()), (2, 4), "x").sign(0, 4, row_hash(b"rows in"), row_hash(b"lie"))
              for _ in range(2)]
    framing = Proof(kind="divergence", culprit=honest, witnesses=sybils)
    assert check_proof(framing) == SIGNERS[1].node_id  # without a view of who serves what, it looks valid
    assigned = {SIGNERS[1].node_id, REPLICAS[0].node_id, REPLICAS[1].node_id}
    with pytest.raises(InvalidProof, match="does not serve"):
        check_proof(framing, lambda node, model, begin, end: node in assigned)


def test_bounds_on_receipts_and_proofs_are_held_by_the_decoder() -> None:
    culprit, witnesses = divergence()
    too_long = encode(Receipts.unvalidated({"type": "receipts", "v": 1, "session": "s1", "epoch": 0,
                                           "chain": pack_chain([culprit] * (MAX_CHAIN + 1))}))
    with pytest.raises(ProtocolError, match=r"^BAD_REQUEST: receipts v1: undecodable msgpack: \d+ exceeds max_bin_len"):
        decode(too_long, STAGE)
    crowded = encode(ProofGossip.unvalidated({"type": "proof", "v": 1, "proof": Proof.model_construct(
        kind="divergence", culprit=culprit, witnesses=witnesses * (MAX_WITNESSES // 2 + 1))}))
    with pytest.raises(ProtocolError, match=r"^BAD_REQUEST: proof v1: undecodable msgpack: \d+ exceeds max_array_len"):
        decode(crowded, STAGE)
    # a proof's full receipts: a hash of another length, a signature too long, a negative position
    for field, value in (("h_out", b"x" * 64), ("signature", b"s" * 65), ("pos", -1)):
        body = msgpack.unpackb(encode(ProofGossip(proof=Proof(kind="divergence", culprit=culprit,
                                                              witnesses=witnesses)))[4:])
        body["proof"]["culprit"][field] = value
        packed = msgpack.packb(body, use_bin_type=True)
        with pytest.raises(ProtocolError, match=r"^BAD_REQUEST: (invalid proof v1 message: proof\.culprit\.|"
                                                 r"proof v1: undecodable msgpack: \d+ exceeds max_bin_len)"):
            decode(len(packed).to_bytes(4, "big") + packed, STAGE)
    with pytest.raises(ProtocolError, match=r"^BAD_REQUEST: invalid inputs_request v1 message: until: Input should be"):
        decode(encode(InputsRequest.unvalidated({"type": "inputs_request", "v": 1, "session": "s1", "epoch": 0,
                                                 "until": -5})), STAGE)


def test_a_packed_chain_holds_its_receipts_and_refuses_garbage_as_payload_corrupt() -> None:
    ledgers = [ledger(s, r) for s, r in zip(SIGNERS, RANGES, strict=True)]
    outs = [row_hash(b"rows after head"), row_hash(b"rows after mid"), tokens_hash([])]
    chain = honest_chain(0, 5, tokens_hash([1, 2, 3, 4, 5]), outs, ledgers)
    packed = pack_chain(chain)
    assert len(packed) == WIRE_BYTES * len(chain) and WIRE_BYTES == 180
    # the session, epoch and model are the receiver's: the same receipts, signatures holding
    back = unpack_chain(packed, "s1", 0, MODEL)
    assert list(back) == chain and all(r.verify() for r in back)
    assert [r.hash for r in back] == [r.hash for r in chain]
    # unpacked as of another session, epoch or model, no signature holds: nothing carries over
    for context in (("s2", 0, MODEL), ("s1", 1, MODEL), ("s1", 0, "cd" * 32)):
        assert not any(r.verify() for r in unpack_chain(packed, *context)), context
    # truncated, a byte too many, empty, over MAX_CHAIN, or fields out of their bounds: a typed error
    too_many_tokens = bytearray(packed[:WIRE_BYTES])
    too_many_tokens[4:8] = (MAX_TOKENS + 1).to_bytes(4, "little")
    no_tokens = bytearray(packed[:WIRE_BYTES])
    no_tokens[4:8] = bytes(4)
    negative_pos = b"\xff" * 4 + packed[4:WIRE_BYTES]
    far_layer = packed[:12] + (MAX_LAYERS + 1).to_bytes(4, "little") + packed[16:WIRE_BYTES]
    for garbage in (packed[:-1], packed + b"\x00", b"", packed[:WIRE_BYTES] * (MAX_CHAIN + 1),
                    bytes(too_many_tokens), bytes(no_tokens), negative_pos, far_layer):
        for reader in (unpack_chain, read_chain):
            with pytest.raises(ProtocolError) as refused:
                reader(garbage, "s1", 0, MODEL)
            assert refused.value.code is ErrorCode.PAYLOAD_CORRUPT
    # read without building receipts: the same fields, hashes, signatures and bytes as the receipts'
    read = read_chain(packed, "s1", 0, MODEL)
    assert [read.receipt(k) for k in range(len(read))] == chain and read.data == packed
    assert [read.hash(k) for k in range(len(read))] == [r.hash for r in chain] and read.hash(-1) == chain[-1].hash
    assert all(read.verify(k) for k in range(len(read))) and read.wire(-1) == chain[-1].wire
    assert [link.node_id for link in read.links] == [s.node_id for s in SIGNERS]
    assert not read_chain(packed, "s2", 0, MODEL).verify(0)
    # random bytes of a receipt's length unpack (every field in bounds) and verify as nothing
    noise = np.random.default_rng(3).bytes(WIRE_BYTES)
    noise = b"\x01\x00\x00\x00\x01\x00\x00\x00" + bytes(8) + noise[16:]
    (made_up,) = unpack_chain(noise, "s1", 0, MODEL)
    assert not made_up.verify()
    # an unsigned receipt does not travel
    with pytest.raises(ValueError, match="only a signed receipt"):
        pack_chain([chain[0].model_copy(update={"signature": b""})])


def test_each_activation_brings_its_own_chain_inside_it_and_only_where_receipts_are_on() -> None:
    culprit, _ = divergence()
    with_chain = Activation(session="s1", epoch=0, step=0, pos=3, n_tokens=1, tensors=[], tokens=[9],
                            receipts=pack_chain([culprit]))
    bare = with_chain.model_copy(update={"receipts": None})
    with pytest.raises(ProtocolError) as missing:
        chain_of(bare, True, "sender")
    assert missing.value.code is ErrorCode.PAYLOAD_CORRUPT
    assert chain_of(with_chain, True, "sender") == ("sender", culprit.wire)
    with pytest.raises(ProtocolError, match="did not ask"):
        chain_of(with_chain, False, "sender")
    assert chain_of(bare, False, "sender") is None
    # one frame: the receipts travel in the activation's own message, held to the chain's bound
    assert decode(encode(with_chain), STAGE) == with_chain
    too_long = encode(Activation.of(session="s1", epoch=0, step=0, pos=3, n_tokens=1, tensors=[], tokens=[9],
                                    receipts=pack_chain([culprit] * (MAX_CHAIN + 1))))
    with pytest.raises(ProtocolError, match=r"^BAD_REQUEST: invalid activation v1 message: receipts: Data should have at most"):
        decode(too_long, STAGE)


def test_a_stage_refusing_its_input_as_corrupt_and_its_upstream_are_both_routed_around() -> None:
    ids = ["head", "mid", "tail"]
    corrupt = StageError(2, ProtocolError(ErrorCode.PAYLOAD_CORRUPT, "receipts from the upstream stage: x"))
    # its word against its upstream's, on what only the two of them saw: neither is believed
    assert (blamed(corrupt, ids).culprit, blamed(corrupt, ids).also) == ("mid", "tail")
    # the head's input comes around the ring, from the tail
    ring = blamed(StageError(0, ProtocolError(ErrorCode.PAYLOAD_CORRUPT, "x")), ids)
    assert (ring.culprit, ring.also) == ("tail", "head")
    dead = StageError(1, ProtocolError(ErrorCode.UNREACHABLE, "lost"))
    assert blamed(dead, ids) is dead


def test_a_stage_checks_its_senders_signature_and_every_link_by_hash() -> None:
    ledgers = [ledger(s, r) for s, r in zip(SIGNERS, RANGES, strict=True)]
    outs = [row_hash(b"rows after head"), row_hash(b"rows after mid"), tokens_hash([])]
    chain = honest_chain(0, 5, tokens_hash([1, 2, 3, 4, 5]), outs, ledgers)
    step = Step("s1", 0, 0, 5, 6, SIGNERS[2].node_id, outs[2], decode=False)
    check_chain(packed(chain), step, signatures="sender")
    # the sender's own receipt changed after signing
    with pytest.raises(BrokenChain, match="receipt 2 has a bad signature") as broken:
        check_chain(packed([*chain[:2], chain[2].model_copy(update={"h_hist": row_hash(b"other")})]), step, "sender")
    assert broken.value.culprit is None
    # an earlier receipt changed on the way: the sender's signature covers it by hash
    with pytest.raises(BrokenChain, match="does not follow"):
        check_chain(packed([chain[0].model_copy(update={"h_hist": row_hash(b"other")}), *chain[1:]]), step, "sender")


def test_a_stage_refuses_a_forwarded_chain_with_any_byte_changed() -> None:
    ledgers = [ledger(s, r) for s, r in zip(SIGNERS, RANGES, strict=True)]
    # the head's and the middle's receipts of a prefill step, as the tail reads them off the activation
    chain = honest_chain(0, 3, tokens_hash([1, 2, 3]), [row_hash(b"a"), row_hash(b"b")], ledgers[:2])
    packed = pack_chain(chain)
    rows = Activation(session="s1", epoch=0, step=0, pos=0, n_tokens=3, tensors=[])
    held = (SIGNERS[1].node_id, packed)
    assert check_incoming(held, rows, 4, row_hash(b"b"), False, 3, MODEL).data == packed
    # the sender's own receipt fails its signature, the head's the link to it (or a field check)
    for at in range(len(packed)):
        forged = bytearray(packed)
        forged[at] ^= 0x01
        with pytest.raises(ProtocolError) as refused:
            check_incoming((held[0], bytes(forged)), rows, 4, row_hash(b"b"), False, 3, MODEL)
        assert refused.value.code is ErrorCode.PAYLOAD_CORRUPT, at


def test_the_asker_blames_the_stage_that_signed_over_a_forged_receipt() -> None:
    # the middle stage forges the head's receipt (its signature does not hold) and signs over it
    head = ledger(SIGNERS[0], RANGES[0]).sign(0, 3, tokens_hash([1, 2, 3]), row_hash(b"a"))
    forged = head.model_copy(update={"h_hist": row_hash(b"made up")})
    mid = ledger(SIGNERS[1], RANGES[1]).sign(0, 3, row_hash(b"a"), row_hash(b"b"), forged)
    tail = ledger(SIGNERS[2], RANGES[2]).sign(0, 3, row_hash(b"b"), tokens_hash([9]), mid)
    step = Step("s1", 0, 0, 3, 6, SIGNERS[2].node_id, tail.h_out, decode=False)
    # the tail checked only the middle's signature, which holds
    check_chain(packed([forged, mid, tail]), step, signatures="sender")
    with pytest.raises(BrokenChain, match="receipt 0 has a bad signature") as broken:
        check_chain(packed([forged, mid, tail]), step)
    assert broken.value.culprit == 1
    audit = Audit("s1", 0, [s.node_id for s in SIGNERS], 6, AskResult(prompt_tokens=[1, 2, 3]), prompt_len=3, model=MODEL)
    # the links hold, so the chain is taken in; signatures are checked where a receipt becomes
    # evidence: a lie the forged receipt shows is laid at the stage that signed over it
    audit.on_packed("s1", 0, pack_chain([forged, mid, tail]))
    # each stage's receipt is kept as the chain it came in, and built whole where it is asked for
    assert [audit.by_stage[k][0] for k in range(3)] == [forged, mid, tail]
    assert audit.answerable(0, 0) == 1 and audit.answerable(1, 0) == 1
    lie = audit.lie_about(0, 0, "its output differs from two replicas'")
    assert lie.culprit == SIGNERS[1].node_id and lie.untrusted_from == 0 and lie.proof is None
    assert "signed over a forged receipt of stage 0" in lie.message


def test_receipts_do_not_carry_the_node_id_and_derive_it_from_the_key() -> None:
    r = ledger(SIGNERS[0], RANGES[0]).sign(0, 3, tokens_hash([1, 2, 3]), row_hash(b"a"))
    assert "node_id" not in r.model_dump() and r.node_id == SIGNERS[0].node_id and r.verify()
    other = Signer(NodeIdentity.generate())
    assert not r.model_copy(update={"public_key": other.public_key}).verify()


def test_a_receipts_kept_signed_bytes_and_hash_are_its_own_and_never_a_copys() -> None:
    r = ledger(SIGNERS[0], RANGES[0]).sign(0, 3, tokens_hash([1, 2, 3]), row_hash(b"a"))
    signing, h = r.signing_bytes(), r.hash
    # worked out once, and the same as for the receipt validated from its fields
    assert r.signing_bytes() is signing and r.hash is h
    fresh = Receipt.model_validate(r.model_dump())
    assert fresh == r and fresh.signing_bytes() == signing and fresh.hash == h and fresh.verify()
    # a copy with another field signs and hashes other bytes: a forgery cannot borrow the original's
    for name, value in [("h_out", row_hash(b"b")), ("pos", 1), ("epoch", 1), ("session", "s2"), ("model", "cd" * 32)]:
        forged = r.model_copy(update={name: value})
        assert forged.signing_bytes() != signing and forged.hash != h and not forged.verify(), name
    resigned = r.model_copy(update={"signature": b"\x00" * 64})
    assert resigned.signing_bytes() == signing and resigned.hash != h and not resigned.verify()


def test_the_ring_brings_the_tails_receipt_alone_and_the_head_refuses_any_other() -> None:
    ledgers = [ledger(s, r) for s, r in zip(SIGNERS, RANGES, strict=True)]
    chain = honest_chain(0, 3, tokens_hash([1, 2, 3]), [row_hash(b"a"), row_hash(b"b"), tokens_hash([9])], ledgers)
    tail = chain[-1]
    token = Activation(session="s1", epoch=0, step=0, pos=3, n_tokens=1, tensors=[], tokens=[9])
    sender = SIGNERS[2].node_id
    assert check_incoming((sender, tail.wire), token, 6, tokens_hash([9]), True, 3, MODEL).data == tail.wire
    attacks = {
        "alone": ((sender, pack_chain(chain)), token, tokens_hash([9])),
        "ends at": ((sender, tail.wire), token.model_copy(update={"pos": 4}), tokens_hash([9])),
        "not the sender's": ((SIGNERS[1].node_id, tail.wire), token, tokens_hash([9])),
        "not the one": ((sender, tail.wire), token, tokens_hash([8])),
        "bad signature": ((sender, tail.model_copy(update={"h_hist": row_hash(b"x")}).wire), token, tokens_hash([9])),
        "covers layers": ((SIGNERS[1].node_id, chain[1].wire), token, row_hash(b"b")),
    }
    for what, (held, msg, h) in attacks.items():
        with pytest.raises(ProtocolError, match=what) as refused:
            check_incoming(held, msg, 6, h, True, 3, MODEL)
        assert refused.value.code is ErrorCode.PAYLOAD_CORRUPT


class FakePeers:
    """The asker's peers, a fake: no replica can be dialled."""

    node_id = "f" * 64

    async def open_stream(self, address: str, protocol: str, node_id: str | None = None) -> None:
        raise ProtocolError(ErrorCode.UNREACHABLE, f"{address} refused the connection")


class FakeSilentStage:
    """A stage's control stream, a fake: it never hands over the inputs a spot check asks for."""

    async def send_message(self, message: Message) -> None:
        await trio.sleep_forever()


class FakeEvictingStage:
    """A stage's control stream, a fake: it takes a spot check's request for inputs, then ends the
    finished session (evicted, as an idle one may be) instead of handing them over."""

    def __init__(self) -> None:
        self.asked = trio.Event()

    async def send_message(self, message: Message) -> None:
        self.asked.set()

    async def receive_message(self) -> Message:
        await self.asked.wait()
        return error_message(ProtocolError(ErrorCode.CACHE_MISS, "evicted (least recently used)"))


def answered_route() -> tuple[list[Stage], list[str], AskResult]:
    """A three-stage route of SIGNERS and an answer it gave (3 prompt tokens, one new)."""
    ids = [s.node_id for s in SIGNERS]
    route = [Stage(f"127.0.0.1:{7000 + i}", node, MODEL, layers) for i, (node, layers) in enumerate(zip(ids, RANGES,
                                                                                                      strict=True))]
    result = AskResult(prompt_tokens=[1, 2, 3], tokens=[9], reason="max_tokens", started=0.0, first_token_at=0.5,
                       finished_at=1.0, route=[StageInfo(node_id=node, model_digest=MODEL, model_name="m",
                                                         layer_begin=b, layer_end=e, n_layer=6, stage_width=8, ready=True)
                                               for node, (b, e) in zip(ids, RANGES, strict=True)])
    return route, ids, result


async def test_what_no_replica_checked_is_said_in_the_result_and_the_figures_line_with_why(
        autojump_clock: trio.abc.Clock) -> None:
    route, ids, result = answered_route()
    # the head's range has a replica that cannot be dialled, the middle's none, and the tail's check
    # never ends (the tail never hands over its inputs): each is said, with the true reason
    replicas = [Stage("127.0.0.1:7998", REPLICAS[1].node_id, MODEL, RANGES[0]),
                Stage("127.0.0.1:7999", REPLICAS[0].node_id, MODEL, RANGES[2])]
    verifier = Verifier(FakePeers(), CheckPlan(every=16, candidates=replicas))  # type: ignore[arg-type]
    verifier.begin("s1", 0, route, ids, 6, result, 3, [None, None, FakeSilentStage()],  # type: ignore[list-item]
                   Sampling())
    assert verifier.audit is not None
    verifier.audit.next_pos = 4
    async with trio.open_nursery() as nursery:
        nursery.start_soon(verifier.run_checks)
        await verifier.settle(1.0)
        nursery.cancel_scope.cancel()
    assert [n.layers for n in result.unverified] == ["[0, 2)", "[2, 4)", "[4, 6)"]
    assert [n.node_id for n in result.unverified] == ids and {n.since for n in result.unverified} == {0}
    assert [n.why for n in result.unverified] == [
        "every replica failed, the last at 127.0.0.1:7998: UNREACHABLE: 127.0.0.1:7998 refused the connection",
        "no replica", "its check did not end within 1 s"]
    assert str(result.unverified[1]) == f"layers [2, 4) of node {ids[1][:16]} unchecked from position 0 (no replica)"
    assert not result.verified and result.checked
    # the ranges no replica serves are said once, together; the others each with its reason
    line = figures_line(result)
    assert ", unchecked (no replica): layers [2, 4), layers [0, 2) of node" in line
    assert line.count("(no replica)") == 1 and line.endswith("(its check did not end within 1 s), stopped by max_tokens]")
    result.unverified[1] = replace(result.unverified[1], since=3, kind=Gap.CUT_SHORT,
                                    detail="its check did not end within 1 s")
    assert "(no replica)" not in figures_line(result)
    # a failover's next route that shares a range and node says it once, from where it was first unchecked
    for note in list(result.unverified):
        result.note_unchecked(replace(note, since=2))
    assert len(result.unverified) == 3 and [n.since for n in result.unverified] == [0, 2, 0]
    assert figures_line(result).count(f"layers [4, 6) of node {ids[2][:16]}") == 1


def test_a_nodes_signature_is_its_keys_own_ed25519_signature() -> None:
    # NodeIdentity signs through libsodium, receipts verify through it and records through OpenSSL:
    # one deterministic RFC 8032 signature, whichever library made or checks it
    from wire.identity import verify

    identity = NodeIdentity.generate()
    for message in (b"", b"meshd" * 200):
        signature = identity.sign(message)
        assert signature == identity.private_key.sign(message)
        assert verify(identity.public_key, message, signature)
        assert not verify(identity.public_key, message + b"!", signature)


def test_each_step_is_drawn_for_a_check_at_one_in_every() -> None:
    class Sink:
        def __init__(self) -> None:
            self.drawn: list[int] = []

        def send_nowait(self, pos: int) -> None:
            self.drawn.append(pos)

    counts = {}
    for every in (1, 16, 1 << 30):
        sink = Sink()
        draws = Draws(sink, CheckPlan(every=every, rng=random.Random(5)))  # a sink in place of a channel
        for pos in range(16_000):
            draws.send_nowait(pos)
        counts[every] = sink.drawn
    # every step at 1 in 1; about 1 in 16, spread
    # over the answer, not bunched at its start; none at 1 in 2**30
    assert counts[1] == list(range(16_000)) and counts[1 << 30] == []
    assert 850 < len(counts[16]) < 1150 and 400 < sum(p < 8_000 for p in counts[16]) < 600


async def test_a_stage_ending_the_finished_session_ends_its_ranges_last_check_not_the_answer(
        autojump_clock: trio.abc.Clock) -> None:
    route, ids, result = answered_route()
    tail = FakeEvictingStage()
    replica = Stage("127.0.0.1:7999", REPLICAS[0].node_id, MODEL, RANGES[2])
    verifier = Verifier(FakePeers(), CheckPlan(every=16, candidates=[replica]))  # type: ignore[arg-type]
    verifier.begin("s1", 0, route, ids, 6, result, 3, [None, None, tail], Sampling())  # type: ignore[list-item]
    assert verifier.audit is not None
    verifier.audit.next_pos = 4
    # the tail's Done came: its stream's watcher and the last checks run while the verifier settles
    answered = trio.Event()
    answered.set()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(verifier.run_checks)
        nursery.start_soon(_watch_for_errors, tail, answered, verifier, 2)
        await verifier.settle(30.0)
        nursery.cancel_scope.cancel()
    assert (result.unverified[-1].layers, result.unverified[-1].since, result.unverified[-1].why) == (
        "[4, 6)", 0, "its stage ended the session before it handed over the inputs to check")
    # while the answer still streams, the same is the stage's error, which fails the epoch
    with pytest.raises(ProtocolError, match="evicted") as failed:
        await _watch_for_errors(tail, trio.Event(), verifier, 2)  # type: ignore[arg-type]
    assert failed.value.code is ErrorCode.CACHE_MISS


class FakeMiddleStage:
    """A middle stage's control stream, a fake: it answers a spot check's request for its inputs with
    ``answer(steps it kept)`` (the Inputs it sends, or None: it never answers), through the asker's inbox."""

    def __init__(self, kept: list[StepInput], answer: Callable[[list[StepInput]], list[Inputs] | None],
                 inbox: trio.MemorySendChannel[Inputs]) -> None:
        self.kept = kept
        self.answer = answer
        self.inbox = inbox

    async def send_message(self, message: Message) -> None:
        assert isinstance(message, InputsRequest)
        for reply in self.answer(self.kept) or []:
            await self.inbox.send(reply)


def inputs(steps: list[StepInput], more: bool = False) -> Inputs:
    return Inputs(session="s1", epoch=0, steps=steps, more=more)


async def checked_middle(answer: Callable[[list[StepInput]], list[Inputs] | None]) -> tuple[AskResult, StageLied | None]:
    """A two-step answer (a prompt of 3, one decode step) on a route of SIGNERS, its middle stage checked at
    1 in 1 against a replica nobody can dial: the result, and the lie the check laid at the middle, if any."""
    route, ids, result = answered_route()
    ledgers = [ledger(s, r) for s, r in zip(SIGNERS, RANGES, strict=True)]
    rows = [np.full((3, 8), 0.5, np.float32).tobytes(), np.full((1, 8), 0.25, np.float32).tobytes()]
    kept = [StepInput(pos=0, n_tokens=3, tensor=TensorEntry.from_array("hidden_states", np.full((3, 8), 0.5, np.float32))),
            StepInput(pos=3, n_tokens=1, tensor=TensorEntry.from_array("hidden_states", np.full((1, 8), 0.25, np.float32)))]
    prompt = honest_chain(0, 3, tokens_hash([1, 2, 3]), [row_hash(rows[0]), row_hash(b"b"), tokens_hash([9])], ledgers)
    step = honest_chain(3, 1, tokens_hash([9]), [row_hash(rows[1]), row_hash(b"d"), tokens_hash([7])], ledgers, prompt[-1])
    replica = Stage("127.0.0.1:7999", REPLICAS[0].node_id, MODEL, RANGES[1])
    result.tokens = []
    verifier = Verifier(FakePeers(), CheckPlan(every=1, candidates=[replica], inputs_seconds=5.0))  # type: ignore[arg-type]
    verifier.begin("s1", 0, route, ids, 6, result, 3, [None, None, None], Sampling())
    inbox = verifier.inbox(1)
    assert inbox is not None and verifier.audit is not None
    check = verifier._checks[0][0]
    assert isinstance(check, RangeCheck)
    check.source = KeptInputs(verifier.audit, 1, FakeMiddleStage(kept, answer, inbox),  # type: ignore[arg-type]
                              verifier.inboxes[1], verifier.plan)
    lie = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(verifier.run_checks)
            verifier.on_chain("s1", 0, pack_chain(prompt))
            verifier.on_token(9)
            result.tokens.append(9)
            verifier.on_chain("s1", 0, pack_chain([prompt[-1], *step]))
            verifier.on_token(7)
            await verifier.settle(60.0)
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        lie = first_error(group)
        assert isinstance(lie, StageLied), repr(lie)
    return result, lie


async def test_a_stage_that_withholds_shortens_reorders_or_delays_its_inputs_fails_its_check(
        autojump_clock: trio.abc.Clock) -> None:
    # honest: both steps' inputs, in order; the check goes on to the replica (which nobody can dial)
    result, lie = await checked_middle(lambda kept: [inputs(kept)])
    assert lie is None and [n.why[:20] for n in result.unverified if n.layers == "[2, 4)"] == ["every replica failed"]
    # in two messages, as a stage sends many steps' rows, is as good
    result, lie = await checked_middle(lambda kept: [inputs(kept[:1], more=True), inputs(kept[1:])])
    assert lie is None
    attacks: dict[str, tuple[Callable[[list[StepInput]], list[Inputs] | None], str]] = {
        "nothing": (lambda kept: [inputs([])], "withheld the inputs of 2 step(s)"),
        "short": (lambda kept: [inputs(kept[:1])], "withheld the inputs of 1 step(s)"),
        "reordered": (lambda kept: [inputs(kept[::-1])], "out of order"),
        "twice": (lambda kept: [inputs([kept[0], kept[0]])], "out of order"),
        "late": (lambda kept: None, "within 5 s"),
    }
    for what, (answer, reason) in attacks.items():
        result, lie = await checked_middle(answer)
        assert lie is not None and lie.culprit == SIGNERS[1].node_id and reason in lie.message, (what, lie)
        # nothing it computed since its last check is trusted: the answer is generated again
        assert lie.untrusted_from == 0 and lie.retryable and lie.proof is None, what
