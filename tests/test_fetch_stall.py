"""Issue 29: a fetch no holder can stall. A source that sends a byte of its chunk every 20 s (a frame
now and then, never a chunk) against the fetcher, over real links on loopback: with an honest source
beside it the pull ends as fast as the honest one alone makes it (the end game asks the honest one
for what the dribbler holds, and drops the dribbler's answer); alone, it is lost by its delivered rate.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio
import trio.testing
from fetchnet import chunked, peers_node, source_node
from test_fetch_sources import lying_handler

from meshd.fetch.fetcher import FetchConfig, FetchFailed, SourceRef, fetch_chunks
from meshd.net.stream import Stream
from meshd.store.holding import WholeFile
from meshd.store.manifest import Manifest
from meshd.store.sparse import SparseFile
from wire.fetch import FETCH_PROTOCOL, ChunkData, ChunkRequest

# a dribbling source in a process of its own
pytestmark = pytest.mark.slow

# The attack as it was tried: one byte every 20 s, inside the 30 s a silent source had.
DRIBBLE_EVERY = 20.0


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> tuple[Path, Manifest]:
    return chunked(tiny_models["llama-gqa-untied"])


def dribbler(manifest: Manifest, original: bytes, asked: list[int]) -> Callable[[Stream], Awaitable[None]]:
    """A fake source that says it holds every chunk and answers each request one true byte at a time,
    a byte every DRIBBLE_EVERY seconds."""

    async def dribble(stream: Stream, request: ChunkRequest, chunk: bytes) -> None:
        for k in range(len(chunk)):
            await stream.send_message(ChunkData(offset=request.offset + k, data=chunk[k:k + 1]))
            await trio.sleep(DRIBBLE_EVERY)

    return lying_handler(manifest, original, dribble, asked)


async def test_a_source_dribbling_a_byte_every_20_s_does_not_stall_a_pull_beside_an_honest_one(
        model: tuple[Path, Manifest], tmp_path: Path) -> None:
    path, manifest = model
    original = path.read_bytes()
    asked: list[int] = []
    async with (source_node(WholeFile(path, manifest)) as (honest, honest_at, _), peers_node() as slow,
                peers_node() as me):
        slow.handle(FETCH_PROTOCOL, dribbler(manifest, original, asked))
        slow_at = f"127.0.0.1:{await slow.listen('127.0.0.1', 0)}"
        target = SparseFile.open(tmp_path / "mine.gguf", manifest)
        started = trio.current_time()
        # the honest source alone takes well under a second; the dribbler held its chunks for over a minute
        with trio.fail_after(15):
            report = await fetch_chunks(me, [SourceRef(slow_at), SourceRef(honest_at)], target, manifest.chunks)
        took = trio.current_time() - started
        target.close()
    assert asked, "the dribbler was asked for chunks"
    # what it held came from the honest one (the end game); its answers, slow, were dropped
    assert report.by_source == {honest.node_id: sum(c.size for c in manifest.chunks)}
    assert report.excluded == {}
    assert (tmp_path / "mine.gguf").read_bytes() == original
    assert took < DRIBBLE_EVERY / 2


@pytest.fixture
def jump_clock() -> trio.testing.MockClock:
    """Virtual time that jumps once nothing has run for 50 ms of real time: the dribbler's minutes in
    seconds (file writes in worker threads finish well within it)."""
    return trio.testing.MockClock(autojump_threshold=0.05)


async def test_a_source_dribbling_a_byte_every_20_s_is_lost_by_its_delivered_rate(
        model: tuple[Path, Manifest], tmp_path: Path, jump_clock: trio.testing.MockClock) -> None:
    path, manifest = model
    original = path.read_bytes()
    async with peers_node() as slow, peers_node() as me:
        slow.handle(FETCH_PROTOCOL, dribbler(manifest, original, []))
        slow_at = f"127.0.0.1:{await slow.listen('127.0.0.1', 0)}"
        target = SparseFile.open(tmp_path / "mine.gguf", manifest)
        config = FetchConfig()
        started = trio.current_time()
        with trio.fail_after(600), pytest.raises(FetchFailed) as failed:
            await fetch_chunks(me, [SourceRef(slow_at)], target, manifest.chunks[:8], config=config)
        took = trio.current_time() - started
        target.close()
    (why,) = failed.value.report.lost.values()
    assert "did not deliver chunk" in why, why
    # a frame every 20 s kept it forever; now its head chunk's deadline ends it
    largest = max(c.size for c in manifest.chunks[:8])
    assert took <= config.request_timeout + largest / config.min_rate + 1
    assert failed.value.report.fetched_chunks == 0 and target.verified_bytes() == 0
