"""The layout of a GGUF file read from its header alone: where the tensor data starts, each tensor's bytes.

``gguf.GGUFReader`` builds every metadata value as numpy (seconds for a 49k-token
vocabulary); content addressing needs only the tensor infos, a few scalars and
the alignment, so this walks the header once and skips the rest. Every count
and length is bounded before it is used, and before anything is allocated by
it: no read asks for more bytes than the file has left (a 320-byte header
saying a 2**26-item array made a 512 MiB buffer), values not kept are skipped
unread, and what is kept has caps of its own. The header of a fetched file came
from a peer (checked against the manifest, but read here all the same).
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass, field
from typing import BinaryIO

MAGIC = b"GGUF"
_MAX_KEY = 1 << 16
_MAX_STRING = 1 << 26
_MAX_ARRAY = 1 << 26
_MAX_KVS = 1 << 16
_MAX_TENSORS = 1 << 16
_MAX_DIMS = 8
_DEFAULT_ALIGNMENT = 32
# Integer arrays up to one item per layer (llama.cpp's LLAMA_MAX_LAYERS) are kept, per-layer metadata
# such as glm-dsa's indexer types; longer ones (the vocabulary's token types) are skipped, and so is
# any past the first _MAX_KEPT_ITEMS items kept in all, so a hostile header cannot make us hold more.
_MAX_KEPT_ARRAY = 512
_MAX_KEPT_ITEMS = 1 << 14
# Metadata strings kept: placement reads names, and the longest chat templates shipped are tens of
# KiB; a longer string is skipped (read as absent), and so is any once this many bytes are kept.
_MAX_KEPT_STRING = 1 << 20
_MAX_KEPT_STRING_BYTES = 16 << 20
# A tensor's bytes at most: the largest file a manifest describes (64 TiB). Dimensions multiply, so
# eight of 2**62 each would otherwise size a tensor past any file.
_MAX_TENSOR_BYTES = 1 << 46

# GGUF value types: fixed-width scalars by their struct format.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    offset: int  # absolute in the file
    size: int


@dataclass(frozen=True, slots=True)
class GGUFLayout:
    header_size: int  # every byte before the tensor data (metadata, tensor infos, alignment padding)
    tensors: tuple[TensorInfo, ...]  # in file order
    architecture: str
    block_count: int | None
    # every scalar and string of the metadata: what placement reads of a model
    metadata: dict[str, int | float | bool | str] = field(default_factory=dict)
    # the short integer arrays of the metadata (at most _MAX_KEPT_ARRAY items each), per-layer values
    arrays: dict[str, tuple[int, ...]] = field(default_factory=dict)


class _Reader:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.pos = 0
        start = f.tell()
        # What the file holds from here: no read may ask for more (a read allocates what it asks for).
        self.size = f.seek(0, io.SEEK_END) - start
        f.seek(start)
        self.kept_strings = 0

    def _bound(self, n: int) -> None:
        if n > self.size - self.pos:
            raise GGUFError(f"the header ends early, at byte {self.size} (it says {n} more bytes at {self.pos})")

    def take(self, n: int) -> bytes:
        self._bound(n)
        data = self.f.read(n)
        if len(data) != n:
            raise GGUFError(f"the header ends early, at byte {self.pos + len(data)}")
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        self._bound(n)
        self.f.seek(n, io.SEEK_CUR)
        self.pos += n

    def unpack(self, fmt: str) -> int | float | bool:
        value: int | float | bool = struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        return value

    def u32(self) -> int:
        return int(self.unpack("<I"))

    def u64(self) -> int:
        return int(self.unpack("<Q"))

    def string(self, limit: int) -> str:
        length = self.u64()
        if length > limit:
            raise GGUFError(f"a header string of {length} bytes exceeds {limit}")
        try:
            return self.take(length).decode()
        except UnicodeDecodeError:
            raise GGUFError("a header string is not UTF-8") from None

    def skip_string(self) -> None:
        length = self.u64()
        if length > _MAX_STRING:
            raise GGUFError(f"a header string of {length} bytes exceeds {_MAX_STRING}")
        self.skip(length)

    def kept_string(self) -> str | None:
        """A metadata string, or None (skipped) past the caps on what is kept."""
        length = self.u64()
        if length > _MAX_STRING:
            raise GGUFError(f"a header string of {length} bytes exceeds {_MAX_STRING}")
        if length > _MAX_KEPT_STRING or self.kept_strings + length > _MAX_KEPT_STRING_BYTES:
            self.skip(length)
            return None
        self.kept_strings += length
        try:
            return self.take(length).decode()
        except UnicodeDecodeError:
            raise GGUFError("a header string is not UTF-8") from None

    def skip_value(self, kind: int, keep: int = 0) -> int | float | bool | str | tuple[int, ...] | None:
        """Read a value of ``kind``: scalars and strings (within the caps) are returned, an integer
        array of at most ``keep`` items as a tuple, other values skipped unread (None)."""
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.kept_string()
        if kind != _ARRAY:
            raise GGUFError(f"unknown GGUF value type {kind}")
        item, count = self.u32(), self.u64()
        if count > _MAX_ARRAY:
            raise GGUFError(f"a header array of {count} items exceeds {_MAX_ARRAY}")
        if item in _SCALARS:
            fmt = _SCALARS[item]
            if count <= keep and fmt[1] in "BbHhIiQq":
                data = self.take(count * struct.calcsize(fmt))
                return tuple(int(v) for v in struct.unpack(f"<{count}{fmt[1]}", data))
            self.skip(count * struct.calcsize(fmt))
        elif item == _STRING:
            for _ in range(count):
                self.skip_string()
        else:
            raise GGUFError(f"GGUF arrays of type {item} are not supported")
        return None


def _tensor_bytes(dims: list[int], ggml_type: int) -> int:
    # imported here, not with the module: the gguf package loads its writer, reader and yaml with it (0.05
    # CPU-s), and every `meshd` command imports this module through its flag checks, most never reading a header
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"unknown ggml tensor type {ggml_type}") from None
    elements = 1
    for d in dims:
        elements *= d
    if dims and dims[0] % block:
        raise GGUFError(f"a row of {dims[0]} is not whole blocks of {block}")
    size = elements // block * type_size
    if size > _MAX_TENSOR_BYTES:
        raise GGUFError(f"a tensor of dimensions {dims} is over {_MAX_TENSOR_BYTES} bytes")
    return size


def read_layout(f: BinaryIO) -> GGUFLayout:
    """The layout of the GGUF read from ``f`` (positioned at its start); GGUFError if it is not one."""
    r = _Reader(f)
    if r.take(4) != MAGIC:
        raise GGUFError("not a GGUF file (bad magic)")
    version = r.u32()
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} is not supported")
    n_tensors, n_kvs = r.u64(), r.u64()
    if n_tensors > _MAX_TENSORS or n_kvs > _MAX_KVS:
        raise GGUFError(f"{n_tensors} tensors and {n_kvs} metadata keys exceed the limits")
    alignment = _DEFAULT_ALIGNMENT
    scalars: dict[str, int | float | bool | str] = {}
    arrays: dict[str, tuple[int, ...]] = {}
    kept = 0
    for _ in range(n_kvs):
        key = r.string(_MAX_KEY)
        value = r.skip_value(r.u32(), min(_MAX_KEPT_ARRAY, _MAX_KEPT_ITEMS - kept))
        if isinstance(value, tuple):
            arrays[key] = value
            kept += len(value)
        elif value is not None:
            scalars[key] = value
    if "general.alignment" in scalars:
        alignment = int(scalars["general.alignment"])
        if alignment < 1 or alignment & (alignment - 1) or alignment > 1 << 20:
            raise GGUFError(f"alignment {alignment} is not a power of two")
    infos = []
    for _ in range(n_tensors):
        name = r.string(_MAX_KEY)
        n_dims = r.u32()
        if n_dims > _MAX_DIMS:
            raise GGUFError(f"tensor {name!r} has {n_dims} dimensions")
        dims = [r.u64() for _ in range(n_dims)]
        ggml_type, offset = r.u32(), r.u64()
        infos.append((name, offset, _tensor_bytes(dims, ggml_type)))
    data_start = -(-r.pos // alignment) * alignment
    tensors = tuple(sorted((TensorInfo(name, data_start + off, size) for name, off, size in infos),
                           key=lambda t: t.offset))
    arch = scalars.get("general.architecture", "")
    blocks = scalars.get(f"{arch}.block_count")
    return GGUFLayout(data_start, tensors, str(arch), int(blocks) if isinstance(blocks, int) else None, scalars,
                      arrays)
