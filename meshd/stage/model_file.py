"""What a model file is to the mesh: its manifest, whose hash is the model id, and what placement
needs to know of it, read from its headers."""

from __future__ import annotations

from pathlib import Path

from meshd.mesh.models import ModelNotFound, model_info
from meshd.mesh.records import ModelInfo
from meshd.store.gguf_header import GGUFError
from meshd.store.manifest import Manifest, manifest_for
from meshd.store.split import SplitError, model_files


def model_manifest(path: Path, state_dir: Path | None) -> Manifest:
    """The manifest of a model file, whose hash is the model id the mesh knows it by (computed once,
    with a progress bar on a TTY, then cached); ModelNotFound, naming the file, if it is no usable GGUF."""
    try:
        return manifest_for(path, state_dir)
    except (ValueError, OSError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ModelNotFound(f"{path.name} is not a usable GGUF model ({reason})") from None


def describe_model(path: Path, digest: str) -> ModelInfo:
    """What placement needs to know of the GGUF at `path` (whole, or a sparse file with its header; a split
    set's part, every part's header read), from the headers alone; ModelNotFound, naming the file, if it is
    no usable GGUF."""
    try:
        files = model_files(path)
    except (GGUFError, SplitError, OSError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ModelNotFound(f"{path.name} is not a usable GGUF model ({reason})") from None
    first = files.layouts[0]
    sizes = {t.name: t.size for layout in files.layouts for t in layout.tensors}
    return model_info(digest, files.name, first.metadata, sizes, first.arrays)
