"""The secure channel: authentication, the mesh key, and tamper resistance."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from noise.backends.default import diffie_hellmans
from noise.connection import NoiseConnection

from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.link import SecureLink
from wire.noise import (
    MAX_PLAINTEXT,
    CipherState,
    RecordReader,
    SecureChannel,
    mesh_key_from_secret,
)

ALICE = NodeIdentity.from_private_bytes(bytes(range(32)))
BOB = NodeIdentity.from_private_bytes(bytes(range(1, 33)))
MALLORY = NodeIdentity.from_private_bytes(bytes(range(2, 34)))
STRANGER = NodeIdentity.from_private_bytes(bytes(range(3, 35)))


def pump(a: SecureChannel, b: SecureChannel) -> None:
    """Carry records both ways until quiet; the first error propagates."""
    moving = True
    while moving:
        moving = False
        for source, target in ((a, b), (b, a)):
            for record in source.records_to_send():
                moving = True
                target.receive_record(record)


def pair(
    a_key: bytes | None = None, b_key: bytes | None = None, expected: str | None = None
) -> tuple[SecureChannel, SecureChannel]:
    dialer = SecureChannel(
        ALICE,
        initiator=True,
        mesh_key=None if a_key is None else mesh_key_from_secret(a_key),
        expected_node_id=expected,
    )
    listener = SecureChannel(
        BOB, initiator=False, mesh_key=None if b_key is None else mesh_key_from_secret(b_key)
    )
    return dialer, listener


def both_errors(a: SecureChannel, b: SecureChannel) -> tuple[ProtocolError, ProtocolError]:
    """Run the handshake to its end, letting each side fail in turn."""
    for _ in range(6):
        for source, target in ((a, b), (b, a)):
            for record in source.records_to_send():
                try:
                    target.receive_record(record)
                except ProtocolError:
                    pass
    assert a.error is not None and b.error is not None
    return a.error, b.error


@pytest.mark.parametrize("key", [None, b"correct horse battery staple"])
def test_handshake_authenticates_both_node_ids(key: bytes | None) -> None:
    a, b = pair(key, key, expected=BOB.node_id)
    pump(a, b)
    assert a.established and b.established
    assert a.remote_node_id == BOB.node_id and b.remote_node_id == ALICE.node_id
    assert a.remote_public_key == BOB.public_key
    a.send(b"ping")
    b.send(b"pong")
    assert [b.receive_record(r) for r in a.records_to_send()] == [b"ping"]
    assert [a.receive_record(r) for r in b.records_to_send()] == [b"pong"]


@pytest.mark.parametrize(("a_key", "b_key"), [(b"one", b"two"), (b"one", None), (None, b"two")])
def test_a_wrong_mesh_key_is_refused_on_both_sides_with_a_clear_reason(
    a_key: bytes | None, b_key: bytes | None
) -> None:
    a, b = pair(a_key, b_key)
    dialer_error, listener_error = both_errors(a, b)
    for error in (dialer_error, listener_error):
        assert error.code is ErrorCode.UNAUTHORIZED
        assert "mesh key mismatch" in error.message
    assert not a.established and not b.established


@pytest.mark.parametrize("stranger_key", [None, b"a guess"])
def test_a_stranger_without_the_mesh_key_costs_no_dh_and_learns_nothing(
    stranger_key: bytes | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    listener = SecureChannel(BOB, initiator=False, mesh_key=mesh_key_from_secret(b"the key"))
    # Warm the per-identity static key first: it is made and signed once per node.
    SecureChannel(STRANGER, initiator=True).records_to_send()
    stranger = SecureChannel(
        STRANGER,
        initiator=True,
        mesh_key=None if stranger_key is None else mesh_key_from_secret(stranger_key),
    )
    (first,) = stranger.records_to_send()
    work: list[str] = []
    for name in ("dh", "generate_keypair"):
        original = getattr(diffie_hellmans.ED25519, name)
        monkeypatch.setattr(
            diffie_hellmans.ED25519,
            name,
            lambda self, *args, _n=name, _o=original: work.append(_n) or _o(self, *args),
        )
    monkeypatch.setattr(
        NodeIdentity, "sign", lambda self, message: work.append("sign") or b"\0" * 64
    )
    with pytest.raises(ProtocolError) as info:
        listener.receive_record(first)
    assert info.value.code is ErrorCode.UNAUTHORIZED
    assert work == []
    (reply,) = listener.records_to_send()
    assert reply[0] == 2  # a REJECT, never message 2
    assert BOB.public_key not in reply and BOB.node_id.encode() not in reply
    with pytest.raises(ProtocolError) as refused:
        stranger.receive_record(reply)
    assert "mesh key mismatch" in refused.value.message
    assert stranger.remote_node_id is None and stranger.remote_public_key is None


def test_the_mesh_key_authenticates_message_one() -> None:
    a, b = pair(b"k", b"k")
    (first,) = a.records_to_send()
    tampered = bytearray(first)
    tampered[-1] ^= 1  # the tag over message 1's empty payload
    with pytest.raises(ProtocolError, match=r"^UNAUTHORIZED: mesh key mismatch"):
        b.receive_record(bytes(tampered))
    assert [r[0] for r in b.records_to_send()] == [2]


def test_a_node_signs_its_static_key_once_not_per_handshake(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fresh, other = NodeIdentity.generate(), NodeIdentity.generate()
    signed: list[bytes] = []
    original = NodeIdentity.sign
    monkeypatch.setattr(
        NodeIdentity, "sign", lambda self, message: signed.append(message) or original(self, message)
    )
    for _ in range(3):
        a = SecureChannel(other, initiator=True, expected_node_id=fresh.node_id)
        b = SecureChannel(fresh, initiator=False)
        pump(a, b)
        assert a.established and a.remote_node_id == fresh.node_id
    assert len([m for m in signed if m.startswith(b"meshd-noise-static:")]) == 2


def test_reaching_a_different_node_than_expected_fails() -> None:
    a, b = pair(expected=MALLORY.node_id)
    dialer_error, listener_error = both_errors(a, b)
    assert dialer_error.code is ErrorCode.UNAUTHORIZED
    assert f"expected node {MALLORY.node_id}, reached node {BOB.node_id}" in dialer_error.message
    assert listener_error.code is ErrorCode.UNAUTHORIZED


class ForgingChannel(SecureChannel):
    """Claims BOB's identity but cannot sign with BOB's key."""

    def _proof(self) -> bytes:
        proof = super()._proof()
        return proof[:1] + BOB.public_key + proof[33:]


def test_an_identity_that_did_not_sign_the_static_key_is_refused() -> None:
    a = SecureChannel(ALICE, initiator=True)
    b = ForgingChannel(MALLORY, initiator=False)
    dialer_error, _ = both_errors(a, b)
    assert dialer_error.code is ErrorCode.UNAUTHORIZED
    assert "signature" in dialer_error.message


def established() -> tuple[SecureChannel, SecureChannel]:
    a, b = pair(b"k", b"k")
    pump(a, b)
    return a, b


def test_a_flipped_ciphertext_byte_kills_the_channel_and_releases_nothing() -> None:
    a, b = established()
    a.send(b"secret one")
    a.send(b"secret two")
    first, second = a.records_to_send()
    tampered = bytearray(first)
    tampered[3] ^= 0x01
    with pytest.raises(ProtocolError) as info:
        b.receive_record(bytes(tampered))
    assert info.value.code is ErrorCode.PAYLOAD_CORRUPT
    # The channel is dead: even the untouched records are refused now.
    for record in (first, second):
        with pytest.raises(ProtocolError, match=r"^PAYLOAD_CORRUPT: record failed authentication"):
            b.receive_record(record)


def test_a_replayed_record_is_rejected() -> None:
    a, b = established()
    a.send(b"transfer 100")
    [record] = a.records_to_send()
    assert b.receive_record(record) == b"transfer 100"
    with pytest.raises(ProtocolError) as info:
        b.receive_record(record)
    assert info.value.code is ErrorCode.PAYLOAD_CORRUPT


def test_reordered_records_are_rejected() -> None:
    a, b = established()
    a.send(b"first")
    a.send(b"second")
    first, second = a.records_to_send()
    with pytest.raises(ProtocolError, match=r"^PAYLOAD_CORRUPT: record failed authentication"):
        b.receive_record(second)


def test_large_plaintexts_are_split_into_records_that_fit_noise() -> None:
    a, b = established()
    payload = random.Random(1).randbytes(3 * MAX_PLAINTEXT + 5)
    a.send(payload)
    records = a.records_to_send()
    assert len(records) == 4 and all(len(r) <= 65535 for r in records)
    assert b"".join(b.receive_record(r) for r in records) == payload


def test_cipher_state_interoperates_with_noiseprotocol() -> None:
    """Our transport cipher is Noise's ChaChaPoly CipherState, nonce for nonce."""
    a = NoiseConnection.from_name(b"Noise_NN_25519_ChaChaPoly_BLAKE2s")
    b = NoiseConnection.from_name(b"Noise_NN_25519_ChaChaPoly_BLAKE2s")
    a.set_as_initiator()
    b.set_as_responder()
    a.start_handshake()
    b.start_handshake()
    b.read_message(a.write_message())
    a.read_message(b.write_message())
    ours_out = CipherState(a.noise_protocol.cipher_state_encrypt.k)
    ours_in = CipherState(a.noise_protocol.cipher_state_decrypt.k)
    for index in range(5):
        message = f"message {index}".encode()
        assert b.decrypt(ours_out.encrypt(message)) == message
        assert ours_in.decrypt(b.encrypt(message)) == message


