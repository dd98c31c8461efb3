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


KEY = bytes(range(32))


def key_file(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize(("data", "expected"), [
    pytest.param(KEY, KEY, id="raw 32 bytes"),
    pytest.param(KEY.hex().encode() + b"\n", KEY, id="hex, as openssl rand -hex 32 writes it"),
    pytest.param(KEY.hex().upper().encode(), KEY, id="hex in capitals, no newline"),
    pytest.param(b"open sesame\n", mesh_key_from_secret(b"open sesame"), id="passphrase"),
    pytest.param(b"  open sesame  \r\n", mesh_key_from_secret(b"open sesame"), id="passphrase with whitespace"),
    pytest.param(b"g" * 64 + b"\n", mesh_key_from_secret(b"g" * 64), id="64 characters that are not hex"),
    pytest.param(b"\xff" * 40, mesh_key_from_secret(b"\xff" * 40), id="binary that is not 32 bytes"),
])
def test_mesh_key_files_hold_raw_hex_or_passphrase(tmp_path: Path, data: bytes, expected: bytes) -> None:
    key = load_mesh_key(key_file(tmp_path / "key", data))
    assert key == expected and len(key) == 32
    # what peers do with it: a 32-byte key is used as it is, so the file's meaning is fixed here
    assert mesh_key_from_secret(key) == key


def test_a_passphrase_and_a_hex_key_are_different_keys(tmp_path: Path) -> None:
    hexed = load_mesh_key(key_file(tmp_path / "hex", KEY.hex().encode()))
    hashed = mesh_key_from_secret(KEY.hex().encode())
    assert hexed == KEY != hashed


@pytest.mark.parametrize(("make", "needle"), [
    (lambda p: key_file(p, b"\n"), "empty"),
    (lambda p: p, "cannot read"),
    (lambda p: key_file(p, b"x" * 5000), "over 4096 bytes"),
    (lambda p: (os.mkfifo(p), p)[1], "not a regular file"),
    (lambda p: (p.mkdir(), p)[1], "Is a directory"),
])
def test_unusable_mesh_key_files_are_refused_with_the_reason(tmp_path: Path, make, needle: str) -> None:
    with pytest.raises(IdentityError, match=needle):
        load_mesh_key(make(tmp_path / "key"))


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620])
def test_a_mesh_key_file_others_can_reach_is_used_with_a_warning(tmp_path: Path, mode: int) -> None:
    warnings: list[str] = []
    path = key_file(tmp_path / "key", KEY.hex().encode(), mode)
    assert load_mesh_key(path, warn=warnings.append) == KEY
    assert len(warnings) == 1 and f"{mode:04o}" in warnings[0] and f"chmod 600 {path}" in warnings[0]


def test_a_private_mesh_key_file_gives_no_warning(tmp_path: Path) -> None:
    warnings: list[str] = []
    load_mesh_key(key_file(tmp_path / "key", KEY), warn=warnings.append)
    assert warnings == []
