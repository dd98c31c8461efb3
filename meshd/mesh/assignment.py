"""What placement works with: a model's sizes (`ModelSpec`), what a node offers (`NodeCapacity`), and
what the tracker places (`Stage`, `Assignment`), with the reading of members' records into them.

How the tracker places a model is meshd.mesh.placement; the chain search it runs,
meshd.mesh.chains; why a model cannot be covered, meshd.mesh.shortfall.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from meshd.mesh.records import ROLE_CLIENT, CapabilityRecord, ModelInfo

Range = tuple[int, int]


@dataclass(frozen=True)
class ModelSpec:
    """What placement needs to know of a model, with the KV budget already chosen."""

    digest: str
    n_layers: int
    bytes_per_layer: int  # the largest layer's weights: what the chain search counts for every layer
    kv_bytes_per_layer: int = 0  # KV cache of one layer for the planned context x sessions
    head_bytes: int = 0  # token embedding, at the stage owning layer 0
    tail_bytes: int = 0  # output norm and LM head, at the stage owning the last layer
    kv_tokens: int = 0  # the tokens `kv_bytes_per_layer` is for: what a shortfall names
    name: str = ""
    layer_sizes: tuple[int, ...] = ()  # weights of each layer; empty: every one `bytes_per_layer`
    # The layers a chain may be cut just before, ascending (glm-dsa: its full-indexer layers); None: any.
    cuts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.layer_sizes and len(self.layer_sizes) != self.n_layers:
            raise ValueError(f"{len(self.layer_sizes)} layer sizes for {self.n_layers} layers")
        if self.cuts is not None and list(self.cuts) != sorted(set(self.cuts) & set(range(1, self.n_layers))):
            raise ValueError(f"cuts {list(self.cuts)[:8]} are not ascending layers inside the {self.n_layers}")

    def allows(self, start: int, end: int) -> bool:
        """Whether a stage may serve [start, end): both its ends are the model's ends or allowed cuts."""
        return self.cuts is None or all(b in (0, self.n_layers) or b in self._cut_set for b in (start, end))

    @cached_property
    def _cut_set(self) -> frozenset[int]:
        return frozenset(self.cuts or ())

    def points(self, start: int, end: int) -> list[int]:
        """Where [start, end) may be cut: its ends and the allowed cuts inside it, ascending."""
        inside = range(start + 1, end) if self.cuts is None else [c for c in self.cuts if start < c < end]
        return [start, *inside, end]

    def pieces(self) -> list[Range]:
        """The smallest ranges a stage may serve: from each allowed cut to the next."""
        points = self.points(0, self.n_layers)
        return list(zip(points, points[1:], strict=False))

    @cached_property
    def _sums(self) -> np.ndarray | None:
        """Prefix sums of the layer sizes: any stage's weights in one subtraction."""
        return np.concatenate(([0], np.cumsum(self.layer_sizes, dtype=np.int64))) if self.layer_sizes else None

    @classmethod
    def from_info(cls, info: ModelInfo, kv_tokens: int) -> ModelSpec:
        """`kv_tokens`: tokens of KV each stage must hold, context length x concurrent sessions."""
        return cls(
            digest=info.digest,
            n_layers=info.n_layers,
            bytes_per_layer=info.bytes_per_layer,
            kv_bytes_per_layer=info.kv_bytes_per_token * kv_tokens,
            head_bytes=info.head_bytes,
            tail_bytes=info.tail_bytes,
            kv_tokens=kv_tokens,
            name=info.name,
            layer_sizes=tuple(info.layer_bytes),
            cuts=None if info.cuts is None else tuple(info.cuts),
        )

    def with_kv_tokens(self, kv_tokens: int) -> ModelSpec:
        per_token = self.kv_bytes_per_layer // self.kv_tokens if self.kv_tokens else 0
        return replace(self, kv_bytes_per_layer=per_token * kv_tokens, kv_tokens=kv_tokens)

    @property
    def layer_bytes(self) -> int:
        return self.bytes_per_layer + self.kv_bytes_per_layer

    def weights(self, start: int, end: int) -> int:
        """Weight bytes of layers [start, end)."""
        sums = self._sums
        return int(sums[end] - sums[start]) if sums is not None else (end - start) * self.bytes_per_layer

    def weight_bytes(self, start: int, end: int) -> int:
        """Bytes of the tensors a stage serving layers [start, end) loads (what it fetches)."""
        size = self.weights(start, end)
        if start == 0:
            size += self.head_bytes
        if end == self.n_layers:
            size += self.tail_bytes
        return size

    def stage_bytes(self, start: int, end: int) -> int:
        """Memory a stage serving layers [start, end) needs, RAM and GPU together."""
        size = self.weights(start, end) + (end - start) * self.kv_bytes_per_layer
        if start == 0:
            size += self.head_bytes
        if end == self.n_layers:
            size += self.tail_bytes
        return size

    def stage_split(self, start: int, end: int, gpu_layers: int) -> tuple[int, int]:
        """(RAM, GPU memory) a stage serving [start, end) needs when it offloads `gpu_layers`."""
        return self.split(end - start, start == 0, end == self.n_layers, gpu_layers,
                          self.weights(start, end), lambda k: self.weights(end - k, end))

    def gpu_layers_within(self, start: int, end: int, gpu_memory: int) -> int:
        """The most layers of [start, end) a stage offloads within ``gpu_memory`` (the output head counting
        as one more at the tail, as the engine's plan does): -1 when they all fit."""
        slots = end - start + (end == self.n_layers)
        if self.stage_split(start, end, -1)[1] <= gpu_memory:
            return -1
        return max((k for k in range(slots) if self.stage_split(start, end, k)[1] <= gpu_memory), default=0)

    def split(self, count: int, head: bool, tail: bool, gpu_layers: int, weights: int,
              last_weights: Callable[[int], int]) -> tuple[int, int]:
        """(RAM, GPU memory) of a stage of `count` layers weighing `weights`, the last k of them `last_weights(k)`.

        As the engine counts: the last layers of the range go to the GPU with their KV, at the tail
        the output head is one more (the last), -1 offloads them all; the token embedding stays in RAM."""
        on_gpu, head_out = offload_plan(count, tail, gpu_layers)
        gpu = last_weights(on_gpu) + on_gpu * self.kv_bytes_per_layer + (self.tail_bytes if head_out else 0)
        ram = weights - last_weights(on_gpu) + (count - on_gpu) * self.kv_bytes_per_layer
        ram += (self.head_bytes if head else 0) + (self.tail_bytes if tail and not head_out else 0)
        return ram, gpu


