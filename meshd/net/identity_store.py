"""The node's Ed25519 key in its state directory, and the optional mesh key file."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from wire.identity import NodeIdentity
from wire.noise import mesh_key_from_secret

KEY_FILE = "node.key"


class IdentityError(Exception):
    """The key or mesh key file cannot be used; the message says why and what to do."""


def load_or_create_identity(state_dir: Path) -> NodeIdentity:
    """The identity kept in ``state_dir/node.key``, created on first use.

    The key file holds the 32 raw private-key bytes, readable by the owner
    only; a key file others can read is refused rather than used, as ssh does.
    """
    state_dir = Path(state_dir)
    path = state_dir / KEY_FILE
    try:
        return _load(path)
    except FileNotFoundError:
        pass
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    identity = NodeIdentity.generate()
    temporary = state_dir / f".{KEY_FILE}.{secrets.token_hex(4)}"
    # Created 0600 from the start and renamed into place, so the key is never
    # visible to others nor half-written under its real name.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(identity.private_bytes())
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            # Another process created it first: use theirs.
            return _load(path)
    finally:
        temporary.unlink(missing_ok=True)
    return identity


def _load(path: Path) -> NodeIdentity:
    with open(path, "rb") as file:
        mode = os.fstat(file.fileno()).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise IdentityError(
                f"{path} is accessible by others (mode {stat.S_IMODE(mode):04o}); "
                f"run: chmod 600 {path}"
            )
        raw = file.read(33)
    if len(raw) != 32:
        raise IdentityError(f"{path} does not hold a 32-byte Ed25519 key ({len(raw)} bytes)")
    return NodeIdentity.from_private_bytes(raw)


def load_mesh_key(path: Path) -> bytes:
    """The 32-byte mesh key from a file.

    A file of exactly 32 bytes is the key itself; 64 hex digits are decoded;
    anything else (a passphrase) is hashed. Surrounding whitespace of text is
    ignored, so an editor's trailing newline does not change the key.
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise IdentityError(f"cannot read the mesh key file {path}: {exc.strerror}") from None
    if len(raw) == 32:
        return raw
    text = raw.strip()
    if not text:
        raise IdentityError(f"the mesh key file {path} is empty")
    if len(text) == 64:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    return mesh_key_from_secret(text)
