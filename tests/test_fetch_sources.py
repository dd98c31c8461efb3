"""Fetching over real links on loopback: several sources, partial sources, liars, the source's own bounds."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio
from fetchnet import SMALL_CHUNK, chunked, peers_node, source_node

from meshd.fetch.fetcher import FetchConfig, FetchFailed, SourceRef, fetch_chunks, fetch_manifest, fetch_range
from meshd.fetch.source import ChunkSource, SourceConfig, UploadBucket, activity, register
from meshd.net import rpc
from meshd.net.stream import Stream
from meshd.store.holding import WholeFile
from meshd.store.manifest import Chunk, Manifest, compute
from meshd.store.ranges import range_chunks
from meshd.store.sparse import SparseFile
from wire.errors import ErrorCode, ProtocolError
from wire.fetch import FETCH_PROTOCOL, FRAME_BYTES, ChunkData, ChunkRequest, Have, HaveRequest, ManifestPiece, ManifestRequest
from wire.message import ErrorMessage, encode

N_LAYERS = 6


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> tuple[Path, Manifest]:
    return chunked(tiny_models["llama-gqa-untied"])


def assert_holds_exactly(path: Path, original: Path, chunks: list[Chunk]) -> None:
    got, want = path.read_bytes(), original.read_bytes()
    for c in chunks:
        assert got[c.offset : c.end] == want[c.offset : c.end], f"chunk {c.index} differs"


async def test_a_range_comes_from_two_sources_and_a_partial_one_serves_only_what_it_verified(
    model: tuple[Path, Manifest], tmp_path: Path
) -> None:
    path, manifest = model
    # A partial source: a sparse copy holding blocks 0-2 only.
    partial = SparseFile.open(tmp_path / "partial.gguf", manifest)
    data = path.read_bytes()
    for c in range_chunks(manifest, N_LAYERS, 0, 3):
        partial.write(c, data[c.offset : c.end])
    async with (source_node(WholeFile(path, manifest)) as (whole, whole_at, _),
                source_node(partial) as (part, partial_at, partial_src), peers_node() as me):
        with trio.fail_after(30):
            got = await fetch_manifest(me, [SourceRef(partial_at)], manifest.model_id)
            assert got == manifest
            out = tmp_path / "mine.gguf"
            report = await fetch_range(me, [SourceRef(whole_at), SourceRef(partial_at)], got, out, (1, 4))
    wanted = range_chunks(manifest, N_LAYERS, 1, 4)
    assert report.fetched_chunks == len(wanted) and report.excluded == {}
    assert set(report.by_source) == {whole.node_id, part.node_id}
    assert_holds_exactly(out, path, wanted)
    # What the partial source lacks it was never asked for: its uploads are all within blocks 0-2.
    held = {c.index for c in range_chunks(manifest, N_LAYERS, 0, 3)}
    sent = sum(u.chunks for u in partial_src.uploaded().values())
    assert 0 < sent <= len([c for c in wanted if c.index in held])
    partial.close()


Attack = Callable[[Stream, ChunkRequest, bytes], Awaitable[None]]


async def bad_hash(stream: Stream, req: ChunkRequest, data: bytes) -> None:
    await stream.send_message(ChunkData(offset=req.offset, data=bytes([data[0] ^ 0xFF]) + data[1:]))


async def oversize_frame(stream: Stream, req: ChunkRequest, data: bytes) -> None:
    # A frame past the protocol's frame bound, hand-encoded: the decoder must refuse it.
    await stream.send_all(encode({"type": "chunk_data", "v": 1, "offset": req.offset, "data": b"\0" * (FRAME_BYTES + 1)}))


async def wrong_offset(stream: Stream, req: ChunkRequest, data: bytes) -> None:
    await stream.send_message(ChunkData(offset=req.offset + 1, data=data))


async def too_many_bytes(stream: Stream, req: ChunkRequest, data: bytes) -> None:
    await stream.send_message(ChunkData(offset=req.offset, data=data + b"\0"))


async def wrong_type(stream: Stream, req: ChunkRequest, data: bytes) -> None:
    await stream.send_message(HaveRequest(model="x"))


def lying_handler(manifest: Manifest, original: bytes, attack: Attack, asked: list[int]) -> Callable[[Stream], Awaitable[None]]:
    """A fake source that answers have-requests honestly and every chunk request with ``attack``."""

    async def serve(stream: Stream) -> None:
        async for message in stream.messages():
            if isinstance(message, HaveRequest):
                full = bytes([0xFF]) * (-(-len(manifest.chunks) // 8))
                await stream.send_message(Have(model=message.model, chunks=len(manifest.chunks), bitmap=full))
            elif isinstance(message, ChunkRequest):
                asked.append(message.offset)
                await attack(stream, message, original[message.offset : message.offset + message.size])

    return serve


@pytest.mark.parametrize("attack", [bad_hash, oversize_frame, wrong_offset, too_many_bytes, wrong_type])
async def test_a_lying_source_is_excluded_and_the_file_is_still_right(
    model: tuple[Path, Manifest], tmp_path: Path, attack: Attack
) -> None:
    path, manifest = model
    original = path.read_bytes()
    asked: list[int] = []
    async with (source_node(WholeFile(path, manifest)) as (_, honest_at, _), peers_node() as liar,
                peers_node() as me):
        liar.handle(FETCH_PROTOCOL, lying_handler(manifest, original, attack, asked))
        liar_at = f"127.0.0.1:{await liar.listen('127.0.0.1', 0)}"
        target = SparseFile.open(tmp_path / "mine.gguf", manifest)
        with trio.fail_after(30):
            report = await fetch_chunks(me, [SourceRef(liar_at), SourceRef(honest_at)], target, manifest.chunks)
        target.close()
    assert asked, "the liar was asked for something"
    assert list(report.excluded) == [liar.node_id]
    assert liar.node_id not in report.by_source
    assert report.fetched_chunks == len(manifest.chunks)
    assert (tmp_path / "mine.gguf").read_bytes() == original


async def test_with_only_liars_the_fetch_fails_saying_why(model: tuple[Path, Manifest], tmp_path: Path) -> None:
    path, manifest = model
    async with peers_node() as liar, peers_node() as me:
        liar.handle(FETCH_PROTOCOL, lying_handler(manifest, path.read_bytes(), bad_hash, []))
        liar_at = f"127.0.0.1:{await liar.listen('127.0.0.1', 0)}"
        target = SparseFile.open(tmp_path / "mine.gguf", manifest)
        with trio.fail_after(30), pytest.raises(FetchFailed, match="excluded") as failed:
            await fetch_chunks(me, [SourceRef(liar_at)], target, manifest.chunks[:5])
        target.close()
    assert failed.value.report.fetched_chunks == 0
    assert target.verified_bytes() == 0
    # The liar's bytes were written as they came, then punched out once they failed their hash.
    assert os.stat(tmp_path / "mine.gguf").st_blocks == 0


async def test_a_manifest_that_does_not_hash_to_the_id_is_refused(
    model: tuple[Path, Manifest], tiny_models: dict[str, Path]
) -> None:
    path, manifest = model
    other = compute(tiny_models["qwen2-bias"], SMALL_CHUNK)
    async with source_node(WholeFile(tiny_models["qwen2-bias"], other)) as (peers, at, source), peers_node() as me:
        # The source serves the other model's manifest under this model's id: refused.
        source._holdings[manifest.model_id] = source._holdings[other.model_id]
        with trio.fail_after(30), pytest.raises(ProtocolError, match="does not hash") as refused:
            await fetch_manifest(me, [SourceRef(at)], manifest.model_id)
        assert refused.value.code is ErrorCode.NOT_FOUND


async def test_the_source_answers_only_exact_chunks_it_holds(model: tuple[Path, Manifest], tmp_path: Path) -> None:
    path, manifest = model
    partial = SparseFile.open(tmp_path / "p.gguf", manifest)
    held = manifest.chunks[1]
    partial.write(held, path.read_bytes()[held.offset : held.end])
    async with source_node(partial) as (_, at, _), peers_node() as me:
        with trio.fail_after(30):
            stream = await me.open_stream(at, FETCH_PROTOCOL)
            async with stream:
                cases = [
                    (ChunkRequest(model=manifest.model_id, offset=held.offset + 1, size=held.size), ErrorCode.BAD_REQUEST),
                    (ChunkRequest(model=manifest.model_id, offset=held.offset, size=held.size + 1), ErrorCode.BAD_REQUEST),
                    (ChunkRequest(model=manifest.model_id, offset=manifest.chunks[2].offset,
                                  size=manifest.chunks[2].size), ErrorCode.NOT_FOUND),
                    (ChunkRequest(model="ab" * 32, offset=held.offset, size=held.size), ErrorCode.NOT_FOUND),
                ]
                # One stream throughout: a refused request does not end it.
                for req, code in cases:
                    with pytest.raises(ProtocolError) as refused:
                        await rpc.request(stream, req, ChunkData, "chunk")
                    assert refused.value.code is code
                reply = await rpc.request(stream, ChunkRequest(model=manifest.model_id, offset=held.offset,
                                                               size=held.size), ChunkData, "chunk")
                assert reply.data == path.read_bytes()[held.offset : held.end]
    partial.close()


async def test_streams_past_the_per_peer_bound_are_refused_overloaded(model: tuple[Path, Manifest]) -> None:
    path, manifest = model
    config = SourceConfig(max_streams=8, max_streams_per_peer=2)
    async with source_node(WholeFile(path, manifest), config) as (_, at, source), peers_node() as me:
        with trio.fail_after(30):
            held = [await me.open_stream(at, FETCH_PROTOCOL) for _ in range(2)]
            for s in held:
                await rpc.request(s, HaveRequest(model=manifest.model_id), Have, "have")
            third = await me.open_stream(at, FETCH_PROTOCOL)
            reply = await third.receive_message()
            assert isinstance(reply, ErrorMessage) and reply.code is ErrorCode.OVERLOADED
            assert source.streams == 2
            for s in held:
                await s.aclose()
            await third.aclose()


async def test_an_idle_stream_is_ended_by_the_source(model: tuple[Path, Manifest]) -> None:
    path, manifest = model
    async with source_node(WholeFile(path, manifest), SourceConfig(idle_timeout=0.2)) as (_, at, source), \
            peers_node() as me:
        with trio.fail_after(30):
            stream = await me.open_stream(at, FETCH_PROTOCOL)
            await rpc.request(stream, HaveRequest(model=manifest.model_id), Have, "have")
            with pytest.raises(trio.EndOfChannel):
                await stream.receive_message()
            await stream.aclose()
            assert source.streams == 0


async def test_the_upload_bucket_makes_a_peer_wait_past_its_burst(autojump_clock: trio.abc.Clock) -> None:
    bucket = UploadBucket(rate=1 << 20, burst=1 << 20)
    start = trio.current_time()
    await bucket.take(1 << 20)  # the burst: no wait
    assert trio.current_time() == start
    await bucket.take(4 << 20)  # four more seconds' worth
    assert trio.current_time() - start == pytest.approx(4.0)
    await trio.sleep(10)  # it refills only up to the burst
    before = trio.current_time()
    await bucket.take(2 << 20)
    assert trio.current_time() - before == pytest.approx(1.0)


async def test_a_rate_limited_source_still_delivers_everything(model: tuple[Path, Manifest], tmp_path: Path) -> None:
    path, manifest = model
    config = SourceConfig(upload_rate=float(4 << 20), upload_burst=1 << 16)
    async with source_node(WholeFile(path, manifest), config) as (_, at, _), peers_node() as me:
        target = SparseFile.open(tmp_path / "mine.gguf", manifest)
        with trio.fail_after(30):
            report = await fetch_chunks(me, [SourceRef(at)], target, manifest.chunks, config=FetchConfig(in_flight_per_source=2))
        target.close()
    assert report.fetched_bytes == sum(c.size for c in manifest.chunks)
    assert (tmp_path / "mine.gguf").read_bytes() == path.read_bytes()


async def test_activity_is_busy_while_the_counter_moved_within_the_window(autojump_clock: trio.abc.Clock) -> None:
    calls = [0]
    busy = activity(lambda: calls[0], window=1.0)
    assert not busy()
    calls[0] += 1
    assert busy()
    await trio.sleep(0.9)
    assert busy()
    await trio.sleep(0.2)
    assert not busy()


async def test_a_busy_source_trickles_and_the_fetch_leans_on_the_idle_one(
    model: tuple[Path, Manifest], tmp_path: Path
) -> None:
    path, manifest = model
    busy = ChunkSource(SourceConfig(busy_upload_rate=float(16 << 10)), busy=lambda: True)
    async with (source_node(WholeFile(path, manifest)) as (idle_peers, idle_at, _),
                source_node(WholeFile(path, manifest), source=busy) as (busy_peers, busy_at, _),
                peers_node() as me):
        target = SparseFile.open(tmp_path / "mine.gguf", manifest)
        with trio.fail_after(60):
            report = await fetch_chunks(me, [SourceRef(busy_at), SourceRef(idle_at)], target, manifest.chunks)
        target.close()
    assert (tmp_path / "mine.gguf").read_bytes() == path.read_bytes()
    assert report.by_source[idle_peers.node_id] > 4 * report.by_source.get(busy_peers.node_id, 0)


async def test_what_a_volunteer_fetched_it_serves_to_the_next(model: tuple[Path, Manifest], tmp_path: Path) -> None:
    path, manifest = model
    async with (source_node(WholeFile(path, manifest)) as (_, first_at, _), peers_node() as me, peers_node() as next_):
        mine = SparseFile.open(tmp_path / "mine.gguf", manifest)
        source = ChunkSource()
        register(me, source)
        source.offer(mine)  # served while it is being fetched: only verified chunks
        my_at = f"127.0.0.1:{await me.listen('127.0.0.1', 0)}"
        with trio.fail_after(30):
            await fetch_range(me, [SourceRef(first_at)], manifest, mine, (2, 5))
            # The next volunteer knows only this one.
            report = await fetch_range(next_, [SourceRef(my_at)], manifest, tmp_path / "next.gguf", (3, 5))
        mine.close()
    assert list(report.by_source) == [me.node_id]
    assert report.fetched_chunks == len(range_chunks(manifest, N_LAYERS, 3, 5))
    assert_holds_exactly(tmp_path / "next.gguf", path, range_chunks(manifest, N_LAYERS, 3, 5))


async def silent(stream: Stream, req: ChunkRequest, data: bytes) -> None:
    await trio.sleep_forever()


async def test_a_source_that_goes_silent_is_lost_and_its_chunks_come_from_another(
    model: tuple[Path, Manifest], tmp_path: Path
) -> None:
    path, manifest = model
    async with (source_node(WholeFile(path, manifest)) as (_, honest_at, _), peers_node() as mute,
                peers_node() as me):
        mute.handle(FETCH_PROTOCOL, lying_handler(manifest, path.read_bytes(), silent, []))
        mute_at = f"127.0.0.1:{await mute.listen('127.0.0.1', 0)}"
        target = SparseFile.open(tmp_path / "mine.gguf", manifest)
        with trio.fail_after(30):
            report = await fetch_chunks(me, [SourceRef(mute_at), SourceRef(honest_at)], target, manifest.chunks,
                                        # long enough for the honest source on a loaded box (0.5 s lost it
                                        # too once, beside three test processes on 2 cores)
                                        config=FetchConfig(request_timeout=2.0))
        target.close()
    # lost by its deadline, or its chunks taken by the end game before it: never blamed, never used
    assert "sent nothing" in report.lost.get(mute.node_id, "sent nothing") and report.excluded == {}
    assert mute.node_id not in report.by_source
    assert (tmp_path / "mine.gguf").read_bytes() == path.read_bytes()


async def test_manifest_pieces_that_do_not_fit_together_are_refused_and_another_source_asked(
    model: tuple[Path, Manifest]
) -> None:
    path, manifest = model

    async def dribble(stream: Stream) -> None:
        # One byte a piece: a source that would make the fetcher loop for every byte of the manifest.
        async for message in stream.messages():
            if isinstance(message, ManifestRequest):
                await stream.send_message(ManifestPiece(model=message.model, total=len(manifest.encoded),
                                                        offset=message.offset, data=manifest.encoded[:1]))

    async with (source_node(WholeFile(path, manifest)) as (_, honest_at, _), peers_node() as liar,
                peers_node() as me):
        liar.handle(FETCH_PROTOCOL, dribble)
        liar_at = f"127.0.0.1:{await liar.listen('127.0.0.1', 0)}"
        with trio.fail_after(30):
            with pytest.raises(ProtocolError, match="do not fit together"):
                await fetch_manifest(me, [SourceRef(liar_at)], manifest.model_id)
            assert await fetch_manifest(me, [SourceRef(liar_at), SourceRef(honest_at)], manifest.model_id) == manifest
