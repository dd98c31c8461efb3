"""Shared fixtures: the default model and what the engine knows of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshd.mesh.models import default_model_path


@pytest.fixture(scope="session")
def default_model() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random-weight GGUFs of each range-capable architecture, by name (see gguf_factory.TINY_SPECS)."""
    # imported here so that a suite run without the `gguf` test extra fails only the tests that need it
    from gguf_factory import TINY_SPECS, write_tiny_gguf

    root = tmp_path_factory.mktemp("tiny-gguf")
    return {name: write_tiny_gguf(root / f"{name}.gguf", spec) for name, spec in TINY_SPECS.items()}


@pytest.fixture(scope="session")
def unsupported_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GGUF of an architecture (gpt2) whose graph builder has no layer-range support."""
    from gguf_factory import UNSUPPORTED_SPEC, write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf-unsupported") / "gpt2.gguf", UNSUPPORTED_SPEC)


def greedy_reference(model: Path, prompts: list[str], new_tokens: int) -> dict[str, list[int]]:
    """Greedy answers of the whole model in one process: what every split pipeline must reproduce."""
    from meshd.engine.chain import LocalChain

    chain = LocalChain(model, None, n_ctx=1024, n_threads=1)
    try:
        out = {}
        for p in prompts:
            prompt = chain.head.tokenize(chain.head.apply_chat([{"role": "user", "content": p}]), add_special=False)
            out[p] = [t for t in chain.generate(prompt, new_tokens) if not chain.head.is_eog(t)]
        return out
    finally:
        chain.close()
