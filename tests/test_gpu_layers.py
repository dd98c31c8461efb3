"""`--gpu-layers N` counts over the owned range, from its end; at the tail the output head is one more.

llama.cpp counts n_gpu_layers from the end of the whole model, so a head stage
offloaded none of its own layers. The engine's load report says which owned layers
the request puts on a GPU whether or not the build has one, so the counting is
tested on CPU; the tracker's estimate (meshd.mesh.assignment.offload_plan) follows
the same rule, and the flag reaches the engine through the worker and the CLI.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from gguf_factory import TINY_SPECS
from gpu_lane import engine_gpu
from localmesh import start_serve

from meshd.cli.main import main
from meshd.cli.parser import build_parser
from meshd.engine import InvalidInput, Model
from meshd.engine.supervisor import EngineSupervisor, WorkerSpec
from meshd.mesh.assignment import ModelSpec, NodeCapacity, offload_plan, stage_fits

N_LAYER = TINY_SPECS["llama-gqa-untied"].n_layer
# the device loads offload to, of any backend (tests/gpu_lane.py), None on a CPU build
GPU = engine_gpu()[0]
ON_GPU = GPU is not None

# (range, --gpu-layers) -> (offloaded owned layers, output head offloaded)
CASES = [
    (None, 0, (N_LAYER, N_LAYER), False),
    (None, -1, (0, N_LAYER), True),
    (None, 1, (N_LAYER, N_LAYER), True),  # as llama.cpp: the output head is the first to go
    (None, 3, (4, N_LAYER), True),
    ((0, 2), 1, (1, 2), False),  # the head stage offloads its own last layer
    ((0, 2), -1, (0, 2), False),  # no output head to offload before the tail
    ((0, 2), 9, (0, 2), False),
    ((2, 4), 1, (3, 4), False),
    ((2, 4), 2, (2, 4), False),
    ((4, 6), 1, (6, 6), True),
    ((4, 6), 2, (5, 6), True),
    ((4, 6), -1, (4, 6), True),
]


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama-gqa-untied"]


@pytest.mark.parametrize(("layers", "gpu_layers", "offloaded", "head"), CASES)
def test_the_load_report_says_which_owned_layers_are_offloaded(
    model: Path, layers: tuple[int, int] | None, gpu_layers: int, offloaded: tuple[int, int], head: bool,
) -> None:
    with Model(model, layers, n_gpu_layers=gpu_layers) as m:
        r = m.report
    assert (r.gpu_layers, r.gpu_output) == (offloaded, head)
    if not ON_GPU:
        assert r.n_bytes_gpu == 0  # a CPU build plans, and keeps everything in RAM
    elif offloaded[1] > offloaded[0] or head:
        assert 0 < r.n_bytes_gpu <= r.n_bytes


@pytest.mark.parametrize(("layers", "gpu_layers", "offloaded", "head"), CASES)
def test_the_tracker_counts_offload_as_the_engine_does(
    layers: tuple[int, int] | None, gpu_layers: int, offloaded: tuple[int, int], head: bool,
) -> None:
    start, end = layers or (0, N_LAYER)
    on_gpu, head_out = offload_plan(end - start, end == N_LAYER, gpu_layers)
    assert ((end - on_gpu, end), head_out) == (offloaded if offloaded[1] > offloaded[0] else (end, end), head)


def test_gpu_memory_holds_the_offloaded_layers_and_ram_the_rest() -> None:
    spec = ModelSpec("m", N_LAYER, 100, kv_bytes_per_layer=10, head_bytes=1000, tail_bytes=500)
    # the head keeps its embedding in RAM however much it offloads
    assert spec.stage_split(0, 2, -1) == (1000, 220)
    assert spec.stage_split(0, 2, 1) == (1110, 110)
    assert spec.stage_split(4, 6, 1) == (220, 500)  # the output head alone
    assert spec.stage_split(4, 6, 0) == (720, 0)
    small_ram = NodeCapacity("n", memory_bytes=300, seconds_per_layer=0.0, gpu_memory_bytes=10_000, gpu_layers=-1)
    assert small_ram.fits(spec, 2, 6) and not small_ram.fits(spec, 0, 6)  # the embedding needs RAM
    assert not NodeCapacity("n", 300, 0.0, 10_000, gpu_layers=0).fits(spec, 2, 6)
    assert "GPU memory" in (stage_fits(spec, 2, 6, 10_000, 100, -1) or "")


@pytest.mark.slow
async def test_the_worker_loads_with_the_spec_gpu_layers(model: Path) -> None:
    engine = EngineSupervisor(WorkerSpec(model, (0, 4), n_ctx=64, n_seq_max=1, n_batch=16, threads=1, gpu_layers=2))
    async with trio.open_nursery() as nursery:
        report = await nursery.start(engine.run)
        assert (report.gpu_layers, report.gpu_output) == ((2, 4), False)
        assert report.stage_width == TINY_SPECS["llama-gqa-untied"].n_embd
        nursery.cancel_scope.cancel()


def test_a_bad_gpu_layer_count_is_refused(model: Path) -> None:
    with pytest.raises(InvalidInput, match="gpu layers"):
        Model(model, (0, 2), n_gpu_layers=-2)


@pytest.mark.parametrize("argv", [
    ["serve", "--gpu-layers", "-2"],
    ["join", "--gpu-layers", "x"],
])
def test_cli_refuses_a_bad_gpu_layer_count_in_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--gpu-layers" in err and len(err.splitlines()) == 1


def test_join_needs_gpu_memory_for_gpu_layers(tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["join", "--model", str(model), "--gpu-layers", "2", "--state-dir", str(tmp_path / "state")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--gpu-layers needs --gpu-memory" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_serve_says_what_it_offloaded(model: Path) -> None:
    served = start_serve("--model", str(model), "--layers", "0:4", "--gpu-layers", "1", "--threads", "1",
                         "--max-sessions", "1", "--session-tokens", "64")
    try:
        banner = next(line for line in served.lines if line.startswith("meshd: serving layers [0, 4)"))
    finally:
        served.stop()
    if ON_GPU:
        assert banner.endswith("MiB)") and f"; layers [3, 4) on {GPU} (" in banner
    else:
        assert banner.endswith("; no GPU took layers [3, 4) (this build has none, or it found no device): all in RAM")


def test_auto_offloads_the_most_of_a_range_the_gpu_memory_holds() -> None:
    gb = 1 << 30
    spec = ModelSpec("m", 8, gb, kv_bytes_per_layer=gb // 4, head_bytes=gb, tail_bytes=gb // 2)
    # a middle range of 4: each layer takes 1.25 GB on the GPU with its KV
    assert [spec.gpu_layers_within(2, 6, m) for m in (0, gb, 5 * gb // 4, 3 * gb, 5 * gb)] == [0, 0, 1, 2, -1]
    # at the tail the output head is the first to go (it is the last of the range)
    assert spec.gpu_layers_within(6, 8, gb // 2) == 1 and spec.gpu_layers_within(6, 8, 3 * gb) == -1
    for m in range(0, 8 * gb, gb // 3):
        k = spec.gpu_layers_within(0, 8, m)
        assert spec.stage_split(0, 8, k)[1] <= m or k == 0
        assert k == -1 or spec.stage_split(0, 8, k + 1)[1] > m


@pytest.mark.slow
def test_serve_sizes_auto_to_the_gpus_free_memory(model: Path) -> None:
    served = start_serve("--model", str(model), "--layers", "2:6", "--gpu-layers", "auto", "--threads", "1",
                         "--max-sessions", "1", "--session-tokens", "64")
    try:
        banner = next(line for line in served.lines if line.startswith("meshd: serving layers [2, 6)"))
    finally:
        served.stop()
    if ON_GPU:
        # a tiny model's range fits any GPU whole, the tail's output head too
        assert f"; layers [2, 6) and the output head on {GPU} (" in banner, banner
    else:
        # no GPU: auto offloads nothing and says nothing of an offload
        assert "GPU" not in banner, banner


def test_cli_takes_minus_one_for_every_owned_layer() -> None:
    assert build_parser().parse_args(["serve", "--gpu-layers", "-1"]).gpu_layers == -1
    args = build_parser().parse_args(["join", "--gpu-layers", "-1", "--gpu-memory", "8G"])
    assert (args.gpu_layers, args.gpu_memory) == (-1, 8 << 30)


# ----- GPU detection: the devices the engine sees


def test_the_engine_lists_its_devices_the_cpu_among_them() -> None:
    from meshd.engine.devices import devices, gpu_backend, gpus, no_gpu_note

    found = devices()
    cpu = [d for d in found if d.kind == "cpu"]
    assert cpu and cpu[0].backend == "CPU" and cpu[0].memory_total > 0
    assert all(0 <= d.memory_free <= d.memory_total for d in found if d.memory_total)
    if ON_GPU:
        assert str(gpus()[0]) == GPU and gpu_backend() in ("Vulkan", "CUDA") and no_gpu_note() is None
    else:
        assert gpus() == [] and (no_gpu_note() is None) == (gpu_backend() == "")


def test_the_device_list_is_sized_then_filled() -> None:
    from meshd.engine.native import load

    ffi, lib = load()
    n = ffi.new("int32_t *")
    assert lib.me_devices(ffi.NULL, 0, n) == lib.ME_OK and n[0] >= 1
    assert lib.me_devices(ffi.new("me_device_info[]", 1), 0, n) == lib.ME_ERR_BUFFER_TOO_SMALL
    assert lib.me_devices(ffi.NULL, -1, n) == lib.ME_ERR_INVALID_ARGUMENT
    assert lib.me_devices(ffi.NULL, 0, ffi.NULL) == lib.ME_ERR_INVALID_ARGUMENT
    assert lib.me_model_device(ffi.NULL, ffi.new("me_device_info *")) == lib.ME_ERR_INVALID_ARGUMENT


def test_a_bad_vulkan_device_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshd.engine import EngineUnavailable
    from meshd.engine.devices import check_vulkan_device

    monkeypatch.setenv("MESHD_VULKAN_DEVICE", "gpu0")
    with pytest.raises(EngineUnavailable, match="MESHD_VULKAN_DEVICE='gpu0': give one Vulkan device's index"):
        check_vulkan_device()


def test_gpu_flags_take_auto() -> None:
    args = build_parser().parse_args(["join", "--gpu-layers", "auto", "--gpu-memory", "auto"])
    assert (args.gpu_layers, args.gpu_memory) == ("auto", "auto")
    assert build_parser().parse_args(["serve", "--gpu-layers", "AUTO"]).gpu_layers == "auto"


def test_auto_fills_from_the_engines_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from meshd.cli.gpu import resolve_gpu
    from meshd.engine.devices import gpus

    args = build_parser().parse_args(["join", "--gpu-layers", "auto", "--gpu-memory", "auto"])
    resolve_gpu(args)
    err = capsys.readouterr().err
    if ON_GPU:
        assert args.gpu_layers == -1 and 0 < args.gpu_memory <= gpus()[0].memory_total
        assert f"meshd: GPU {GPU}, " in err
    else:
        assert (args.gpu_layers, args.gpu_memory) == (0, 0)


def test_the_report_says_what_it_offloaded_and_where(model: Path) -> None:
    with Model(model, (4, 6), n_gpu_layers=2) as m:
        r = m.report
    assert r.offload_plan == "layers [5, 6) and the output head"
    if ON_GPU:
        assert r.offloaded.startswith(f"layers [5, 6) and the output head on {GPU}, ") and r.offloaded.endswith(" MiB")
    else:
        assert r.offloaded == "" and r.device == ""
