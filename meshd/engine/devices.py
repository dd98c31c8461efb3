"""The devices the engine can offload layers to (GPU detection), as the native library sees them.

A build with a GPU backend (MESHD_VULKAN=1 or MESHD_CUDA=1 tools/build_native.py) lists the
devices its backend found, each with the memory its driver says is free; `--gpu-layers auto` and
`--gpu-memory auto` fill from the first GPU-like one, the device a load offloads to.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from meshd.engine.native import EngineUnavailable, load

# ggml's Vulkan backend reads the index list as integers separated by commas or spaces, and drops
# its whole backend on an index it has no device for; meshd names one device.
_VULKAN_DEVICE = re.compile(r"[0-9]{1,3}")


@dataclass(frozen=True)
class Device:
    name: str          # ggml's, e.g. "Vulkan0"
    description: str   # the driver's, e.g. "llvmpipe (LLVM 15.0.6, 256 bits)"
    backend: str       # "Vulkan", "CUDA", "CPU"
    kind: str          # "cpu", "gpu", "igpu" (integrated: shares the host's memory), "accel"
    memory_free: int
    memory_total: int

    @property
    def is_gpu(self) -> bool:
        return self.kind in ("gpu", "igpu")

    def __str__(self) -> str:
        return f"{self.name} ({self.description})"


def device_of(ffi: Any, lib: Any, info: Any) -> Device | None:
    """A filled me_device_info, None where its name is empty (no device)."""
    name = ffi.string(info.name).decode(errors="replace")
    if not name:
        return None
    kinds = {lib.ME_DEVICE_CPU: "cpu", lib.ME_DEVICE_GPU: "gpu", lib.ME_DEVICE_IGPU: "igpu", lib.ME_DEVICE_ACCEL: "accel"}
    return Device(name=name, description=ffi.string(info.description).decode(errors="replace"),
                  backend=ffi.string(info.backend).decode(errors="replace"), kind=kinds.get(info.type, "cpu"),
                  memory_free=int(info.memory_free), memory_total=int(info.memory_total))


def check_vulkan_device() -> None:
    """MESHD_VULKAN_DEVICE, when set, must name one Vulkan device by its index (vulkaninfo's order):
    the engine then uses it even where its type is CPU (Mesa's lavapipe), which ggml passes over."""
    want = os.environ.get("MESHD_VULKAN_DEVICE", "")
    if want and not _VULKAN_DEVICE.fullmatch(want):
        raise EngineUnavailable(f"MESHD_VULKAN_DEVICE={want!r}: give one Vulkan device's index, e.g. 0")


def gpu_backend() -> str:
    """The GPU backend built into the library ("Vulkan", "CUDA"), "" for a CPU-only build."""
    ffi, lib = load()
    return str(ffi.string(lib.me_gpu_backend()).decode())


def devices() -> list[Device]:
    """Every device the engine sees, the CPU included, in ggml's order."""
    check_vulkan_device()
    ffi, lib = load()
    n = ffi.new("int32_t *")
    if lib.me_devices(ffi.NULL, 0, n) != lib.ME_OK:
        raise EngineUnavailable(f"the engine cannot list its devices: {ffi.string(lib.me_last_error()).decode()}")
    while True:
        capacity = n[0]
        buf = ffi.new("me_device_info[]", max(capacity, 1))
        rc = lib.me_devices(buf, capacity, n)
        if rc == lib.ME_ERR_BUFFER_TOO_SMALL and n[0] > capacity:
            continue  # a device appeared between the calls
        if rc != lib.ME_OK:
            raise EngineUnavailable(f"the engine cannot list its devices: {ffi.string(lib.me_last_error()).decode()}")
        return [d for d in (device_of(ffi, lib, buf[i]) for i in range(n[0])) if d is not None]


def gpus() -> list[Device]:
    """The devices a load can offload to, the first the one it does."""
    return [d for d in devices() if d.is_gpu]


def no_gpu_note() -> str | None:
    """One line for a GPU build that finds no device to offload to (its layers then run on the CPU),
    None otherwise."""
    backend = gpu_backend()
    if not backend or gpus():
        return None
    hint = " (a CPU-type Vulkan device such as lavapipe is used only when named: MESHD_VULKAN_DEVICE=N)" \
        if backend == "Vulkan" else ""
    return f"this {backend} build finds no GPU: every layer runs on the CPU{hint}"
