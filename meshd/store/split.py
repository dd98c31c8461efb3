"""gguf-split sets: a model shipped as ``NAME-00001-of-0000N.gguf`` ... ``NAME-0000N-of-0000N.gguf``.

Every part is a GGUF of its own whose header carries ``split.no`` (from 0),
``split.count`` and ``split.tensors.count``; the first also carries the model's
metadata. llama.cpp's loader, given the first part, finds the others by that
name pattern (``llama_split_path``), so meshd names parts the same way, its
sparse copies included, and finds a set from any one of its parts.

Headers are read with the bounded parser (``gguf_header``): a fetched part's
header came from a peer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from meshd.store.gguf_header import GGUFError, GGUFLayout, read_layout

SPLIT_NO = "split.no"
SPLIT_COUNT = "split.count"
SPLIT_TENSORS = "split.tensors.count"
# The parts a set may have. llama.cpp's names allow 99999; the largest sets shipped (2 TB in 50 GB
# parts) have tens, and each part costs a file descriptor and a header read on every load.
MAX_PARTS = 256
# llama.cpp's split file names, "%s-%05d-of-%05d.gguf" (llama_split_path), numbered from 1.
_PART_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class SplitError(ValueError):
    """A set with a part missing, unreadable or not of the set; the message names the part."""


def part_name(prefix: str, no: int, count: int) -> str:
    """The file name of part ``no`` (from 0) of a ``count``-part set named ``prefix``."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def set_prefix(path: Path) -> str | None:
    """The set name in a part's file name (``NAME`` of ``NAME-00002-of-00003.gguf``); None if it is no part's."""
    found = _PART_NAME.match(path.name)
    return found["prefix"] if found is not None else None


def shown_name(path: Path) -> str:
    """The name a model file is shown by: its own, or for a part its set's (``NAME.gguf``)."""
    prefix = set_prefix(path)
    return f"{prefix}.gguf" if prefix is not None else path.name


def part_paths(path: Path, count: int) -> list[Path]:
    """Where the ``count`` parts of the set at ``path`` lie: beside it, ``path`` being one of them or a plain
    ``NAME.gguf`` whose parts are ``NAME-0000i-of-0000N.gguf`` (a sparse copy's, named by model id)."""
    found = _PART_NAME.match(path.name)
    prefix = found["prefix"] if found is not None and int(found["count"]) == count else path.stem
    return [path.with_name(part_name(prefix, i, count)) for i in range(count)]


@dataclass(frozen=True)
class ModelFiles:
    """A model's files: one GGUF, or every part of a set in order, with each one's header."""

    paths: tuple[Path, ...]
    layouts: tuple[GGUFLayout, ...]

    @property
    def first(self) -> Path:
        """The file llama.cpp is given: the model, or its first part."""
        return self.paths[0]

    @property
    def name(self) -> str:
        """The model's file name, the set's without the part numbers."""
        return shown_name(self.first)


def _layout(path: Path) -> GGUFLayout:
    with open(path, "rb") as f:
        return read_layout(f)


def _split_key(layout: GGUFLayout, key: str, path: Path) -> int:
    value = layout.metadata.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SplitError(f"{path.name} is a part of a split set without a usable {key}")
    return value


def split_count(layout: GGUFLayout) -> int:
    """How many parts the set of a file with this header has (1: a file of its own)."""
    value = layout.metadata.get(SPLIT_COUNT)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


def model_files(path: Path) -> ModelFiles:
    """The file at ``path``, or the whole set it is a part of, each part's header checked: its number,
    the set's part and tensor counts, no tensor twice. SplitError names the part missing or not of the
    set; GGUFError and OSError are the given file's own."""
    given = _layout(path)
    count = split_count(given)
    if count == 1:
        return ModelFiles((path,), (given,))
    if count > MAX_PARTS:
        raise SplitError(f"{path.name} says its set has {count} parts; meshd takes at most {MAX_PARTS}")
    no, tensors = _split_key(given, SPLIT_NO, path), _split_key(given, SPLIT_TENSORS, path)
    if path.name != part_name(set_prefix(path) or path.stem, no, count):
        raise SplitError(f"{path.name} is part {no + 1} of a {count}-part set but not named NAME-"
                         f"{no + 1:05d}-of-{count:05d}.gguf, the name llama.cpp finds the other parts by")
    paths = part_paths(path, count)
    layouts: list[GGUFLayout] = []
    for i, part in enumerate(paths):
        if not part.is_file():
            raise SplitError(f"part {i + 1} of {count} of {set_prefix(path)} is missing: {part}")
        try:
            layouts.append(given if part == path else _layout(part))
        except (GGUFError, OSError) as exc:
            raise SplitError(f"part {i + 1} of {count} ({part}) is not a readable GGUF ({exc})") from None
    check_set([str(p) for p in paths], layouts, tensors, set_prefix(path) or path.stem)
    return ModelFiles(tuple(paths), tuple(layouts))


def check_set(parts: Sequence[str], layouts: Sequence[GGUFLayout], tensors: int, name: str) -> None:
    """That ``layouts``, the headers of the parts named ``parts`` in order, are one set ``name`` of ``tensors``
    tensors: each numbered as its place and of the set's counts, no tensor twice, none missing. SplitError
    names the part that is not (wherever the parts came from: files here, or a hub's)."""
    count = len(layouts)
    names: set[str] = set()
    for i, (part, layout) in enumerate(zip(parts, layouts, strict=True)):
        found = (layout.metadata.get(SPLIT_NO), layout.metadata.get(SPLIT_COUNT), layout.metadata.get(SPLIT_TENSORS))
        if found != (i, count, tensors):
            raise SplitError(f"{part} is not part {i + 1} of this {count}-part set of {tensors} tensors (its header "
                             f"says part {_shown(found[0], 1)} of {found[1]}, {found[2]} tensors)")
        twice = names.intersection(t.name for t in layout.tensors)
        if twice:
            raise SplitError(f"{part} is not of this set: tensor {sorted(twice)[0]} is in an earlier part too")
        names.update(t.name for t in layout.tensors)
    if len(names) != tensors:
        raise SplitError(f"the {count} parts of {name} hold {len(names)} tensors, not the {tensors} "
                         "their headers say: a part is of another set")


def _shown(no: object, plus: int) -> object:
    """A part number as people count (from 1), or whatever the header held instead."""
    return no + plus if isinstance(no, int) and not isinstance(no, bool) else no
