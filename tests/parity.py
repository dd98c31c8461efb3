"""The parity bar for logits: exact on the CPU build, 1e-4 only where kernels may reorder sums (CUDA)."""

from __future__ import annotations

import os

import numpy as np

# On CPU a chain of ranges runs the very same kernels on the very same rows as the
# whole model: any difference at all is a bug. GPU kernels may sum in another order.
EXACT = os.environ.get("MESHD_CUDA") != "1"
GPU_TOLERANCE = 1e-4


def assert_same_logits(want: np.ndarray, got: np.ndarray, where: str) -> None:
    assert want.shape == got.shape, f"{where}: logits of shape {got.shape}, expected {want.shape}"
    diff = float(np.max(np.abs(want - got))) if want.size else 0.0
    if EXACT:
        assert np.array_equal(want, got), f"{where}: logits differ (max abs difference {diff}); the CPU bar is exact"
    else:
        assert diff <= GPU_TOLERANCE, f"{where}: max abs logit difference {diff}"
