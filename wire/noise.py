"""The secure channel: a Noise XX handshake binding each side's Ed25519 identity.

``Noise_XX_25519_ChaChaPoly_BLAKE2s``, or ``Noise_XXpsk0_...`` keyed with the
mesh key. As in libp2p, each side proves its node identity by signing its
Noise static key (``"meshd-noise-static:" + static``) with its Ed25519 key in
the handshake payload; the payload is encrypted, so only the peer sees it.
Also as in libp2p, a node has one static key per identity, signed once, so a
handshake costs the responder one signature-free DH per message it answers.

The channel works on records (one Noise message each, at most 65535 bytes),
which a transport carries with their boundaries: one WebSocket message per
record, or a 2-byte length prefix on a byte stream (``RecordReader``).

Records during the handshake start with a kind byte:

* HANDSHAKE: a Noise handshake message (initiator: 1 and 3, responder: 2);
* REJECT: the sender refuses, with a reason in the clear (a hint only: an
  on-path attacker could forge it, but could as well just cut the link);
* CONFIRM: the responder accepted message 3; an AEAD record of nothing.

With psk0 the mesh key enters before message 1, whose (empty) payload is
then encrypted: a dialer without the key fails the responder's first AEAD
check, before any DH, key generation or signature, and gets a REJECT instead
of message 2, so it learns nothing of the node (not even its id). The
initiator waits for CONFIRM before it calls the channel established, so both
sides learn the reason of any later refusal.
After that every record is a bare ChaCha20-Poly1305 ciphertext under a
counter nonce: a replayed, reordered, dropped or altered record fails
authentication and kills the channel, and its plaintext is never released.
"""

from __future__ import annotations

import enum
import hashlib
import struct
import weakref
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from noise.backends.default.keypairs import KeyPair25519
from noise.connection import NoiseConnection
from noise.exceptions import (
    NoiseHandshakeError,
    NoiseInvalidMessage,
    NoiseMaxNonceError,
    NoiseValueError,
)

from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity, node_id_of, verify

PROTOCOL = b"Noise_XX_25519_ChaChaPoly_BLAKE2s"
PROTOCOL_PSK = b"Noise_XXpsk0_25519_ChaChaPoly_BLAKE2s"
PROLOGUE = b"meshd/secure-channel/1"
SIGNATURE_CONTEXT = b"meshd-noise-static:"
MAX_RECORD = 65535
TAG_BYTES = 16
MAX_PLAINTEXT = MAX_RECORD - TAG_BYTES
MESH_KEY_BYTES = 32

_HANDSHAKE, _REJECT, _CONFIRM = 1, 2, 3
_PAYLOAD_VERSION = 1
_PAYLOAD_BYTES = 1 + 32 + 64
_MAX_REASON_BYTES = 512

_MESH_KEY_REASON = "mesh key mismatch or corrupted handshake"
_NONCE = struct.Struct("<4xQ")
_MAX_NONCE = (1 << 64) - 1

# Everything noiseprotocol and cryptography raise on hostile handshake bytes.
_HANDSHAKE_FAILURES = (
    InvalidTag,
    ValueError,
    IndexError,
    TypeError,
    NoiseHandshakeError,
    NoiseInvalidMessage,
    NoiseValueError,
    NoiseMaxNonceError,
)


def mesh_key_from_secret(secret: bytes) -> bytes:
    """A 32-byte pre-shared key: the secret itself if it is 32 bytes, else its hash."""
    if not secret:
        raise ValueError("the mesh key is empty")
    if len(secret) == MESH_KEY_BYTES:
        return secret
    return hashlib.blake2s(secret, person=b"meshkey1").digest()


@dataclass(frozen=True, slots=True)
class _Static:
    """A node's Noise static key and its identity's signature over it."""

    keypair: KeyPair25519
    public: bytes
    proof: bytes


_STATICS: weakref.WeakKeyDictionary[NodeIdentity, _Static] = weakref.WeakKeyDictionary()


def _static_of(identity: NodeIdentity) -> _Static:
    static = _STATICS.get(identity)
    if static is None:
        private = X25519PrivateKey.generate()
        public_key = private.public_key()
        public = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        signature = identity.sign(SIGNATURE_CONTEXT + public)
        proof = bytes([_PAYLOAD_VERSION]) + identity.public_key + signature
        static = _Static(KeyPair25519(private, public_key, public), public, proof)
        _STATICS[identity] = static
    return static


