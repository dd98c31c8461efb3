"""A smoke run's model: tiny random weights with the default model's 30 layers.

A smoke run goes through every part of a benchmark and its figures are no measurement: where a benchmark's
cost is the default model's compute and bytes (a verified route's replays, fetching and hashing its 98 MB
over and over), a model of a few MB takes each part in milliseconds. Its 30 layers keep the ranges a
benchmark cuts (0:10, 15:30) what they are with the default model.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

from gguf_factory import TINY_SPECS, write_tiny_gguf

# the default model's layers (SmolLM2-135M)
LAYERS = 30


def use_tiny_model() -> Path:
    """Writes the tiny model to a directory removed at exit and names it $MESHD_MODEL, the default model of
    this process and of every one it starts (stages, replicas, `meshd` commands)."""
    directory = Path(tempfile.mkdtemp(prefix="bench-smoke-model-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    spec = dataclasses.replace(TINY_SPECS["llama-gqa-tied"], n_layer=LAYERS)
    path = write_tiny_gguf(directory / "tiny-llama-30.gguf", spec)
    os.environ["MESHD_MODEL"] = str(path)
    return path
