"""Signed capability records and the store that admits them."""

from __future__ import annotations

from collections import OrderedDict

import msgpack
import pytest
from instant_net import identity, record
from pydantic import ValidationError

from meshd.mesh.records import (
    MAX_HELD,
    MAX_LAYERS,
    CapabilityRecord,
    HeldRange,
    ModelInfo,
    RecordStore,
    ServedRange,
    Verdict,
)
from wire import swim
from wire.swim import Placement

MODEL = ModelInfo(
    digest="sha256:abc",
    name="SmolLM2-135M-Instruct",
    n_layers=30,
    bytes_per_layer=3_000_000,
    kv_bytes_per_token=2304,
    head_bytes=28_000_000,
    tail_bytes=0,
)


def full_record(version: int = 1) -> CapabilityRecord:
    return record(
        1,
        version,
        reachability="nat",
        relay_addresses=["203.0.113.5:7401"],
        roles=["relay"],
        memory_bytes=8 << 30,
        seconds_per_layer=0.00031,
        models=[MODEL],
        served=[ServedRange(model=MODEL.digest, start=0, end=15)],
        load=0.25,
        started_at=1_700_000_000.5,
    )


def over_the_wire(rec: CapabilityRecord) -> CapabilityRecord:
    return CapabilityRecord.model_validate(
        msgpack.unpackb(msgpack.packb(rec.model_dump(), use_bin_type=True))
    )


def test_a_signed_record_verifies_after_crossing_the_wire() -> None:
    rec = full_record()
    assert rec.verify()
    received = over_the_wire(rec)
    assert received == rec
    assert received.verify()


def test_evolve_signs_the_next_version() -> None:
    rec = full_record()
    newer = rec.evolve(identity(1), load=0.9)
    assert (newer.version, newer.load, newer.models) == (2, 0.9, rec.models)
    assert newer.verify()
    assert rec.evolve(identity(1), version=50).version == 50
    with pytest.raises(ValueError):
        rec.evolve(identity(1), version=1)
    with pytest.raises(ValueError):
        rec.evolve(identity(2))


def test_store_accepts_newer_versions_only() -> None:
    store = RecordStore()
    v1, v2 = full_record(1), full_record(2)
    assert store.offer(v1) is Verdict.ACCEPTED
    assert store.offer(v2) is Verdict.ACCEPTED
    assert store.get(v1.node_id) == v2
    assert store.offer(v2) is Verdict.DUPLICATE


def test_replayed_old_record_is_dropped() -> None:
    store = RecordStore()
    v1 = full_record(1)
    store.offer(v1)
    store.offer(v1.evolve(identity(1)))
    assert store.offer(v1) is Verdict.STALE
    assert store.get(v1.node_id).version == 2
    assert store.stats.stale == 1


def test_a_forgotten_node_cannot_be_brought_back_by_a_replay() -> None:
    store = RecordStore()
    v1 = full_record(1)
    store.offer(v1)
    store.offer(v1.evolve(identity(1), leaving=True))
    store.forget(v1.node_id)
    assert store.get(v1.node_id) is None
    assert store.offer(v1) is Verdict.STALE


def test_record_with_bad_signature_is_rejected() -> None:
    store = RecordStore()
    genuine = full_record(1)
    # Same signature, one field changed: a relay trying to inflate a node's memory.
    tampered = genuine.model_copy(update={"memory_bytes": 1 << 40, "version": 2})
    assert not tampered.verify()
    assert store.offer(tampered) is Verdict.FORGED
    # Signed by another key that does not hash to the node id it claims.
    impostor = CapabilityRecord.create(identity(2), 3).model_copy(update={"node_id": genuine.node_id})
    assert store.offer(impostor) is Verdict.FORGED
    # A stranger's key in the record, signed by that stranger, still claiming the victim's id.
    stranger = identity(3)
    body = genuine.model_copy(update={"public_key": stranger.public_key, "version": 4, "signature": b""})
    assert (
        store.offer(body.model_copy(update={"signature": stranger.sign(body.signing_bytes())}))
        is Verdict.FORGED
    )
    assert store.get(genuine.node_id) is None
    assert store.stats.forged == 3


