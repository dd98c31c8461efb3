"""The GPU switch of the tests, tied to no vendor: `@pytest.mark.gpu` tests run where the engine the
tests load sees a device to offload to, and are skipped elsewhere (tests/conftest.py).

On a machine without a GPU the lane runs on Mesa's lavapipe (a Vulkan driver on the CPU), as
`.ci/run` does: MESHD_VULKAN=1 picks the library built with `MESHD_VULKAN=1 tools/build_native.py`,
MESHD_VULKAN_DEVICE=0 has ggml use the CPU-type Vulkan device it otherwise passes over:

    MESHD_VULKAN=1 MESHD_VULKAN_DEVICE=0 .venv/bin/python -m pytest -m gpu tests/test_gpu_lane.py
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def engine_gpu() -> tuple[str | None, str]:
    """(the device a load offloads to, as the load report names it, or None; why there is none)."""
    from meshd.engine.devices import gpu_backend, gpus
    from meshd.engine.native import EngineUnavailable

    try:
        found = gpus()
        backend = gpu_backend()
    except EngineUnavailable as exc:
        return None, str(exc)
    if found:
        return str(found[0]), ""
    if not backend:
        return None, "a CPU-only engine build (MESHD_VULKAN=1 for the Vulkan build)"
    return None, f"the {backend} build sees no GPU (MESHD_VULKAN_DEVICE=0 for lavapipe)"