class CipherState:
    """Noise's transport CipherState for ChaChaPoly: ENCRYPT(k, n++, ad="", p).

    noiseprotocol's own does the same through several Python layers; this is
    the hot path of every record. The counter nonce never repeats: it only
    moves forward, and only past records that authenticated.
    """

    __slots__ = ("_aead", "_nonce")

    def __init__(self, key: bytes) -> None:
        self._aead = ChaCha20Poly1305(key)
        self._nonce = 0

    def encrypt(self, plaintext: bytes | memoryview) -> bytes:
        nonce = self._nonce
        if nonce >= _MAX_NONCE:
            raise ProtocolError(ErrorCode.INTERNAL, "nonces exhausted; open a new link")
        self._nonce = nonce + 1
        return self._aead.encrypt(_NONCE.pack(nonce), plaintext, None)

    def decrypt(self, ciphertext: bytes) -> bytes:
        nonce = self._nonce
        if nonce >= _MAX_NONCE:
            raise ProtocolError(ErrorCode.INTERNAL, "nonces exhausted; open a new link")
        plaintext = self._aead.decrypt(_NONCE.pack(nonce), ciphertext, None)
        self._nonce = nonce + 1
        return plaintext


class _State(enum.Enum):
    HANDSHAKE = "handshake"
    AWAIT_CONFIRM = "await-confirm"
    ESTABLISHED = "established"
    FAILED = "failed"


