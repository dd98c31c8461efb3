"""Manifests: what they cover of a GGUF, their one encoding, the cache, and decoding a peer's bytes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.store import manifest as manifest_module
from meshd.store.gguf_header import read_layout
from meshd.store.manifest import (
    CACHE_SUFFIX,
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestError,
    TensorEntry,
    compute,
    manifest_for,
)

SMALL_CHUNK = 4 << 10


@pytest.fixture(scope="module")
def tiny(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama-gqa-untied"]


def test_layout_agrees_with_the_gguf_package(tiny: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(tiny))
    with open(tiny, "rb") as f:
        layout = read_layout(f)
    assert layout.header_size == reader.data_offset
    assert sorted((t.name, t.offset, t.size) for t in layout.tensors) == sorted(
        (t.name, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors)
    assert (layout.architecture, layout.block_count) == ("llama", 6)


def test_chunks_tile_the_header_and_every_tensor_with_their_hashes(tiny: Path) -> None:
    m = compute(tiny, SMALL_CHUNK)
    data = tiny.read_bytes()
    assert m.file_size == len(data)
    assert any(len(t.chunk_hashes) > 1 for t in m.tensors), "the small chunk size splits some tensors"
    for chunk in m.chunks:
        assert 0 < chunk.size <= SMALL_CHUNK
        assert hashlib.sha256(data[chunk.offset : chunk.end]).digest() == chunk.sha256
    for t in m.tensors:
        assert hashlib.sha256(data[t.offset : t.end]).digest() == t.sha256
        pieces = [c for c in m.chunks if c.tensor == t.name]
        assert (pieces[0].offset, pieces[-1].end, sum(c.size for c in pieces)) == (t.offset, t.end, t.size)
    header = m.header_chunks_list()
    assert (header[0].offset, header[-1].end) == (0, m.header_size)
    assert [c.index for c in m.chunks] == list(range(len(m.chunks)))


def test_model_id_hashes_the_one_canonical_encoding(tiny: Path) -> None:
    m = compute(tiny, SMALL_CHUNK)
    assert m.model_id == hashlib.sha256(m.encoded).hexdigest()
    again = Manifest.decode(m.encoded, expected_id=m.model_id)
    assert again == m and again.model_id == m.model_id
    # Another chunk size is another manifest, so another id.
    assert compute(tiny).model_id != m.model_id


def test_a_manifest_that_does_not_hash_to_the_id_is_refused(tiny: Path) -> None:
    m = compute(tiny, SMALL_CHUNK)
    with pytest.raises(ManifestError, match="does not hash"):
        Manifest.decode(m.encoded, expected_id="00" * 32)


def test_a_non_canonical_encoding_is_refused(tiny: Path) -> None:
    m = compute(tiny, SMALL_CHUNK)
    body = msgpack.unpackb(m.encoded, raw=False)
    # The same values with the version as a 64-bit int: decodes to an equal manifest, other bytes.
    packer = msgpack.Packer(use_bin_type=True)
    other = b"\x97\xcf" + (1).to_bytes(8, "big") + b"".join(packer.pack(v) for v in body[1:])
    assert msgpack.unpackb(other, raw=False) == body
    with pytest.raises(ManifestError, match="canonical"):
        Manifest.decode(other)


def test_an_oversized_manifest_is_refused_unread() -> None:
    with pytest.raises(ManifestError, match="exceeds the limit"):
        Manifest.decode(b"\x00" * (MAX_MANIFEST_BYTES + 1))


def _entry(name: str, offset: int, size: int) -> TensorEntry:
    return TensorEntry(name, offset, size, b"\x00" * 32)


@pytest.mark.parametrize(
    ("tensors", "reason"),
    [
        ([_entry("a", 50, 10)], "overlaps"),  # inside the header
        ([_entry("a", 100, 10), _entry("b", 105, 10)], "overlaps"),
        ([_entry("a", 100, 1000)], "overlaps"),  # past the file's end
        ([_entry("a", 100, 10), _entry("a", 200, 10)], "twice"),
        ([_entry("", 100, 10)], "empty"),
        ([TensorEntry("a", 100, 10, b"short")], "not 32"),
        ([TensorEntry("a", 100, 10, b"\x00" * 32, (b"\x00" * 32, b"\x00" * 32))], "chunk hashes"),
    ],
)
def test_a_layout_that_cannot_be_a_file_is_refused(tensors: list[TensorEntry], reason: str) -> None:
    with pytest.raises(ManifestError, match=reason):
        Manifest(file_size=500, header_size=64, header_sha256=b"\x00" * 32, tensors=tuple(tensors),
                 chunk_size=SMALL_CHUNK)


def test_a_big_tensor_must_carry_one_hash_per_chunk() -> None:
    with pytest.raises(ManifestError, match="chunk hashes"):
        Manifest(file_size=SMALL_CHUNK * 4, header_size=64, header_sha256=b"\x00" * 32,
                 tensors=(_entry("a", 64, SMALL_CHUNK * 2),), chunk_size=SMALL_CHUNK)


@settings(max_examples=300)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_decode_or_are_refused_typed(data: bytes) -> None:
    try:
        Manifest.decode(data)
    except ManifestError:
        pass


@pytest.fixture(scope="module")
def tiny_encoded(tiny_models: dict[str, Path]) -> bytes:
    return compute(tiny_models["llama-gqa-tied"], SMALL_CHUNK).encoded


@settings(max_examples=300)
@given(st.data())
def test_any_damaged_manifest_is_refused_typed(tiny_encoded: bytes, data: st.DataObject) -> None:
    """Flip, cut or splice a valid encoding: refused with ManifestError, or (no real change) equal."""
    raw = bytearray(tiny_encoded)
    how = data.draw(st.sampled_from(["flip", "cut", "splice"]))
    at = data.draw(st.integers(0, len(raw) - 1))
    if how == "flip":
        raw[at] ^= data.draw(st.integers(1, 255))
    elif how == "cut":
        del raw[at:]
    else:
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=16))
    try:
        decoded = Manifest.decode(bytes(raw))
    except ManifestError:
        return
    assert decoded.encoded == bytes(raw)


def test_manifest_is_cached_beside_the_file_and_trusted_while_size_and_mtime_hold(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(tiny_models["qwen2-bias"].read_bytes())
    first = manifest_for(model, chunk_size=SMALL_CHUNK)
    assert (tmp_path / ("m.gguf" + CACHE_SUFFIX)).is_file()

    def no_compute(*args: object) -> Manifest:
        raise AssertionError("computed again")

    monkeypatch.setattr(manifest_module, "compute", no_compute)
    assert manifest_for(model, chunk_size=SMALL_CHUNK) == first
    monkeypatch.undo()
    # The file changed (mtime moves): the cache is not trusted.
    data = bytearray(model.read_bytes())
    data[-1] ^= 1
    model.write_bytes(bytes(data))
    os.utime(model, ns=(1, 1))
    assert manifest_for(model, chunk_size=SMALL_CHUNK).model_id != first.model_id


def test_manifest_goes_to_the_state_dir_when_it_cannot_be_written_beside_the_file(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(tiny_models["qwen2-bias"].read_bytes())
    # A non-empty directory where the cache would go: no write can replace it, not even root's
    # (a read-only directory would not stop root, which these tests may run as).
    (tmp_path / ("m.gguf" + CACHE_SUFFIX)).mkdir()
    (tmp_path / ("m.gguf" + CACHE_SUFFIX) / "keep").touch()
    state = tmp_path / "state"
    m = manifest_for(model, state, chunk_size=SMALL_CHUNK)
    assert len(list((state / "manifests").iterdir())) == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    assert manifest_for(model, state, chunk_size=SMALL_CHUNK) == m


def test_a_damaged_cache_is_computed_again(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(tiny_models["qwen2-bias"].read_bytes())
    first = manifest_for(model, chunk_size=SMALL_CHUNK)
    cache = tmp_path / ("m.gguf" + CACHE_SUFFIX)
    cache.write_bytes(cache.read_bytes()[:-7])
    assert manifest_for(model, chunk_size=SMALL_CHUNK) == first


def test_a_file_that_is_not_gguf_is_one_clear_error(tmp_path: Path) -> None:
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"not a model at all")
    with pytest.raises(ManifestError, match="not a readable GGUF"):
        compute(bogus)