def test_the_link_runs_the_mux_only_after_the_handshake() -> None:
    a = SecureLink(ALICE, dialer=True, expected_node_id=BOB.node_id)
    b = SecureLink(BOB, dialer=False)
    for _ in range(4):
        for record in a.records_to_send():
            b.receive_record(record)
        for record in b.records_to_send():
            a.receive_record(record)
    assert a.established and b.established and a.mux.ready and b.mux.ready
    stream_id = a.mux.open_stream("stage")
    a.mux.send_data(stream_id, b"hello", end=True)
    events = [e for r in a.records_to_send() for e in b.receive_record(r)]
    assert [type(e).__name__ for e in events] == ["StreamOpened", "DataReceived", "StreamEnded"]


def test_record_reader_reframes_a_byte_stream() -> None:
    records = [b"", b"a", b"b" * 300, b"c" * 65535]
    stream = b"".join(RecordReader.frame(r) for r in records)
    reader = RecordReader()
    out: list[bytes] = []
    for start in range(0, len(stream), 7777):
        out += reader.feed(stream[start : start + 7777])
    assert out == records


def test_mesh_key_is_the_secret_or_its_hash() -> None:
    assert mesh_key_from_secret(b"k" * 32) == b"k" * 32
    derived = mesh_key_from_secret(b"passphrase")
    assert len(derived) == 32 and derived != mesh_key_from_secret(b"passphrase2")
    with pytest.raises(ValueError):
        mesh_key_from_secret(b"")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=4), st.booleans())
def test_random_handshake_records_give_only_typed_errors(
    records: list[bytes], initiator: bool
) -> None:
    channel = SecureChannel(ALICE, initiator=initiator, mesh_key=b"m" * 32)
    for record in records:
        try:
            channel.receive_record(record)
        except ProtocolError as exc:
            assert exc.code in (ErrorCode.UNAUTHORIZED, ErrorCode.BAD_REQUEST)
            return


def test_mutated_handshakes_and_records_give_only_typed_errors() -> None:
    rng = random.Random(7)
    for _ in range(150):
        a, b = pair(b"k", b"k")
        victim = rng.randrange(6)
        count = 0
        for _ in range(4):
            for source, target in ((a, b), (b, a)):
                if source.can_send and source.error is None:
                    source.send(rng.randbytes(rng.randint(1, 2000)))
                for record in source.records_to_send():
                    data = bytearray(record)
                    if count == victim and data:
                        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
                    count += 1
                    try:
                        target.receive_record(bytes(data))
                    except ProtocolError as exc:
                        assert isinstance(exc.code, ErrorCode)
        assert count > victim
        assert a.error is not None or b.error is not None
