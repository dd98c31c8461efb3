"""Which tensors a layer range owns: exactly what the patched range loader reads (native/patches/0002).

The loader's rule (``layer_range_owns_tensor``): a block tensor belongs to its
block; an input tensor (``LLM_TENSOR_LAYER_INPUT``: the token embeddings and
their norm, position and token-type embeddings) to the range holding layer 0;
an output tensor (``LLM_TENSOR_LAYER_OUTPUT``: ``output``, ``output_norm``,
classifier heads) to the range holding the last layer; and ``token_embd``, when
the model has no ``output.weight``, is read a second time as the tied head, so
the tail owns it too. A tensor outside these families (``rope_freqs`` and the
like, small) is fetched by every range rather than risk a load that needs it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from meshd.store.manifest import Chunk, Manifest

_BLOCK = re.compile(r"blk\.(\d+)\.")
_INPUT_PREFIXES = ("token_embd.", "token_embd_norm.", "token_types.", "position_embd.")
_OUTPUT_PREFIXES = ("output.", "output_norm.", "cls.", "cls_out.")
TIED_HEAD = "token_embd.weight"
OUTPUT_HEAD = "output.weight"


class RangeError(ValueError):
    """Layers that are not a range of the model."""


def owned_tensors(names: list[str], n_layers: int, start: int, end: int) -> list[str]:
    """The names among ``names`` that the range ``[start, end)`` of an ``n_layers`` model loads, in order."""
    if not 0 <= start < end <= n_layers:
        raise RangeError(f"layers {start}:{end} are not a range of a {n_layers}-layer model")
    head, tail = start == 0, end == n_layers
    tied = OUTPUT_HEAD not in names
    owned = []
    for name in names:
        block = _BLOCK.match(name)
        if block is not None:
            mine = start <= int(block.group(1)) < end
        elif name.startswith(_INPUT_PREFIXES):
            mine = head or (tail and tied and name == TIED_HEAD)
        elif name.startswith(_OUTPUT_PREFIXES):
            mine = tail
        else:
            mine = True
        if mine:
            owned.append(name)
    return owned


def range_chunks(manifest: Manifest, n_layers: int, start: int, end: int) -> list[Chunk]:
    """The header's chunks and those of every tensor the range owns: all a range needs of the file."""
    owned = owned_tensors(manifest.tensor_names, n_layers, start, end)
    return manifest.header_chunks_list() + manifest.chunks_of(owned)


def held_layer_ranges(manifest: Manifest, n_layers: int, has: Callable[[int], bool]) -> list[tuple[int, int]]:
    """The maximal layer ranges whose every chunk (`has(index)`: held verified) a range loader of them
    reads: the header, their blocks, the head's tensors for one from layer 0, the tail's for one to
    the last layer."""

    def holds(chunks: list[Chunk]) -> bool:
        return all(has(c.index) for c in chunks)

    by_layer: dict[int, list[str]] = {}
    for name in manifest.tensor_names:
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 1 and parts[1].isdigit():
            by_layer.setdefault(int(parts[1]), []).append(name)
    blocks = [holds(manifest.chunks_of(by_layer.get(i, []))) for i in range(n_layers)]
    held: list[tuple[int, int]] = []
    layer = 0
    while layer < n_layers:
        if not blocks[layer]:
            layer += 1
            continue
        end = layer
        while end < n_layers and blocks[end]:
            end += 1
        # a run reaching layer 0 (or the last) holds the head's (tail's) tensors only if they were fetched too
        lo, hi = layer + (layer == 0), end - (end == n_layers)
        found = next(((a, b) for a, b in ((layer, end), (lo, end), (layer, hi), (lo, hi))
                      if a < b and holds(range_chunks(manifest, n_layers, a, b))), None)
        if found is not None:
            held.append(found)
        layer = end
    return held
