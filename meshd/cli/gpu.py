"""--gpu-layers and --gpu-memory, `auto` among them, and what a load put on the GPU."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from meshd.cli.failures import CommandError
from meshd.cli.text import mib, plural
from meshd.engine import RangeReport

if TYPE_CHECKING:
    from meshd.engine.devices import Device


AUTO = "auto"


def or_auto(convert: Callable[[str], int]) -> Callable[[str], int | str]:
    """`convert`, or the word auto: filled from the devices the engine finds (resolve_gpu)."""
    def either(text: str) -> int | str:
        return AUTO if text.strip().lower() == AUTO else convert(text)
    return either


def resolve_gpu(args: argparse.Namespace, sizes_layers: bool = False, runs_layers: bool = True) -> Device | None:
    """Fills --gpu-memory auto from the first GPU the engine finds (the one a load offloads to), and
    --gpu-layers auto unless the caller sizes them to its range (``sizes_layers``: serve's; join's
    tracker places ranges that fit), and says in one line what it found; a GPU build that finds none
    says so. The GPU, where auto asked for one and one was found. A node that will run layers
    (``runs_layers``) and whose engine cannot load is one line: a volunteer started so was placed,
    then warned every few seconds that it could not serve, for as long as it ran."""
    from meshd.engine.devices import gpus, no_gpu_note
    from meshd.engine.native import EngineUnavailable

    asked = AUTO in (args.gpu_layers, getattr(args, "gpu_memory", None))
    try:
        note = no_gpu_note()
        gpu = next(iter(gpus()), None) if asked else None
    except EngineUnavailable as exc:
        if asked:
            raise CommandError(f"--gpu-layers/--gpu-memory auto: {exc}") from None
        if runs_layers:
            raise CommandError(f"this node cannot run layers: {exc}") from None
        return None
    if note:
        print(f"meshd: {note}", file=sys.stderr, flush=True)
    if not asked:
        return None
    if args.gpu_layers == AUTO and not (sizes_layers and gpu is not None):
        args.gpu_layers = -1 if gpu is not None else 0
    if getattr(args, "gpu_memory", None) == AUTO:
        args.gpu_memory = gpu.memory_free if gpu is not None else 0
    if gpu is not None:
        print(f"meshd: GPU {gpu}, {mib(gpu.memory_free)} free of {mib(gpu.memory_total)}", file=sys.stderr, flush=True)
    return gpu


def gpu_layers_text(n: int) -> str:
    return "all its layers" if n < 0 else plural(n, "layer")


def offload_text(report: RangeReport) -> str:
    """What the load put on the GPU, as the engine reports it."""
    begin, end = report.gpu_layers
    if end <= begin and not report.gpu_output:
        return ""
    if not report.n_bytes_gpu:
        return f"; no GPU took {report.offload_plan} (this build has none, or it found no device): all in RAM"
    return f"; {report.offload_plan} on {report.device or 'the GPU'} ({mib(report.n_bytes_gpu)})"