def offload_plan(count: int, tail: bool, gpu_layers: int) -> tuple[int, bool]:
    """How many of a stage's `count` layers (its last ones) go to the GPU, and whether its output head does.

    The engine's rule: `gpu_layers` counts from the end of the range, at the tail the output head
    is one more (the last); -1, or as many as there are, offloads them all."""
    slots = count + tail
    offload = slots if gpu_layers < 0 else min(gpu_layers, slots)
    head_out = tail and offload > 0
    return offload - head_out, head_out


@dataclass(frozen=True)
class NodeCapacity:
    node_id: str
    memory_bytes: int
    seconds_per_layer: float  # 0 when not measured yet
    gpu_memory_bytes: int = 0
    gpu_layers: int = 0  # layers of its range it offloads, from the range's end; -1: all
    # Layer ranges of the model it holds on disk: serving one of them needs no fetch.
    holds: tuple[Range, ...] = ()

    def fits(self, model: ModelSpec, start: int, end: int) -> bool:
        """Whether layers [start, end) fit this node's RAM and GPU memory."""
        return stage_fits(model, start, end, self.memory_bytes, self.gpu_memory_bytes, self.gpu_layers) is None


def stage_fits(model: ModelSpec, start: int, end: int, memory: int, gpu_memory: int, gpu_layers: int) -> str | None:
    """Why layers [start, end) do not fit this memory (RAM, GPU and the offload), or None when they do."""
    ram, gpu = model.stage_split(start, end, gpu_layers)
    if ram > memory:
        return f"needs {ram} bytes of RAM, this node offers {memory}"
    if gpu > gpu_memory:
        return f"needs {gpu} bytes of GPU memory for its {gpu_layers} offloaded layers, this node offers {gpu_memory}"
    return None


