"""Volunteers that join by model id with no file: each fetches exactly its range's tensors from the
members that hold them, into a sparse file, and serves; the mesh answers like the whole model.

Real `meshd join` daemons on loopback: a seed, one volunteer holding the default GGUF and three that
join with `--model-id` only (64M each, so the tracker splits the model across them).
"""

from __future__ import annotations

import os
import re
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio
from localmesh import Served, mesh_status, run_meshd, start_join, stop_all

from meshd.client.ask import AskRequest
from meshd.client.failover import ask_with_failover
from meshd.client.route import Stage, route_from_reply
from meshd.mesh.models import ModelNotFound, model_info
from meshd.net.identity_store import load_or_create_identity
from meshd.net.peers import Peers
from meshd.net.rpc import mesh_rpc
from meshd.stage.model_file import describe_model
from meshd.store.manifest import Manifest, manifest_for
from meshd.store.ranges import held_layer_ranges, range_chunks
from tests.conftest import greedy_reference
from wire.meshrpc import RouteReply, RouteRequest, StatusReply

PROMPT = "Write a short story about a lighthouse keeper."
TOKENS = 32
SESSIONS = ["--threads", "1", "--max-sessions", "2", "--session-tokens", "512"]
VOLUNTEER = ["--memory", "64M", *SESSIONS]
# What a fetcher may keep on disk: one range of the model (at most some 55 MB at 64M), not two.
BUDGET = 60 << 20
DISK = ["--disk", "60M"]
# Block rounding at the edges of each run of tensors, and the journal's fsyncs: a few percent at most.
SLACK = 0.04
RANGE = re.compile(r"\[(\d+), (\d+)\)")


@dataclass
class Fetcher:
    node: Served
    state_dir: Path
    joined_at: float
    serving_after: float | None = None
    ranges: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class FetchMesh:
    seed: Served
    holder: Served
    fetchers: list[Fetcher]

    @property
    def nodes(self) -> list[Served]:
        return [self.seed, self.holder, *(f.node for f in self.fetchers)]


@pytest.fixture(scope="module")
def manifest(default_model: Path) -> Manifest:
    return manifest_for(default_model)


@pytest.fixture(scope="module")
def expected(default_model: Path) -> list[int]:
    return greedy_reference(default_model, [PROMPT], TOKENS)[PROMPT]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, manifest: Manifest) -> Iterator[FetchMesh]:
    base = tmp_path_factory.mktemp("fetch-mesh")
    # Node keys made beforehand, the holder's the lowest id: alike volunteers are placed in id order, so
    # when the second test regroups the four small ones, the holder takes the head and the fetchers the
    # rest, the middle one's layers new to whoever gets them.
    dirs = sorted((base / f"volunteer{i}" for i in range(4)), key=lambda d: load_or_create_identity(d).node_id)
    started: list[Served] = []
    try:
        seed = start_join("--no-model", "--state-dir", str(base / "seed"))
        started.append(seed)
        holder = start_join("--seed", seed.address, "--state-dir", str(dirs[0]), *VOLUNTEER)
        started.append(holder)
        fetchers = []
        for state in dirs[1:]:
            joined_at = time.monotonic()
            node = start_join("--seed", seed.address, "--state-dir", str(state), "--model-id", manifest.model_id,
                              *VOLUNTEER, *DISK)
            started.append(node)
            fetchers.append(Fetcher(node, state, joined_at))
        yield FetchMesh(seed, holder, fetchers)
    finally:
        stop_all(started)


