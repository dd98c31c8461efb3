"""The stage fast path's wire, sans-IO: sealed step frames from one engine worker to the next.

A session's rows skip both daemons on the way: the upstream stage's engine
worker writes them to a TCP connection of the session's own, and the
downstream stage's worker reads them there (the tail's sampled token goes to
the head the same way). The daemons set the connection up and then stay out
of the data path:

* The upstream daemon picks a random token and key and sends them in the
  session's ``Hop``, inside the Noise link between the two daemons (so only
  they know them, relays and strangers never do).
* It dials the downstream's listening address (the one its Noise link takes)
  and sends ``PREAMBLE``: ``MAGIC`` then the token. The downstream daemon's
  listener tells that from a WebSocket upgrade by its first bytes, matches the
  token to the session once (a token is single-use), answers ``ACCEPTED`` and
  passes the socket to its worker; the upstream daemon, once it reads
  ``ACCEPTED``, passes its end to its own worker.
* From then on each frame is a u32 big-endian length, then the step sealed
  with ChaCha20-Poly1305 under the key, nonces counted from 0: one direction
  per connection, so a replayed, dropped, reordered or altered frame fails to
  open, and the connection's session fails with PAYLOAD_CORRUPT.

A step is ``STEP`` (kind, position, rows, drafted rows) and its payload:
float32 rows of the stage width (``ROWS``), the same followed by the rows'
token ids for a stage whose layers route by them (``ROWS_IDS``), or token ids
(``TOKENS``: the ring). Its last ``drafts`` rows are speculative (drafted
tokens and what they became). Every length is checked before a byte of the
frame is buffered.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from wire.errors import ErrorCode, ProtocolError
from wire.tensors import MAX_DRAFT

MAGIC = b"MESHFST1"
TOKEN_BYTES = 16
KEY_BYTES = 32
PREAMBLE_BYTES = len(MAGIC) + TOKEN_BYTES
ACCEPTED = b"\x01"

ROWS = 1
ROWS_IDS = 2
TOKENS = 3
KINDS = (ROWS, ROWS_IDS, TOKENS)

STEP = struct.Struct(">BIIB")
LENGTH = struct.Struct(">I")
TAG_BYTES = 16


def preamble(token: bytes) -> bytes:
    if len(token) != TOKEN_BYTES:
        raise ValueError(f"a fast-link token is {TOKEN_BYTES} bytes, not {len(token)}")
    return MAGIC + token


def read_preamble(data: bytes) -> bytes:
    """The token of a whole preamble; ValueError for anything else."""
    if len(data) != PREAMBLE_BYTES or not data.startswith(MAGIC):
        raise ValueError("not a fast-link preamble")
    return data[len(MAGIC):]


def _nonce(counter: int) -> bytes:
    return counter.to_bytes(12, "little")


def _corrupt(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.PAYLOAD_CORRUPT, f"fast link: {message}")


class Sealer:
    """The sending end: each step sealed under the link's key with the next nonce."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a fast-link key is {KEY_BYTES} bytes, not {len(key)}")
        self._aead = ChaCha20Poly1305(key)
        self._sent = 0

    def seal(self, kind: int, pos: int, n: int, payload: bytes | memoryview, drafts: int = 0) -> bytes:
        sealed = self._aead.encrypt(_nonce(self._sent), STEP.pack(kind, pos, n, drafts) + bytes(payload), None)
        self._sent += 1
        return LENGTH.pack(len(sealed)) + sealed


@dataclass(frozen=True)
class Step:
    kind: int
    pos: int
    n: int
    # the last ``drafts`` rows are speculative
    drafts: int
    # float32 rows (ROWS, ROWS_IDS) or nothing (TOKENS)
    rows: bytes
    # int32 token ids (TOKENS, ROWS_IDS) or nothing (ROWS)
    ids: bytes


class Opener:
    """The receiving end, fed bytes as they come; yields checked steps.

    ``width`` is the floats per row this stage takes, ``max_rows`` the most rows
    one step may carry: together they bound a frame before it is buffered.
    ``wanted()`` says how many more bytes complete the frame in hand, so a
    reader never takes more than that from its socket.
    """

    def __init__(self, key: bytes, width: int, max_rows: int) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a fast-link key is {KEY_BYTES} bytes, not {len(key)}")
        self._aead = ChaCha20Poly1305(key)
        self._got = 0
        self.width = width
        self.max_rows = max_rows
        self.max_sealed = STEP.size + max_rows * (width + 1) * 4 + TAG_BYTES
        self._buf = bytearray()
        self._need = LENGTH.size

    def wanted(self) -> int:
        return self._need - len(self._buf)

    def feed(self, data: bytes | memoryview) -> Step | None:
        """Takes at most ``wanted()`` bytes; returns a step once one is whole and opens."""
        if len(data) > self.wanted():
            raise ValueError(f"fed {len(data)} bytes where {self.wanted()} complete the frame")
        self._buf += data
        if len(self._buf) < self._need:
            return None
        if self._need == LENGTH.size:
            (size,) = LENGTH.unpack(self._buf)
            if not STEP.size + TAG_BYTES <= size <= self.max_sealed:
                raise _corrupt(f"a frame of {size} bytes (this stage takes {STEP.size + TAG_BYTES}.."
                               f"{self.max_sealed})")
            self._need = LENGTH.size + size
            return None
        sealed = bytes(self._buf[LENGTH.size:])
        self._buf = bytearray()
        self._need = LENGTH.size
        try:
            plain = self._aead.decrypt(_nonce(self._got), sealed, None)
        except InvalidTag:
            raise _corrupt(f"frame {self._got} does not open (altered, replayed, reordered or another key)") from None
        self._got += 1
        return self._step(plain)

    def _step(self, plain: bytes) -> Step:
        kind, pos, n, drafts = STEP.unpack_from(plain)
        body = plain[STEP.size:]
        if kind not in KINDS:
            raise _corrupt(f"unknown step kind {kind}")
        if not 1 <= n <= self.max_rows:
            raise _corrupt(f"a step of {n} rows (1..{self.max_rows})")
        if drafts >= n or drafts > MAX_DRAFT:
            raise _corrupt(f"{drafts} drafted rows of {n} (at most {MAX_DRAFT}, and fewer than the rows)")
        rows = n * self.width * 4 if kind != TOKENS else 0
        ids = n * 4 if kind != ROWS else 0
        if len(body) != rows + ids:
            raise _corrupt(f"a step of {n} rows with {len(body)} bytes, not {rows + ids}")
        return Step(kind, pos, n, drafts, body[:rows], body[rows:])
