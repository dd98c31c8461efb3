"""Why the live members cannot cover a model, and which flag would change that: the memory needed
(weights and KV at the volunteers' session budget) against the memory offered."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from meshd.mesh.assignment import AssignmentPolicy, ModelSpec, NodeCapacity
from meshd.mesh.chains import distinct, primary_chain, usable_hosts


def covers(nodes: Sequence[NodeCapacity], model: ModelSpec, policy: AssignmentPolicy) -> bool:
    return primary_chain(usable_hosts(nodes, model), model, policy) is not None


def coverage_shortfall(
    nodes: Sequence[NodeCapacity], model: ModelSpec, policy: AssignmentPolicy = AssignmentPolicy()
) -> str | None:
    """Why `nodes` cannot cover `model` and which flag would change that, or None when they can."""
    nodes = distinct(nodes)
    if nodes and covers(nodes, model, policy):
        return None
    return shortfall(nodes, model, policy)


def shortfall(nodes: Sequence[NodeCapacity], model: ModelSpec, policy: AssignmentPolicy) -> str:
    """Memory needed (weights plus KV at the volunteers' session budget) against memory offered,
    what of the model that holds, and the smallest change of flags that would cover it."""
    if not nodes:
        return "no member volunteers the model"
    n = model.n_layers
    weights = n * model.bytes_per_layer + model.head_bytes + model.tail_bytes
    kv = n * model.kv_bytes_per_layer
    memories = sorted(node.memory_bytes for node in nodes)
    count = f"{len(nodes)} volunteer{'s' if len(nodes) != 1 else ''}"
    if memories[0] == memories[-1]:
        offered = f"{len(nodes)} × {_mib(memories[0])}" if len(nodes) > 1 else _mib(memories[0])
    else:
        offered = f"{_mib(sum(memories))} in all (the largest {_mib(memories[-1])})"
    tokens_text = f" ({model.kv_tokens:,} tokens a stage: --max-sessions × --session-tokens)" \
        if model.kv_tokens else ""
    kv_text = f" + {_mib(kv)} of KV{tokens_text}" if kv else ""
    layer = f"a layer takes {_mib(model.bytes_per_layer)}" + \
        (f" + {_mib(model.kv_bytes_per_layer)} of KV" if kv else "")
    need, total = weights + kv, sum(memories)
    if memories[-1] < model.layer_bytes:
        what = f", none of which holds one layer ({layer})"
    elif total < need:
        what = f" ({_mib(need - total)} short)"
    elif _layers_held(memories, model) < n:
        what = (f", which hold {_layers_held(memories, model)} of its {n} layers once the first stage takes the "
                f"token embedding ({_mib(model.head_bytes)}) and the last the output head "
                f"({_mib(model.tail_bytes)}); {layer}")
    elif memories[-1] < model.head_bytes + model.layer_bytes:
        what = f", none of which holds the first stage: the token embedding ({_mib(model.head_bytes)}) and a layer"
    elif len(memories) < 2 or memories[-2] < model.tail_bytes + model.layer_bytes:
        what = (f", and the one that holds the token embedding ({_mib(model.head_bytes)}) cannot hold the output "
                f"head too: no other holds the last stage ({_mib(model.tail_bytes)} and a layer)")
    else:
        what = f", which no arrangement fits ({layer}; the embedding {_mib(model.head_bytes)}, the output head " \
            f"{_mib(model.tail_bytes)})"
    if model.cuts is not None:
        rule = f"it may be cut only before layer{'s' if len(model.cuts) != 1 else ''} {_listing(model.cuts)}" \
            if model.cuts else "it may not be cut"
        start, end = min(model.pieces(), key=lambda piece: model.stage_bytes(*piece))
        smallest = model.stage_bytes(start, end)
        if memories[-1] < smallest:
            what = f", none of which holds the smallest piece it may be cut into (layers {start}:{end}, " \
                f"{_mib(smallest)}: {rule})"
        else:
            what += f"; {rule}"
    fixes = []
    memory = _memory_to_cover(nodes, model, policy)
    fixes.append(f"raise --memory to {_flag_size(memory)} on each volunteer")
    tokens = _kv_to_cover(nodes, model, policy)
    if tokens is not None:
        fixes.append(f"lower --max-sessions × --session-tokens to {tokens:,} tokens or fewer")
    fixes.append("add volunteers")
    return (f"the model needs {_mib(weights)} of weights{kv_text} but the {count} offer {offered}{what}; "
            + ", or ".join([", ".join(fixes[:-1]), fixes[-1]] if len(fixes) > 2 else fixes))


def _layers_held(memories: list[int], model: ModelSpec) -> int:
    """Layers the volunteers hold together, the largest taking the embedding and the next the output head."""
    extras = [model.head_bytes, model.tail_bytes]
    held = 0
    for memory in sorted(memories, reverse=True):
        extra = extras.pop(0) if extras else 0
        held += max(0, memory - extra) // max(1, model.layer_bytes)
    return held


def _memory_to_cover(nodes: Sequence[NodeCapacity], model: ModelSpec, policy: AssignmentPolicy) -> int:
    """The least --memory (in whole MiB) that, given to every volunteer with less, covers the model."""
    def covers_with(mib: int) -> bool:
        raised = [replace(node, memory_bytes=max(node.memory_bytes, mib << 20)) for node in nodes]
        return covers(raised, model, policy)

    # One node with the whole model's bytes covers it on its own: the search is bounded.
    low, high = 0, -(-model.stage_bytes(0, model.n_layers) // (1 << 20))
    while low + 1 < high:
        middle = (low + high) // 2
        if covers_with(middle):
            high = middle
        else:
            low = middle
    return high << 20


def _kv_to_cover(nodes: Sequence[NodeCapacity], model: ModelSpec, policy: AssignmentPolicy) -> int | None:
    """The most KV tokens a stage can hold with the memory offered and the model covered;
    None when a smaller session budget would not help (no KV, or none fits even without KV)."""
    if model.kv_tokens < 1 or not covers(nodes, model.with_kv_tokens(1), policy):
        return None
    low, high = 1, model.kv_tokens  # covers at `low`, not at `high`
    while low + 1 < high:
        middle = (low + high) // 2
        if covers(nodes, model.with_kv_tokens(middle), policy):
            low = middle
        else:
            high = middle
    return low


def _listing(numbers: Sequence[int], most: int = 8) -> str:
    """`numbers` in words: "2, 5 and 7"; past `most`, the first of them, the last and how many."""
    if len(numbers) == 1:
        return str(numbers[0])
    if len(numbers) > most:
        return f"{', '.join(map(str, numbers[:most - 1]))}, … and {numbers[-1]} ({len(numbers)} in all)"
    return f"{', '.join(map(str, numbers[:-1]))} and {numbers[-1]}"


def _mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB" if size < 2**30 else f"{size / 2**30:,.1f} GiB"


def _flag_size(size: int) -> str:
    """A --memory value of at least `size`: whole MiB, or tenths of a GiB from 1 GiB on."""
    mib = -(-size // (1 << 20))
    return f"{mib}M" if mib < 1024 else f"{-(-mib * 10 // 1024) / 10:g}G"