def test_a_model_is_described_from_its_header_alone_and_a_sparse_copy_of_the_header_says_the_same(
        default_model: Path, manifest: Manifest, tmp_path: Path) -> None:
    whole = describe_model(default_model, manifest.model_id)
    assert (whole.n_layers, whole.bytes_per_layer, whole.kv_bytes_per_token) == (30, 2216448, 768)
    assert whole.head_bytes == whole.tail_bytes - manifest.tensor("output_norm.weight").size  # tied head
    # a file of the original size holding the header only, as a fetcher has it before any tensor
    sparse = tmp_path / "header-only.gguf"
    with open(default_model, "rb") as src, open(sparse, "wb") as dst:
        dst.write(src.read(manifest.header_size))
        dst.truncate(manifest.file_size)
    # the same model, named by the copy's own file name
    assert describe_model(sparse, manifest.model_id) == whole.model_copy(update={"file": "header-only"})
    assert os.stat(sparse).st_blocks * 512 < 2 * manifest.header_size
    metadata = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 8}
    with pytest.raises(ModelNotFound, match="x.gguf lacks the GGUF key llama.attention.head_count"):
        model_info("id", "x.gguf", metadata, {})
    with pytest.raises(ModelNotFound, match="x.gguf is not a usable GGUF model"):
        model_info("id", "x.gguf", {**metadata, "llama.block_count": 0, "llama.attention.head_count": 1}, {})
    with pytest.raises(ModelNotFound, match="header-only.gguf is not a usable GGUF model"):
        sparse.write_bytes(b"GGUF" + bytes(20))
        describe_model(sparse, manifest.model_id)
    # a header that says 2**27 blocks is refused before anything is sized by it (it took a joining
    # volunteer to 1.9 GiB and killed it)
    tracemalloc.start()
    try:
        with pytest.raises(ModelNotFound, match="134217728 layers, at most 4096"):
            model_info("id", "x.gguf", {**metadata, "llama.block_count": 1 << 27, "llama.attention.head_count": 1}, {})
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_held_layer_ranges_are_the_runs_a_range_loader_could_load(manifest: Manifest) -> None:
    n = 30

    def holding(*ranges: tuple[int, int]) -> set[int]:
        return {c.index for r in ranges for c in range_chunks(manifest, n, *r)}

    assert held_layer_ranges(manifest, n, holding((0, 30)).__contains__) == [(0, 30)]
    assert held_layer_ranges(manifest, n, holding((10, 20)).__contains__) == [(10, 20)]
    assert held_layer_ranges(manifest, n, holding((0, 10), (20, 30)).__contains__) == [(0, 10), (20, 30)]
    # adjacent fetched ranges join into one
    assert held_layer_ranges(manifest, n, holding((0, 10), (10, 20)).__contains__) == [(0, 20)]
    # layer 0's blocks without the token embedding: [1, 10) is all a loader could use
    no_head = holding((0, 10)) - {c.index for c in manifest.chunks_of(["token_embd.weight"])}
    assert held_layer_ranges(manifest, n, no_head.__contains__) == [(1, 10)]
    # one chunk of a block missing splits the run; without the header nothing is held
    blk15 = {c.index for c in manifest.chunks_of([t for t in manifest.tensor_names if t.startswith("blk.15.")][:1])}
    assert held_layer_ranges(manifest, n, (holding((10, 20)) - blk15).__contains__) == [(10, 15), (16, 20)]
    header = {c.index for c in manifest.header_chunks_list()}
    assert held_layer_ranges(manifest, n, (holding((10, 20)) - header).__contains__) == []


def served(view: StatusReply) -> dict[str, list[tuple[int, int]]]:
    """Per live member, the ranges it serves (as the status view names them)."""
    out = {}
    for m in view.members:
        if m.state == "alive":
            out[m.node_id] = [(int(a), int(b)) for s in m.served for a, b in RANGE.findall(s)]
    return out


def workers(node: Served) -> list[int]:
    """The engine workers a daemon runs now: one per range it serves or still retires."""
    tasks = Path(f"/proc/{node.proc.pid}/task").iterdir()
    return sorted(int(pid) for task in tasks for pid in (task / "children").read_text().split())


def sparse_path(fetcher: Fetcher, manifest: Manifest) -> Path:
    return fetcher.state_dir / "models" / f"{manifest.model_id}.gguf"


def owned_bytes(manifest: Manifest, start: int, end: int) -> int:
    """The header and every tensor the range [start, end) loads: all it should fetch and keep."""
    return manifest.bytes_of(range_chunks(manifest, 30, start, end))


async def wait_serving(peers: Peers, mesh: FetchMesh, timeout: float = 240.0) -> dict[str, list[tuple[int, int]]]:
    """Until every volunteer serves a range and the model is covered; notes when each fetcher began to serve."""
    with trio.fail_after(timeout):
        while True:
            # a daemon that exited never serves: say so now, not after the timeout
            exited = [n.node_id[:12] for n in mesh.nodes if n.proc.poll() is not None]
            assert not exited, f"daemons exited: {exited}"
            view = await mesh_status(peers, mesh.seed)
            now = time.monotonic()
            ranges = served(view)
            for f in mesh.fetchers:
                if ranges.get(f.node.node_id) and f.serving_after is None:
                    f.serving_after = now - f.joined_at
            volunteers = [mesh.holder, *(f.node for f in mesh.fetchers)]
            if all(ranges.get(v.node_id) for v in volunteers) and view.coverage and \
                    view.coverage[0].covered_layers == view.coverage[0].n_layers:
                return ranges
            await trio.sleep(0.5)


def finder(peers: Peers, via: Served):
    async def find(excluded: list[str]) -> list[Stage]:
        reply = await mesh_rpc(peers, via.address, RouteRequest(exclude=excluded), timeout=20.0)
        assert isinstance(reply, RouteReply)
        return route_from_reply(reply)
    return find