_MUTATIONS = {
    "node_id": identity(3).node_id,
    "public_key": identity(3).public_key,
    "version": 2,
    "addresses": ["198.51.100.7:7400"],
    "relay_addresses": ["203.0.113.9:7401"],
    "reachability": "public",
    "roles": [],
    "memory_bytes": 16 << 30,
    "gpu_memory_bytes": 8 << 30,
    "gpu_layers": -1,
    "kv_tokens": 4096,
    "seconds_per_layer": 0.001,
    "numerics": "0123456789abcdef/x86_64/gpu",
    "offload": "layers [15, 30) and the output head on Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits)), 80.0 MiB",
    "served": [ServedRange(model=MODEL.digest, start=15, end=30)],
    "holds": [HeldRange(model=MODEL.digest, start=0, end=30)],
    "models": [MODEL.model_copy(update={"whole": False})],
    "load": 0.0,
    "started_at": 0.0,
    "tracker_term": 7,
    "vote_term": 7,
    "vote_for": identity(2).node_id,
    "assignment_version": 3,
    "placement": Placement.create(identity(2), 7, identity(1).node_id, MODEL.digest, 0, 15),
    "leaving": True,
}


def test_the_mutations_name_every_signed_field() -> None:
    # a field added to the record without a mutation here fails this, not silently the signature's reach
    assert set(_MUTATIONS) == set(CapabilityRecord.model_fields) - {"signature"}


@pytest.mark.parametrize("field", sorted(_MUTATIONS))
def test_every_field_is_covered_by_the_signature(field: str) -> None:
    rec = full_record()
    assert rec.verify()
    changed = rec.model_copy(update={field: _MUTATIONS[field]})
    assert getattr(changed, field) != getattr(rec, field)
    assert not changed.verify()


def test_untrusted_records_are_bounded() -> None:
    fields = full_record().model_dump()
    with pytest.raises(ValidationError):
        CapabilityRecord.model_validate({**fields, "addresses": [f"h{i}:1" for i in range(100)]})
    with pytest.raises(ValidationError):
        CapabilityRecord.model_validate({**fields, "served": [{"model": "m", "start": 5, "end": 5}]})
    held = {"model": "m", "start": 0, "end": 1}
    with pytest.raises(ValidationError):
        CapabilityRecord.model_validate({**fields, "holds": [held] * (MAX_HELD + 1)})
    with pytest.raises(ValidationError):
        CapabilityRecord.model_validate({**fields, "holds": [{**held, "end": 0}]})
    with pytest.raises(ValidationError):
        CapabilityRecord.model_validate({**fields, "holds": [{**held, "end": MAX_LAYERS + 1}]})
    with pytest.raises(ValidationError):
        CapabilityRecord.model_validate({**fields, "public_key": b"short"})
    with pytest.raises(ValidationError):
        CapabilityRecord.model_validate({**fields, "surprise": 1})


def test_the_signature_cache_holds_digests_and_no_more_than_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked signatures are remembered by a 32-byte digest, at most ``_VERIFY_CACHE_SIZE`` of them. Keyed
    by the signed bytes (a record's are ~1.1 KB) a full cache held ~10 MiB, which hours of gossip filled:
    the soak's seed, relay and API member grew 0.2-0.35 MiB a minute for an hour."""
    monkeypatch.setattr(swim, "_VERIFY_CACHE_SIZE", 16)
    monkeypatch.setattr(swim, "_verified", OrderedDict())
    for version in range(1, 41):
        assert CapabilityRecord.create(identity(1), version).verify()
    assert len(swim._verified) == 16
    assert all(isinstance(key, bytes) and len(key) == 32 for key in swim._verified)
    # a forgery whose parts run together into a verified check's bytes is no cache hit
    genuine = CapabilityRecord.create(identity(2), 1)
    signed = genuine.signing_bytes()
    assert swim._verify_cached(genuine.public_key, signed, genuine.signature)
    assert not swim._verify_cached(genuine.public_key + genuine.signature[:1], signed, genuine.signature[1:])
    assert not swim._verify_cached(genuine.public_key[:-1], genuine.public_key[-1:] + signed, genuine.signature)


def test_a_checked_record_answers_again_from_memory_and_is_forgotten_with_it() -> None:
    """`verify` remembers its answer per live instance (frozen, it cannot change under it); a copy
    with one field changed is a new instance, checked afresh, and the answers go with the records."""
    before = len(swim._checked)
    genuine = full_record(4)
    assert genuine.verify() and genuine.verify()
    tampered = genuine.model_copy(update={"memory_bytes": 1 << 40})
    assert not tampered.verify() and not tampered.verify()
    assert len(swim._checked) == before + 2
    del genuine, tampered
    assert len(swim._checked) == before
