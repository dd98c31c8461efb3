"""A model fetched range by range: a node started with a model id (or a hub model) and no file
learns the manifest and header from the members that hold it, volunteers it, and on each assignment
fetches exactly the tensors of its range into a sparse file; under a disk budget it drops what no
range it serves reads."""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from meshd.daemon.state import DaemonState
from meshd.daemon.volunteer import check_volunteer
from meshd.fetch.fetcher import FetchFailed, FetchProgress, FetchReport, SourceRef, fetch_chunks, fetch_manifest
from meshd.fetch.hub import HubError, HubModel, HubReader, cached_manifest, remember_manifest
from meshd.fetch.hub_chunks import fetch_from_hub
from meshd.fetch.hub_hash import check_binding, hash_model
from meshd.mesh.addresses import source_group
from meshd.mesh.assignment import held_ranges
from meshd.mesh.models import ModelNotFound
from meshd.mesh.records import MAX_HELD, HeldRange, host_of
from meshd.mesh.status import held_models
from meshd.stage.model_file import describe_model
from meshd.store.manifest import CHUNK_SIZE, Chunk, Manifest
from meshd.store.ranges import held_layer_ranges, range_chunks
from meshd.store.sparse import SparseFile
from wire.errors import ProtocolError
from wire.meshrpc import FetchStatus

log = logging.getLogger(__name__)


# Seconds a node joining with a hub model waits for a member to offer its manifest before it reads the whole
# files itself to build it: records spread within a few push-pull rounds of a join.
HUB_GOSSIP_WAIT = 5.0


