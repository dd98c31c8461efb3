"""The node's Ed25519 key in its state directory, and the optional mesh key file."""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from wire.identity import NodeIdentity
from wire.noise import MESH_KEY_BYTES, mesh_key_from_secret

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


# Generous for a passphrase, small enough that pointing --mesh-key-file at a model file fails at once.
MAX_MESH_KEY_FILE = 4096


def load_mesh_key(path: Path, warn: Callable[[str], None] | None = None) -> bytes:
    """The 32-byte mesh key from a file, the same for every command.

    A file of exactly 32 bytes is the key itself (``head -c 32 /dev/urandom``);
    64 hex digits are decoded (``openssl rand -hex 32``); anything else is a
    passphrase, hashed (a passphrase of exactly 32 bytes is used as it is, as
    `mesh_key_from_secret` does). Surrounding whitespace of text is ignored,
    so an editor's trailing newline does not change the key. A file that
    others may read or write is used, but `warn` is told.
    """
    try:
        # Non-blocking, so a FIFO given by mistake is refused below instead of waited on.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as file:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise IdentityError(f"the mesh key file {path} is not a regular file")
            raw = file.read(MAX_MESH_KEY_FILE + 1)
    except OSError as exc:
        raise IdentityError(f"cannot read the mesh key file {path}: {exc.strerror}") from None
    if len(raw) > MAX_MESH_KEY_FILE:
        raise IdentityError(f"the mesh key file {path} is over {MAX_MESH_KEY_FILE} bytes: it should hold "
                            "64 hex digits, 32 raw bytes or a passphrase")
    if warn is not None and mode & (stat.S_IRWXG | stat.S_IRWXO):
        warn(f"warning: the mesh key file {path} is accessible by others (mode {stat.S_IMODE(mode):04o}); "
             f"run: chmod 600 {path}")
    if len(raw) == MESH_KEY_BYTES:
        return raw
    text = raw.strip()
    if not text:
        raise IdentityError(f"the mesh key file {path} is empty")
    if len(text) == 2 * MESH_KEY_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    return mesh_key_from_secret(text)
