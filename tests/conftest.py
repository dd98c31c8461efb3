"""Shared fixtures: the default model and what the engine knows of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshd.models import default_model_path


@pytest.fixture(scope="session")
def default_model() -> Path:
    return default_model_path()
