"""Issue 29: a holder no fetcher can shut or drain. Attacks on the serving side of `meshd/fetch/1`,
over real links on loopback: streams that ask and never read, identities made by the dozen on one
host, peers that pull as fast as they can. The source under attack is the daemon's own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import trio
import trio.testing
from fetchnet import CALM, peers_node, source_node

from meshd.daemon import MeshDaemon
from meshd.daemon.config import NodeConfig
from meshd.fetch.fetcher import SourceRef, fetch_chunks
from meshd.fetch.source import ChunkSource, SourceConfig
from meshd.net import rpc
from meshd.net.peers import Peers
from meshd.store.holding import WholeFile
from meshd.store.manifest import Manifest, compute
from meshd.store.sparse import SparseFile
from wire.fetch import FETCH_PROTOCOL, ChunkData, ChunkRequest
from wire.identity import NodeIdentity
from wire.mux_config import MuxConfig

SMALL_CHUNK = 4 << 10
# The attackers' own host (all of 127/8 is loopback): the source tells them from the honest puller by it.
ATTACKER_HOST = "127.0.0.2"
# An attacker grants its streams one small window: a 4 KiB chunk's frame does not fit, so the
# source's send blocks for as long as the attacker does not read.
NEVER_READ = replace(CALM, dial_from=ATTACKER_HOST, mux=MuxConfig(stream_window=1024))


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> tuple[Path, Manifest]:
    path = tiny_models["llama-gqa-untied"]
    return path, compute(path, SMALL_CHUNK)


@pytest.fixture
def jump_clock() -> trio.testing.MockClock:
    """Virtual time that jumps once nothing has run for 50 ms of real time (file reads in worker
    threads finish well within it, so no deadline is jumped to while honest work is under way)."""
    return trio.testing.MockClock(autojump_threshold=0.05)


def daemon_source(upload: SourceConfig | None = None) -> ChunkSource:
    """The `ChunkSource` a daemon serves its chunks with (a daemon that is never run: only its source
    is used here), of the daemon's defaults or of `upload` given in its config."""
    config = NodeConfig() if upload is None else NodeConfig(upload=upload)
    return MeshDaemon(NodeIdentity.generate(), config).source


@asynccontextmanager
async def never_reading(at: str, source: ChunkSource, manifest: Manifest, identities: int,
                        streams: int) -> AsyncIterator[None]:
    """`identities` peers on the attackers' host, each opening `streams` fetch streams that ask for a
    chunk and never read (never a byte: reading would grant the source the credit to go on); yields once
    `source` has taken or refused every one of them."""
    async with AsyncExitStack() as stack:
        chunk = manifest.chunks[1]
        for _ in range(identities):
            peers: Peers = await stack.enter_async_context(peers_node(NEVER_READ))
            for _ in range(streams):
                stream = await peers.open_stream(at, FETCH_PROTOCOL)
                await stream.send_message(ChunkRequest(model=manifest.model_id, offset=chunk.offset, size=chunk.size))
        with trio.fail_after(10):
            while source.streams + sum(u.refused for u in source.uploaded().values()) < identities * streams:
                await trio.sleep(0.01)
        yield


async def test_16_never_read_streams_from_4_identities_on_one_host_leave_an_honest_pull_its_slot(
        model: tuple[Path, Manifest], tmp_path: Path) -> None:
    path, manifest = model
    source = daemon_source()
    async with source_node(WholeFile(path, manifest), source=source) as (_, at, _), peers_node() as me:
        with trio.fail_after(15):
            async with never_reading(at, source, manifest, identities=4, streams=4):
                target = SparseFile.open(tmp_path / "mine.gguf", manifest)
                report = await fetch_chunks(me, [SourceRef(at)], target, manifest.chunks)
                target.close()
                # one host got its share of the slots, whatever identities it made
                assert source.streams == SourceConfig().max_streams_per_address
    assert report.fetched_chunks == len(manifest.chunks) and report.lost == {}
    assert (tmp_path / "mine.gguf").read_bytes() == path.read_bytes()


async def test_a_stream_that_asks_and_never_reads_is_ended_after_the_send_timeout(
        model: tuple[Path, Manifest], jump_clock: trio.testing.MockClock) -> None:
    path, manifest = model
    source = daemon_source()
    async with source_node(WholeFile(path, manifest), source=source) as (_, at, _):
        async with never_reading(at, source, manifest, identities=1, streams=1):
            assert source.streams == 1
            started = trio.current_time()
            with trio.fail_after(600):
                while source.streams:
                    await trio.sleep(2)
            # the send blocked since the request came (just before `started`), looked at every 2 s
            assert trio.current_time() - started <= SourceConfig().send_timeout + 2


async def greedy(at: str, manifest: Manifest, identities: int, seconds: float) -> list[int]:
    """`identities` peers each asking for chunk after chunk (every chunk of the model, round and round)
    for `seconds`: the bytes each was sent."""
    got = [0] * identities

    async def pull(i: int) -> None:
        async with peers_node() as peers:
            stream = await peers.open_stream(at, FETCH_PROTOCOL)
            with trio.move_on_after(seconds):
                while True:
                    for chunk in manifest.chunks:
                        request = ChunkRequest(model=manifest.model_id, offset=chunk.offset, size=chunk.size)
                        await stream.send_message(request)
                        done = 0
                        while done < chunk.size:
                            frame = await rpc.receive(stream, ChunkData, "chunk")
                            done += len(frame.data)
                        got[i] += chunk.size

    async with trio.open_nursery() as nursery:
        for i in range(identities):
            nursery.start_soon(pull, i)
    return got


async def test_the_daemon_budgets_what_one_peer_may_take(model: tuple[Path, Manifest]) -> None:
    path, manifest = model
    # the daemon's defaults budget every peer and all together (one reading peer took about 1 GiB
    # from a holder in 8 s when they did not)
    assert daemon_source().config == SourceConfig()
    assert SourceConfig().upload_rate is not None and SourceConfig().total_upload_rate is not None
    # and a daemon takes its budget from its config: here a small one, that a second's pull outruns
    upload = SourceConfig(upload_rate=float(128 << 10), upload_burst=32 << 10)
    async with source_node(WholeFile(path, manifest), source=daemon_source(upload)) as (_, at, _):
        seconds = 1.5
        (got,) = await greedy(at, manifest, identities=1, seconds=seconds)
    largest = max(c.size for c in manifest.chunks)
    assert got <= upload.upload_burst + upload.upload_rate * seconds + largest, got
    # and the budget is not a stall: once the burst is spent the bucket refills and the peer is sent more than
    # a chunk beyond it. Not "about what it may" (half the rate's 1.5 s): how much of its 1.5 s a pull spends
    # moving bytes depends on the box's load, while a bucket that never refilled stops at the burst and a chunk
    assert got > upload.upload_burst + largest, got


async def test_sybils_share_the_total_upload_budget(model: tuple[Path, Manifest]) -> None:
    path, manifest = model
    upload = SourceConfig(upload_rate=float(1 << 20), upload_burst=64 << 10,
                          total_upload_rate=float(128 << 10), total_upload_burst=32 << 10)
    async with source_node(WholeFile(path, manifest), source=daemon_source(upload)) as (_, at, _):
        seconds = 1.5
        got = await greedy(at, manifest, identities=4, seconds=seconds)
    assert upload.total_upload_rate is not None
    largest = max(c.size for c in manifest.chunks)
    # each peer's budget alone would let them take 4 x 1.5 MiB; all of them together take the total's
    assert sum(got) <= upload.total_upload_burst + upload.total_upload_rate * seconds + 4 * largest, got
