"""Issue 29: every count and size in a GGUF header is bounded before anything is allocated by it.

A joining volunteer reads the header of a model a peer offers (checked against the manifest, which
the same peer wrote): a 320-byte header saying 2**27 blocks took one to 1.9 GiB and killed it. Each
header here is 320 bytes of such claims; reading it must be refused, typed, having allocated less
than a megabyte (what tracemalloc saw at its peak).
"""

from __future__ import annotations

import importlib
import struct
import tracemalloc
from pathlib import Path

import pytest

from meshd.store.gguf_header import GGUFError, read_layout
from meshd.store.manifest import ManifestError, model_paths

HEADER_BYTES = 320
# What refusing a header may allocate at its peak.
PEAK_BYTES = 1 << 20
STRING, ARRAY, UINT32, UINT64 = 8, 9, 4, 10


def text(value: str) -> bytes:
    data = value.encode()
    return struct.pack("<Q", len(data)) + data


def header(body: bytes, tensors: int = 0, kvs: int = 1) -> bytes:
    data = b"GGUF" + struct.pack("<IQQ", 3, tensors, kvs) + body
    return data + bytes(HEADER_BYTES - len(data))


HOSTILE = {
    # a metadata string of 64 MiB
    "string": header(text("general.name") + struct.pack("<IQ", STRING, 1 << 26)),
    # 2**26 eight-byte integers: a 512 MiB read
    "integer array": header(text("tokenizer.ggml.token_type") + struct.pack("<IIQ", ARRAY, UINT64, 1 << 26)),
    # 2**26 strings of 64 MiB each
    "string array": header(text("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 1 << 26)
                           + struct.pack("<Q", 1 << 26)),
    # the most tensors and keys a header may have, in 320 bytes
    "counts": header(b"", tensors=1 << 16, kvs=1 << 16),
    # a tensor of eight dimensions of 2**62 each
    "dimensions": header(text("blk.0.attn_q.weight") + struct.pack("<I", 8) + struct.pack("<Q", 1 << 62) * 8
                         + struct.pack("<IQ", 0, 0), tensors=1, kvs=0),
    # a tensor name of 2**40 bytes
    "tensor name": header(struct.pack("<Q", 1 << 40), tensors=1, kvs=0),
    # a key of 2**40 bytes
    "key": header(struct.pack("<Q", 1 << 40)),
    # the layer count of the attack as tried
    "block count": header(text("general.architecture") + struct.pack("<I", STRING) + text("llama")
                          + text("llama.block_count") + struct.pack("<II", UINT32, 1 << 27)
                          + text("x") + struct.pack("<IQ", STRING, 1 << 30), kvs=3),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_320_byte_header_is_refused_before_anything_is_sized_by_it(name: str, tmp_path: Path) -> None:
    path = tmp_path / "hostile.gguf"
    path.write_bytes(HOSTILE[name])
    # the gguf package loads with the first tensor a header sizes (meshd.store.gguf_header): loaded before the
    # trace, so the peak is what the header's claims made, not an import every process pays once
    importlib.import_module("gguf")
    tracemalloc.start()
    try:
        with open(path, "rb") as f, pytest.raises(GGUFError):
            read_layout(f)
        # as a model file given or fetched: one typed error naming the file
        with pytest.raises(ManifestError, match="hostile.gguf is not a readable GGUF"):
            model_paths(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, f"refusing it allocated {peak} bytes"
