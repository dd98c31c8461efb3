"""The range-aware llama.cpp engine, bound through cffi."""

from meshd.engine.engine import (
    Context,
    EngineError,
    InvalidInput,
    KVCacheFull,
    Model,
    ModelLoadError,
    RangeReport,
    Sampler,
    SamplingParams,
    UnsupportedModel,
)
from meshd.engine.native import EngineUnavailable

__all__ = [
    "Context", "EngineError", "EngineUnavailable", "InvalidInput", "KVCacheFull", "Model",
    "ModelLoadError", "RangeReport", "Sampler", "SamplingParams", "UnsupportedModel",
]
