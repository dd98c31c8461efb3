"""A model bigger than any volunteer, from a hub (issue 29, part 3): a random-weight llama laid out as Q4_K_M
(tools/make_big_gguf.py, at a size a CI run affords) as a 3-part gguf-split set on a local hub server
(tools/fake_hub.py), joined by three real ``meshd join --model hf:...`` daemons whose ``--memory`` cannot
hold it whole.

The mesh answers the whole model's greedy tokens (the set run in this process), and each volunteer keeps
what it owns and no more: its sparse files' allocated blocks are its range's chunks; its engine worker's
resident pages of the model are its range's tensors (never a hole), and the rest of its RSS the engine's
own, whatever the range. From the hub, the first volunteer read the set once (to build the manifest) and
its range; the others, the headers and their own tensors. tools/bench_hub.py does the same at a 3B-class
size.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from fake_hub import FakeHub
from localmesh import Served, mesh_status, start_join, stop_all
from make_big_gguf import Dims, write
from test_fetch_mesh import finder, served, workers

from meshd.client.ask import AskRequest
from meshd.client.failover import ask_with_failover
from meshd.net.peers import Peers
from meshd.store.manifest import Chunk, Manifest, manifest_for
from meshd.store.ranges import range_chunks
from meshd.store.split import part_paths
from tests.conftest import greedy_reference

# About 130 MB: a 49,152-token Q6_K embedding (tied: the head's and the tail's) and twelve blocks of 7.5 MB.
DIMS = Dims(n_embd=1024, n_ff=2816, n_head=8, n_head_kv=4, head_dim=128, n_layers=12)
REPO = "org/capped"
# Each volunteer's offer: about 60% of the model, so none holds it and three do.
MEMORY = "80M"
# Two sessions: the tracker's probe of a newly placed stage takes one for a moment, and an ask that found a
# stage's only slot taken so would route around it.
SESSIONS = ["--threads", "1", "--max-sessions", "2", "--session-tokens", "128"]
PROMPT = "What is the capital of France?"
TOKENS = 8
# What an engine worker holds besides the model's pages: the interpreter, llama.cpp, its compute and KV buffers
# (about 60 MiB anonymous and 40 MiB of libraries here, whatever the range).
WORKER_BASE = 128 << 20


@pytest.fixture(scope="module")
def model_set(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write(tmp_path_factory.mktemp("capped"), 3, DIMS, quiet=True)


@dataclass(frozen=True)
class Held:
    """What a volunteer held once it answered: its range and that range's chunks, its sparse files' blocks on
    disk, its worker's resident bytes of the model and of everything else, and the bytes it read from the hub."""

    layers: tuple[int, int]
    chunks: list[Chunk]
    disk: int
    model_rss: int
    other_rss: int
    read: int

    def blocks(self, manifest: Manifest) -> int:
        """The bytes of its layers' own tensors (blk.N.*): every one read by every token."""
        return manifest.bytes_of(c for c in self.chunks if c.tensor is not None and c.tensor.startswith("blk."))


def resident(pid: int, files: set[str]) -> tuple[int, int]:
    """A process's resident bytes of ``files``' mappings (the model's parts, as llama.cpp maps them), and of
    everything else (the interpreter, the libraries, the engine's buffers)."""
    of_files = rest = 0
    mapped = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:
            mapped = fields[5] if len(fields) > 5 else ""
        elif fields and fields[0] == "Rss:":
            if mapped in files:
                of_files += int(fields[1]) << 10
            else:
                rest += int(fields[1]) << 10
    return of_files, rest


def allocated(sparse: Path, manifest: Manifest) -> int:
    """The blocks a volunteer's sparse copy of the set takes on disk, every part."""
    return sum(os.stat(p).st_blocks * 512 for p in part_paths(sparse, len(manifest.parts)))