class SecureChannel:
    """One side of a Noise channel. Feed it records; send the records it queues."""

    def __init__(
        self,
        identity: NodeIdentity,
        *,
        initiator: bool,
        mesh_key: bytes | None = None,
        expected_node_id: str | None = None,
    ) -> None:
        if mesh_key is not None and len(mesh_key) != MESH_KEY_BYTES:
            raise ValueError("a mesh key is 32 bytes; see mesh_key_from_secret")
        self._initiator = initiator
        self._expected = expected_node_id
        self._state = _State.HANDSHAKE
        self._out: list[bytes] = []
        self._error: ProtocolError | None = None
        self._encryptor: CipherState | None = None
        self._decryptor: CipherState | None = None
        self.remote_public_key: bytes | None = None
        self.remote_node_id: str | None = None

        self._static = _static_of(identity)
        self._noise = NoiseConnection.from_name(PROTOCOL if mesh_key is None else PROTOCOL_PSK)
        if initiator:
            self._noise.set_as_initiator()
        else:
            self._noise.set_as_responder()
        # The cached key pair, not set_keypair_from_private_bytes: that would
        # derive the public key again (a scalar multiplication) per connection.
        self._noise.noise_protocol.keypairs["s"] = self._static.keypair
        self._noise.set_prologue(PROLOGUE)
        if mesh_key is not None:
            self._noise.set_psks(psk=mesh_key)
        self._noise.start_handshake()
        if initiator:
            self._out.append(bytes([_HANDSHAKE]) + bytes(self._noise.write_message(b"")))

    # ----- state

    @property
    def established(self) -> bool:
        return self._state is _State.ESTABLISHED

    @property
    def can_send(self) -> bool:
        """Whether ``send`` may be called: the initiator may send once message 3 is out."""
        return self._encryptor is not None and self._error is None

    @property
    def error(self) -> ProtocolError | None:
        return self._error

    # ----- io

    def records_to_send(self) -> list[bytes]:
        out = self._out
        self._out = []
        return out

    def send(self, plaintext: bytes | memoryview) -> None:
        """Encrypt ``plaintext`` into as many records as it needs."""
        if self._error is not None:
            raise self._error
        if not self.can_send:
            raise RuntimeError("the handshake has not produced transport keys yet")
        assert self._encryptor is not None
        encrypt = self._encryptor.encrypt
        if len(plaintext) <= MAX_PLAINTEXT:
            self._out.append(encrypt(plaintext))
            return
        view = memoryview(plaintext)
        for start in range(0, len(view), MAX_PLAINTEXT):
            self._out.append(encrypt(view[start : start + MAX_PLAINTEXT]))

    def receive_record(self, record: bytes) -> bytes:
        """Process one record; return the plaintext it carries (empty during the handshake)."""
        if self._state is _State.ESTABLISHED:
            return self._decrypt(record)
        if self._error is not None:
            raise self._error
        if len(record) > MAX_RECORD + 1:
            raise self._fail(ErrorCode.BAD_REQUEST, f"record of {len(record)} bytes is too long")
        if not record:
            raise self._fail(ErrorCode.UNAUTHORIZED, "empty handshake record")
        kind = record[0]
        if kind == _REJECT:
            raise self._fail(ErrorCode.UNAUTHORIZED, f"peer refused: {_reject_reason(record)}")
        if self._state is _State.AWAIT_CONFIRM:
            if kind != _CONFIRM:
                raise self._fail(ErrorCode.UNAUTHORIZED, "expected the handshake confirmation")
            self._decrypt(record[1:])
            self._state = _State.ESTABLISHED
            return b""
        if kind != _HANDSHAKE:
            raise self._refuse(
                ErrorCode.UNAUTHORIZED, f"unexpected record kind {kind} in handshake"
            )
        self._handshake_step(record[1:])
        return b""

    # ----- handshake

    def _handshake_step(self, message: bytes) -> None:
        # noiseprotocol drops its handshake state when the handshake ends; keep
        # hold of it to read the peer's static key afterwards.
        state = self._noise.noise_protocol.handshake_state
        try:
            payload = bytes(self._noise.read_message(message))
        except _HANDSHAKE_FAILURES:
            raise self._refuse(ErrorCode.UNAUTHORIZED, _MESH_KEY_REASON) from None
        finished = self._noise.handshake_finished
        if not self._initiator and not finished:
            # Message 1 carries only the initiator's ephemeral key.
            if payload:
                raise self._refuse(ErrorCode.UNAUTHORIZED, _MESH_KEY_REASON)
            self._out.append(bytes([_HANDSHAKE]) + bytes(self._noise.write_message(self._proof())))
            return
        self._check_proof(payload, state.rs.public_bytes)
        if self._initiator:
            self._out.append(bytes([_HANDSHAKE]) + bytes(self._noise.write_message(self._proof())))
            self._take_transport_keys()
            self._state = _State.AWAIT_CONFIRM
        else:
            self._take_transport_keys()
            assert self._encryptor is not None
            self._out.append(bytes([_CONFIRM]) + self._encryptor.encrypt(b""))
            self._state = _State.ESTABLISHED

    def _take_transport_keys(self) -> None:
        protocol = self._noise.noise_protocol
        self._encryptor = CipherState(protocol.cipher_state_encrypt.k)
        self._decryptor = CipherState(protocol.cipher_state_decrypt.k)

    def _proof(self) -> bytes:
        return self._static.proof

    def _check_proof(self, payload: bytes, remote_static: bytes) -> None:
        if len(payload) != _PAYLOAD_BYTES or payload[0] != _PAYLOAD_VERSION:
            raise self._refuse(ErrorCode.UNAUTHORIZED, "malformed identity proof")
        public_key = payload[1:33]
        if not verify(public_key, SIGNATURE_CONTEXT + remote_static, payload[33:]):
            raise self._refuse(
                ErrorCode.UNAUTHORIZED, "identity signature over the static key is invalid"
            )
        node_id = node_id_of(public_key)
        if self._expected is not None and node_id != self._expected:
            raise self._refuse(
                ErrorCode.UNAUTHORIZED,
                f"expected node {self._expected}, reached node {node_id}",
            )
        self.remote_public_key = public_key
        self.remote_node_id = node_id

    # ----- transport

    def _decrypt(self, record: bytes) -> bytes:
        assert self._decryptor is not None
        if len(record) > MAX_RECORD:
            raise self._fail(ErrorCode.BAD_REQUEST, f"record of {len(record)} bytes is too long")
        try:
            return self._decryptor.decrypt(record)
        except (InvalidTag, ValueError):
            raise self._fail(
                ErrorCode.PAYLOAD_CORRUPT,
                "record failed authentication (corrupted, replayed, reordered or forged)",
            ) from None

    def _fail(self, code: ErrorCode, message: str) -> ProtocolError:
        self._state = _State.FAILED
        self._out.clear()
        self._error = ProtocolError(code, message)
        return self._error

    def _refuse(self, code: ErrorCode, message: str) -> ProtocolError:
        """Fail, and leave a REJECT with the reason for the peer."""
        error = self._fail(code, message)
        text = f"{code.value}: {message}".encode()[:_MAX_REASON_BYTES]
        self._out.append(bytes([_REJECT]) + text)
        return error


def _reject_reason(record: bytes) -> str:
    return record[1 : 1 + _MAX_REASON_BYTES].decode("utf-8", "replace") or "no reason given"


class RecordReader:
    """Splits a byte stream into records framed by a 2-byte big-endian length."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes | bytearray) -> list[bytes]:
        self._buffer += data
        records = []
        offset = 0
        while len(self._buffer) - offset >= 2:
            length = int.from_bytes(self._buffer[offset : offset + 2], "big")
            if len(self._buffer) - offset - 2 < length:
                break
            records.append(bytes(self._buffer[offset + 2 : offset + 2 + length]))
            offset += 2 + length
        del self._buffer[:offset]
        return records

    @staticmethod
    def frame(record: bytes) -> bytes:
        if len(record) > MAX_RECORD:
            raise ValueError(f"a record is at most {MAX_RECORD} bytes")
        return len(record).to_bytes(2, "big") + record