@pytest.mark.slow
async def test_volunteers_that_join_by_model_id_fetch_only_their_ranges_and_answer_like_the_whole_model(
        mesh: FetchMesh, peers: Peers, manifest: Manifest, expected: list[int]) -> None:
    ranges = await wait_serving(peers, mesh)
    print()
    for f in mesh.fetchers:
        (rng,) = ranges[f.node.node_id]
        f.ranges = [rng]
        view = await mesh_status(peers, f.node)
        fetched = sum(x.fetched_bytes for x in view.fetches)
        owned = owned_bytes(manifest, *rng)
        allocated = os.stat(sparse_path(f, manifest)).st_blocks * 512
        print(f"fetcher {f.node.node_id[:12]} layers [{rng[0]}, {rng[1]}): owned {owned} B, fetched {fetched} B, "
              f"allocated {allocated} B of a {manifest.file_size} B file; serving {f.serving_after:.1f} s after join")
        assert all(x.state == "done" for x in view.fetches), view.fetches
        # exactly the range's chunks went over the network, once each
        assert fetched == owned
        assert owned * (1 - SLACK) <= allocated <= owned * (1 + SLACK)
        assert owned < manifest.file_size
    assert {r for f in mesh.fetchers for r in f.ranges} != {(0, 30)}
    result = await ask_with_failover(peers, finder(peers, mesh.seed), AskRequest(
        messages=[{"role": "user", "content": PROMPT}], max_tokens=TOKENS))
    assert result.tokens == expected
    route_nodes = {s.node_id for s in await finder(peers, mesh.seed)([])}
    assert route_nodes & {f.node.node_id for f in mesh.fetchers}, "no fetched range is on the route"
    shown = run_meshd("models", "--seed", mesh.seed.address)
    assert shown.returncode == 0, shown.stderr
    assert manifest.model_id in shown.stdout and "30 layers: 30 held on disk" in shown.stdout
    assert mesh.holder.node_id[:12] + " [0, 30)" in shown.stdout


@pytest.mark.slow
async def test_a_reassigned_fetcher_fetches_only_the_new_tensors_and_drops_the_old_under_its_disk_budget(
        mesh: FetchMesh, peers: Peers, manifest: Manifest, expected: list[int], default_model: Path,
        tmp_path: Path) -> None:
    """A volunteer holding the whole model with memory for all of it joins: the tracker's fresh placement
    gives it [0, 30) and regroups the four small ones as one more copy, which moves fetchers to new
    ranges (as in test_mesh_daemons' rebalance)."""
    before = await wait_serving(peers, mesh)
    # in a thread: the links of `peers` keep answering while the process starts
    big = await trio.to_thread.run_sync(lambda: start_join(
        "--seed", mesh.seed.address, "--state-dir", str(tmp_path / "big"), "--memory", "400M",
        "--model", str(default_model), *SESSIONS))
    try:
        # settled: the big one serves the whole model, every fetcher one range with one engine worker (the
        # old range retired) and no fetch running, the seed sees what each says of itself, for 3 s on end
        quiet, previous = 0, None
        with trio.fail_after(240):
            while quiet < 6:
                await trio.sleep(0.5)
                now = served(await mesh_status(peers, mesh.seed))
                views = {f.node.node_id: await mesh_status(peers, f.node) for f in mesh.fetchers}
                calm = now.get(big.node_id) == [(0, 30)] and all(
                    len(workers(f.node)) == 1 and now.get(n) == served(views[n]).get(n) and len(now[n]) == 1
                    and all(x.state == "done" for x in views[n].fetches)
                    for n, f in ((f.node.node_id, f) for f in mesh.fetchers))
                quiet = quiet + 1 if calm and now == previous else 0
                previous = now
        moved = {f.node.node_id: (before[f.node.node_id][0], now[f.node.node_id][0])
                 for f in mesh.fetchers if now[f.node.node_id] != before[f.node.node_id]}
        for n, (_, new) in moved.items():
            # a moved fetcher's last fetch is of its new range
            assert (views[n].fetches[-1].start, views[n].fetches[-1].end) == new
        print()
        fetched_new: list[int] = []
        for node_id, (old, new) in moved.items():
            f = next(f for f in mesh.fetchers if f.node.node_id == node_id)
            last = views[node_id].fetches[-1]
            had = {c.index for c in range_chunks(manifest, 30, *old)}
            difference = manifest.bytes_of(c for c in range_chunks(manifest, 30, *new) if c.index not in had)
            print(f"fetcher {node_id[:12]} moved [{old[0]}, {old[1]}) -> [{new[0]}, {new[1]}): fetched {last.fetched_bytes} B, "
                  f"new tensors {difference} B")
            assert last.fetched_bytes == difference
            fetched_new.append(difference)
            # once the old range retired, and only if old and new together overflow --disk 60M, what the
            # new one does not read is punched out; the new range stays whole
            owned = owned_bytes(manifest, *new)
            limit = owned if manifest.bytes_of(range_chunks(manifest, 30, *old)) + difference > BUDGET else BUDGET
            with trio.fail_after(60):
                while os.stat(sparse_path(f, manifest)).st_blocks * 512 > limit * (1 + SLACK):
                    await trio.sleep(0.5)
            allocated = os.stat(sparse_path(f, manifest)).st_blocks * 512
            print(f"  its sparse file allocates {allocated} B once the old range retired (the new one owns {owned} B)")
            assert allocated >= owned * (1 - SLACK)
        assert any(fetched_new), f"no fetcher moved to layers it lacked: {moved}"
        result = await ask_with_failover(peers, finder(peers, mesh.seed), AskRequest(
            messages=[{"role": "user", "content": PROMPT}], max_tokens=TOKENS))
        assert result.tokens == expected
    finally:
        big.stop()
