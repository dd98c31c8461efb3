"""The node key in the state directory, and mesh key files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from meshd.net.identity_store import IdentityError, load_mesh_key, load_or_create_identity
from wire.noise import mesh_key_from_secret


def test_the_key_is_created_once_private_and_then_reused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = load_or_create_identity(state)
    key_file = state / "node.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert key_file.read_bytes() == first.private_bytes()
    assert load_or_create_identity(state).node_id == first.node_id
    assert [p.name for p in state.iterdir()] == ["node.key"]


def test_a_key_file_others_can_read_is_refused(tmp_path: Path) -> None:
    load_or_create_identity(tmp_path)
    os.chmod(tmp_path / "node.key", 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_or_create_identity(tmp_path)


def test_a_damaged_key_file_is_refused(tmp_path: Path) -> None:
    key_file = tmp_path / "node.key"
    key_file.write_bytes(b"short")
    os.chmod(key_file, 0o600)
    with pytest.raises(IdentityError, match="32-byte"):
        load_or_create_identity(tmp_path)


def test_mesh_key_files_hold_raw_hex_or_passphrase(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.write_bytes(bytes(range(32)))
    assert load_mesh_key(raw) == bytes(range(32))
    hexed = tmp_path / "hex"
    hexed.write_text(bytes(range(32)).hex() + "\n")
    assert load_mesh_key(hexed) == bytes(range(32))
    phrase = tmp_path / "phrase"
    phrase.write_text("open sesame\n")
    assert load_mesh_key(phrase) == mesh_key_from_secret(b"open sesame")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(IdentityError, match="empty"):
        load_mesh_key(empty)
    with pytest.raises(IdentityError, match="cannot read"):
        load_mesh_key(tmp_path / "missing")