class ModelFetch(DaemonState):
    """A model fetched range by range: from the members that hold it (or a hub), into a sparse file."""

    def _sources(self, digest: str) -> list[SourceRef]:
        """The other live members that hold some layers of `digest` on disk, whole files first."""
        found = []
        for record in self.live_records():
            held = held_ranges(record, digest)
            address = self.dial_address(record)
            if record.node_id != self.mesh.node_id and held and not record.leaving and address is not None:
                info = record.model(digest)
                found.append((not (info is not None and info.whole), record.node_id, address))
        return [SourceRef(address, node_id) for _, node_id, address in sorted(found)]

    def _resolve(self, wanted: str) -> str | None:
        """The id of the model `wanted` names (an id, or a name the mesh knows: a model's own or its file's),
        once a member holds it."""
        models = held_models(r for r in self.live_records() if r.node_id != self.mesh.node_id)
        # An id names one model whatever others are named (a member may name its model anything, an
        # id included); a name shared by several names none, and the error lists every id in full,
        # for the user to give one (a shortened id matched nothing and waited out model_wait).
        ids = [wanted.lower()] if wanted.lower() in models else sorted(
            d for d, info in models.items() if info.known_as(wanted))
        if len(ids) > 1:
            raise ModelNotFound(f"'{wanted}' names {len(ids)} models of the mesh: {', '.join(ids)}; "
                                "give --model-id with the id of one (meshd models lists them)")
        return ids[0] if ids and self._sources(ids[0]) else None

    async def _fetch_model(self, wanted: str) -> None:
        """Learns the model from its holders (manifest, header), then volunteers it."""
        cfg = self.config
        assert cfg.state_dir is not None, "a node that fetches needs a state directory"
        digest = None
        with trio.move_on_after(cfg.model_wait):
            for waited in range(math.ceil(cfg.model_wait) + 1):
                if (digest := self._resolve(wanted)) is not None:
                    break
                if waited == 10:
                    log.warning("no member holds model '%s' yet; waiting up to %g s for one (meshd models lists "
                                "what the mesh has)", wanted, cfg.model_wait)
                await trio.sleep(1.0)
        if digest is None:
            raise ModelNotFound(f"no member of the mesh holds model '{wanted}' (waited {cfg.model_wait:g} s); "
                                "meshd models lists what it has")
        manifest = None
        with trio.move_on_after(cfg.model_wait):
            while manifest is None:
                try:
                    manifest = await fetch_manifest(self.peers, self._sources(digest), digest)
                except ProtocolError as exc:
                    log.info("no manifest of %s yet: %s", digest[:12], exc)
                    await trio.sleep(1.0)
        if manifest is None:
            raise ModelNotFound(f"no member sent the manifest of model {digest[:16]} (waited {cfg.model_wait:g} s)")
        known = held_models(r for r in self.live_records() if r.node_id != self.mesh.node_id).get(digest)
        await self._volunteer_fetched(manifest, known.file if known is not None else "")

    async def _volunteer_fetched(self, manifest: Manifest, file: str, hub: str = "") -> None:
        """Opens the sparse file of `manifest`, fetches its header, and volunteers the model as `file` (fetched
        from members, and from the `hub` file it names)."""
        cfg = self.config
        assert cfg.state_dir is not None, "a node that fetches needs a state directory"
        digest = manifest.model_id
        path = cfg.state_dir / "models" / f"{digest}.gguf"
        sparse = await trio.to_thread.run_sync(SparseFile.open, path, manifest)
        self.manifest, self.sparse, self.model_path = manifest, sparse, sparse.path
        # a holder that is busy, restarting or gone for a moment is no reason to give up (the node
        # would exit): the header is asked for again, like the manifest, for up to model_wait
        failure: Exception | str = "no member answered"
        fetched = False
        with trio.move_on_after(cfg.model_wait):
            while not fetched:
                try:
                    await self._fetch(digest, manifest.header_chunks_list(), "header", 0, 0)
                    fetched = True
                except (FetchFailed, ProtocolError) as exc:
                    failure = exc
                    log.info("no header of %s yet: %s", digest[:12], exc)
                    await trio.sleep(1.0)
        if not fetched:
            raise ModelNotFound(f"cannot fetch the header of model {digest[:16]} (waited {cfg.model_wait:g} s): "
                                f"{failure}")
        # the sparse file is named by the id: the model keeps the file name its holders know it by
        info = (await trio.to_thread.run_sync(describe_model, sparse.path, digest)).model_copy(
            update={"whole": False, "file": file, "hub": hub})
        check_volunteer(info, cfg)
        self.model = info
        self.source.offer(sparse)
        limits, now = cfg.limits, trio.current_time()
        self.mesh.update_record(now, models=[info], kv_tokens=limits.max_sessions * limits.max_session_tokens)
        self.duty.volunteer(now, info)
        self.duty.held(now, self._held())
        self._flush()
        log.info("volunteering %s (%s), fetching the layers assigned", info.name, digest[:12])

    def _held(self) -> list[HeldRange]:
        """What the sparse file holds verified, as layer ranges (what fetchers may ask this node for)."""
        assert self.sparse is not None and self.model is not None and self.manifest is not None
        ranges = held_layer_ranges(self.manifest, self.model.n_layers, self.sparse.has)
        return [HeldRange(model=self.manifest.model_id, start=a, end=b) for a, b in ranges[:MAX_HELD]]

    async def _fetch_range(self, start: int, end: int) -> None:
        """Fetches the tensors of layers [start, end) the sparse file lacks (a re-assignment: only the
        difference), within the disk budget, and publishes what it then holds."""
        assert self.sparse is not None and self.manifest is not None and self.model is not None
        chunks = range_chunks(self.manifest, self.model.n_layers, start, end)
        await self._trim_disk(keep=chunks)
        await self._fetch(self.manifest.model_id, chunks, "layers", start, end)
        self.duty.held(trio.current_time(), self._held())
        self._flush()

    async def _fetch(self, digest: str, chunks: list[Chunk], what: str, start: int, end: int) -> None:
        assert self.sparse is not None and self.model_path is not None
        # before the header is here the model is known by what the user named it
        name = self.model.name if self.model is not None else (self.config.model_id or digest)
        status = FetchStatus(model=digest, name=name[:256], start=start, end=end, done_bytes=0,
                             total_bytes=sum(c.size for c in chunks), rate=0.0)
        self.fetches = [*self.fetches[-7:], status]
        index = len(self.fetches) - 1
        # tqdm imported when a fetch starts, not with the daemon: most daemons never fetch, and it costs 0.05 CPU-s
        from tqdm import tqdm

        bar: Any = tqdm(total=status.total_bytes, unit="B", unit_scale=True, file=sys.stderr,
                        desc=f"fetch {what} [{start}, {end})" if end else f"fetch {what}",
                        disable=not self.config.progress, leave=False)

        def progress(p: FetchProgress) -> None:
            bar.update(p.done_bytes - bar.n)
            self.fetches[index] = status.model_copy(update={
                "done_bytes": p.done_bytes, "total_bytes": p.total_bytes, "fetched_bytes": p.fetched_bytes,
                "rate": max(0.0, p.rate), "sources": p.sources})

        t0 = time.monotonic()
        try:
            with bar:
                report = await self._fetch_chunks(digest, chunks, progress)
        except (FetchFailed, ProtocolError, OSError) as exc:
            self.fetches[index] = self.fetches[index].model_copy(update={"state": f"failed: {exc}"[:256]})
            raise
        done = self.fetches[index].model_copy(update={"state": "done", "done_bytes": status.total_bytes,
                                                      "fetched_bytes": report.fetched_bytes})
        self.fetches[index] = done
        log.info("fetched %s: %d bytes over the network, %d already here, in %.1f s",
                 f"{what} [{start}, {end})" if end else what, report.fetched_bytes, report.reused_bytes,
                 time.monotonic() - t0)

    async def _fetch_chunks(self, digest: str, chunks: list[Chunk], progress: Callable[[FetchProgress], None]
                            ) -> FetchReport:
        """From the members that hold them; for a hub model, what none of them holds (or every chunk, while
        its manifest is one member's word alone) from the hub."""
        assert self.sparse is not None
        if self.hub is None:
            return await fetch_chunks(self.peers, self._sources(digest), self.sparse, chunks, progress=progress)
        missing = self.sparse.missing(chunks)
        report = FetchReport(chunks=len(chunks), reused_bytes=sum(c.size for c in chunks) - sum(c.size for c in missing))
        sources = self._sources(digest) if self._members_vouch else []
        held = self._held_by_members(digest) if sources else set()
        # members preferred, asked only for what their records say they hold: a fetch from them ends as
        # soon as a chunk is held by none (the rest would wait on it); the hub has what they lack
        parts: list[FetchReport] = []
        if any(c.index in held for c in missing):
            try:
                parts.append(await fetch_chunks(self.peers, sources, self.sparse,
                                                [c for c in missing if c.index in held], progress=progress))
            except FetchFailed as exc:
                parts.append(exc.report)
        parts.append(await fetch_from_hub(self.hub, self.sparse, self.sparse.missing(missing), progress=progress))
        for part in parts:
            report.fetched_chunks += part.fetched_chunks
            report.fetched_bytes += part.fetched_bytes
            for key, n in part.by_source.items():
                report.by_source[key] = report.by_source.get(key, 0) + n
            report.excluded.update(part.excluded)
            report.lost.update(part.lost)
        return report

    def _held_by_members(self, digest: str) -> set[int]:
        """The chunks of `digest` other live members' records say they hold (the header's with any layer)."""
        assert self.manifest is not None
        held: set[int] = set()
        for record in self.live_records():
            if record.node_id == self.mesh.node_id or record.leaving:
                continue
            for start, end in held_ranges(record, digest):
                if self.model is None:
                    held.update(c.index for c in self.manifest.header_chunks_list())
                else:
                    held.update(c.index for c in range_chunks(self.manifest, self.model.n_layers, start, end))
        return held

    async def _hub_model(self, model: HubModel) -> None:
        """Learns a hub model's manifest (a member's, bound to the hub's files, or its own from the whole
        files, once), then volunteers it like a model fetched from members."""
        cfg = self.config
        assert cfg.state_dir is not None, "a node that fetches needs a state directory"
        reader = HubReader(model)
        try:
            await trio.to_thread.run_sync(reader.check)
            manifest = await trio.to_thread.run_sync(cached_manifest, cfg.state_dir, model)
            # a member's record may come a moment after the seeds answer: a whole read is worth waiting for
            with trio.move_on_after(HUB_GOSSIP_WAIT if cfg.seeds else 0):
                while manifest is None:
                    manifest = await self._member_manifest(reader)
                    if manifest is None:
                        await trio.sleep(1.0)
            if manifest is None:
                log.info("no member offers %s of %s: reading its %d bytes once to build its manifest", model.name,
                         model.where, sum(f.size for f in model.files))
                from tqdm import tqdm

                bar: Any = tqdm(total=sum(f.size for f in model.files), unit="B", unit_scale=True, file=sys.stderr,
                                desc=f"hashing {model.name}", disable=not cfg.progress, leave=False)
                started = time.monotonic()
                with bar:
                    manifest = await trio.to_thread.run_sync(hash_model, reader, CHUNK_SIZE, bar.update,
                                                             abandon_on_cancel=True)
                took = time.monotonic() - started
                log.info("read and checked %d bytes of %s in %.1f s (%.1f MB/s) to build its manifest",
                         reader.read_bytes, model.name, took, reader.read_bytes / max(took, 1e-9) / 1e6)
                await trio.to_thread.run_sync(remember_manifest, cfg.state_dir, model, manifest)
        except HubError as exc:
            raise ModelNotFound(str(exc)) from None
        self.hub = reader
        log.info("%s of %s is model %s", model.name, model.where, manifest.model_id[:16])
        await self._volunteer_fetched(manifest, Path(model.name).stem, f"hf:{model.repo}@{model.commit}")

    async def _member_manifest(self, reader: HubReader) -> Manifest | None:
        """The manifest of the hub model a member offers under its file name, once its sizes and headers are
        the hub's at the pinned commit. Its tensors' hashes are the member's word: chunks come from members
        only when a second one, at another address, names the same model (else from the hub, each checked
        against it). Addresses, not identities: identities cost nothing to make."""
        # as a model's record names its file: the file's (or set's) name less .gguf
        name = Path(reader.model.name).stem
        offered: dict[str, list[SourceRef]] = {}
        for record in self.live_records():
            address = self.dial_address(record)
            if record.node_id == self.mesh.node_id or record.leaving or address is None:
                continue
            for info in record.models:
                if info.file == name:
                    # a member fetching its range serves the manifest (and what it holds) before any layer
                    offered.setdefault(info.digest, []).append(SourceRef(address, record.node_id))
        for digest, holders in sorted(offered.items(), key=lambda item: -len(item[1])):
            try:
                manifest = await fetch_manifest(self.peers, holders, digest)
                await trio.to_thread.run_sync(check_binding, reader, manifest)
            except (ProtocolError, HubError) as exc:
                log.warning("model %s, offered as %s, is not %s of %s: %s", digest[:16], name, reader.model.name,
                            reader.model.where, exc)
                continue
            self._members_vouch = len({source_group(host_of(ref.address or "")) for ref in holders}) >= 2
            return manifest
        return None

    async def _trim_disk(self, keep: list[Chunk] | None = None) -> None:
        """Under a disk budget: drops (punches) the chunks of tensors that no range loaded or about to be
        loaded (`keep`) reads, once their bytes plus what is still to fetch exceed the budget."""
        budget, sparse, manifest, model = self.config.disk_bytes, self.sparse, self.manifest, self.model
        if budget is None or sparse is None or manifest is None or model is None:
            return
        needed = {c.index for c in keep or ()}
        for r in [*self.serving, *self.retiring]:
            needed.update(c.index for c in range_chunks(manifest, model.n_layers, r.start, r.end))
        missing = sum(c.size for c in keep or () if not sparse.has(c.index))
        if sparse.verified_bytes() + missing <= budget:
            return
        spare = [c for c in manifest.chunks if c.index not in needed and sparse.has(c.index)]
        released = await trio.to_thread.run_sync(sparse.punch, spare)
        log.info("dropped %d bytes of layers no longer served (--disk %d)", released, budget)
        self.duty.held(trio.current_time(), self._held())
        self._flush()