@dataclass(frozen=True)
class Stage:
    node_id: str
    start: int
    end: int

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class AssignmentPolicy:
    # What one more stage costs a token: a network hop (the tracker knows its mesh's RTTs).
    hop_seconds: float = 0.005
    # How many of the fastest and of the largest nodes the exact search considers.
    candidates: int = 24
    # Keep the current placement unless a fresh one costs at most this fraction of it (25% more
    # tokens a second): timing noise and a plan a few per cent better never pay for reloading (and
    # often fetching) every range, which drops the sessions' KV and stalls asks meanwhile.
    keep_ratio: float = 0.8


@dataclass(frozen=True)
class Assignment:
    model: str
    n_layers: int
    boundaries: tuple[int, ...]  # segment cuts, from 0 to n_layers
    stages: tuple[Stage, ...]  # every node's range, at most one per node
    chain: tuple[Stage, ...]  # the fastest chain through them, as a route with `hop_seconds` links
    seconds_per_token: float  # estimated along `chain`: compute plus one hop per stage

    def ranges(self) -> dict[str, Range]:
        return {stage.node_id: (stage.start, stage.end) for stage in self.stages}


class CoverageError(ValueError):
    """The nodes holding a model cannot serve all of its layers."""


def capacities(records: Iterable[CapabilityRecord], digest: str) -> list[NodeCapacity]:
    """The nodes that can serve `digest`: they hold the file or fetch their range of it, stay, and
    are not light clients."""
    return [
        NodeCapacity(record.node_id, record.memory_bytes, record.seconds_per_layer,
                     record.gpu_memory_bytes, record.gpu_layers, held_ranges(record, digest))
        for record in records
        if not record.leaving and ROLE_CLIENT not in record.roles and record.model(digest) is not None
    ]


def held_ranges(record: CapabilityRecord, digest: str) -> tuple[Range, ...]:
    """The layers of `digest` that `record`'s node holds on disk: all of a whole file, or what it fetched."""
    info = record.model(digest)
    if info is not None and info.whole:
        return ((0, info.n_layers),)
    return tuple((held.start, held.end) for held in record.holds if held.model == digest)


def unheld_layers(records: Iterable[CapabilityRecord], digest: str, n_layers: int) -> list[Range]:
    """The layer ranges of `digest` that none of `records` (the live ones) holds on disk: a range
    there can be neither served nor fetched. None where a member fetches the model from the hub
    (its ModelInfo names one): every layer can be fetched from there."""
    held = [False] * n_layers
    for record in records:
        if record.leaving:
            continue
        info = record.model(digest)
        if info is not None and info.hub:
            return []
        for start, end in held_ranges(record, digest):
            held[start:min(end, n_layers)] = [True] * (min(end, n_layers) - start)
    gaps: list[Range] = []
    for layer, ok in enumerate(held):
        if ok:
            continue
        if gaps and gaps[-1][1] == layer:
            gaps[-1] = (gaps[-1][0], layer + 1)
        else:
            gaps.append((layer, layer + 1))
    return gaps


def range_refusal(info: ModelInfo, model: str, start: int, end: int, own: CapabilityRecord, kv_tokens: int,
                  disk: int | None) -> str | None:
    """Why a volunteer of `info` (its record `own`, `kv_tokens` of KV a stage, `disk` bytes to fetch into;
    None: no limit) will not load layers [start, end) of `model` a tracker placed it on; None: it will."""
    if model != info.digest or not 0 <= start < end <= info.n_layers:
        return f"not a range of {info.name} ({model[:12]})"
    spec = ModelSpec.from_info(info, kv_tokens)
    if not spec.allows(start, end):
        # the engine would refuse it at load: a tracker that placed it does not know the model's cuts
        rule = f"may be cut only before layers {', '.join(map(str, info.cuts))[:200]}" if info.cuts \
            else "may not be cut"
        return f"{info.name} {rule}"
    refused = stage_fits(spec, start, end, own.memory_bytes, own.gpu_memory_bytes, own.gpu_layers)
    if refused is not None:
        return refused
    if not info.whole and disk is not None and spec.weight_bytes(start, end) > disk:
        return f"needs {spec.weight_bytes(start, end)} bytes of disk, this node offers {disk} (--disk)"
    return None