@pytest.fixture
def hub(model_set: list[Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with FakeHub() as server:
        server.publish(REPO, {p.name: p for p in model_set})
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        yield server


@pytest.mark.slow  # three daemons and the whole model once in this process
async def test_three_capped_volunteers_hold_a_hub_model_none_can_whole_and_answer_like_it(
        model_set: list[Path], hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peers: Peers) -> None:
    manifest = manifest_for(model_set[0])
    n_layers = DIMS.n_layers
    assert manifest.total_size > int(MEMORY[:-1]) << 20, "a volunteer could hold the model whole"
    expected = greedy_reference(model_set[0], [PROMPT], TOKENS)[PROMPT]
    nodes: list[Served] = []
    try:
        for i in range(3):
            monkeypatch.setenv("HF_TOKEN", f"volunteer{i}")
            seed = ["--seed", nodes[0].address] if nodes else []
            nodes.append(start_join(*seed, "--state-dir", str(tmp_path / f"v{i}"), "--model", f"hf:{REPO}",
                                    "--memory", MEMORY, *SESSIONS))
            if i == 0:
                # the first builds the manifest (one read of the set) before the others look for a member's
                # (a node that finds none within a few seconds reads the set itself)
                with trio.fail_after(60):
                    while not (await mesh_status(peers, nodes[0])).coverage:
                        await trio.sleep(0.2)
        with trio.fail_after(120):
            while True:
                assert not [n for n in nodes if n.proc.poll() is not None], "a daemon exited"
                view = await mesh_status(peers, nodes[0])
                ranges = served(view)
                if all(ranges.get(n.node_id) for n in nodes) and view.coverage and \
                        view.coverage[0].covered_layers == n_layers:
                    break
                await trio.sleep(0.5)
        assert view.coverage[0].model == manifest.model_id
        result = await ask_with_failover(peers, finder(peers, nodes[0]), AskRequest(
            messages=[{"role": "user", "content": PROMPT}], max_tokens=TOKENS))
        assert result.tokens == expected
        rows = []
        for i, node in enumerate(nodes):
            (rng,) = ranges[node.node_id]
            sparse = tmp_path / f"v{i}" / "models" / f"{manifest.model_id}.gguf"
            (worker,) = workers(node)
            files = {str(p) for p in part_paths(sparse, len(manifest.parts))}
            rows.append(Held(rng, range_chunks(manifest, n_layers, *rng), allocated(sparse, manifest),
                             *resident(worker, files), hub.bytes_read(f"volunteer{i}")))
    finally:
        stop_all(nodes)
    print(f"\n{manifest.total_size} B set, --memory {MEMORY} each")
    for i, held in enumerate(rows):
        print(f"volunteer {i} layers [{held.layers[0]}, {held.layers[1]}): owns {manifest.bytes_of(held.chunks)} B "
              f"({held.blocks(manifest)} B of its blocks), {held.disk} B on disk, {held.model_rss} B of the model "
              f"resident and {held.other_rss} B else, {held.read} B read from the hub")
    headers = sum(p.header_size for p in manifest.parts)
    for i, held in enumerate(rows):
        assert held.layers != (0, n_layers)
        owned = manifest.bytes_of(held.chunks)
        # on disk: its chunks, each rounded up to the filesystem's blocks, and nothing else
        assert owned <= held.disk <= owned + len(held.chunks) * 4096, (owned, held.disk)
        # in memory: of the model, what it owns and no hole (the ask read every block's weights; of the tied
        # embedding, the head reads only the prompt's rows), besides it what the engine holds whatever its range
        assert held.blocks(manifest) <= held.model_rss <= owned, (held.blocks(manifest), held.model_rss, owned)
        assert held.other_rss <= WORKER_BASE, held.other_rss
        tensors = manifest.bytes_of(c for c in held.chunks if c.tensor is not None)
        if i == 0:
            # the first holder read the set once to build the manifest (checked against each part's sha256)
            assert held.read >= manifest.total_size + tensors
        else:
            # the others: their own tensors and the headers (checked against the manifest, then fetched), and
            # the alignment between two of its tensors a run of them reads past (under 32 bytes each)
            assert tensors + headers <= held.read <= tensors + 2 * headers + 32 * len(held.chunks), \
                (tensors, held.read)
    # the three hold the model between them (the head's and the tail's tied embedding twice)
    assert sum(manifest.bytes_of(held.chunks) for held in rows) >= manifest.total_size
