"""Whether this node's memory holds some stage of the model it volunteers."""

from __future__ import annotations

from meshd.daemon.config import MIB, NodeConfig
from meshd.mesh.assignment import ModelSpec, stage_fits
from meshd.mesh.records import ModelInfo


class CannotVolunteer(Exception):
    """This node's memory holds no stage of the model it volunteers: it would serve nothing, and say nothing."""


def check_volunteer(info: ModelInfo, cfg: NodeConfig) -> None:
    """CannotVolunteer, with what the smallest stage needs and the flags that change it, unless some range
    of `info` fits this node's memory (as the tracker counts it: weights and KV at its session budget)."""
    limits = cfg.limits
    spec = ModelSpec.from_info(info, limits.max_sessions * limits.max_session_tokens)
    pieces = spec.pieces()
    if any(stage_fits(spec, start, end, cfg.memory_bytes, cfg.gpu_memory_bytes, cfg.gpu_layers) is None
           for start, end in pieces):
        return
    start, end = min(pieces, key=lambda piece: spec.stage_bytes(*piece))
    need = spec.stage_bytes(start, end)
    kv = (end - start) * spec.kv_bytes_per_layer
    offered = f"--memory {cfg.memory_bytes / MIB:.1f} MiB " + \
        (f"and --gpu-memory {cfg.gpu_memory_bytes / MIB:.1f} MiB hold" if cfg.gpu_layers else "holds")
    raise CannotVolunteer(
        f"{offered} no layer of {info.name}: its smallest stage (layers {start}:{end}) needs {need / MIB:.1f} MiB, "
        f"{(need - kv) / MIB:.1f} MiB of weights and {kv / MIB:.1f} MiB of KV for {limits.max_sessions} × "
        f"{limits.max_session_tokens} tokens (--max-sessions × --session-tokens); offer more memory, "
        f"or fewer sessions or tokens, or join with --no-model")
