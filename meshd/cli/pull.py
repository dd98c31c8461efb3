"""`meshd pull`: a model, or a layer range of it, fetched by hand from members or the hub."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from meshd.cli.failures import CommandError, UsageError
from meshd.cli.hub import hub_bar, hub_whole, resolve_hub
from meshd.cli.text import mib, plural
from meshd.fetch.fetcher import FetchFailed, FetchProgress, FetchReport, SourceRef, fetch_manifest, fetch_range
from meshd.fetch.hub import HubError, HubModel, HubReader, HubSpec
from meshd.fetch.hub_pull import pull_range
from meshd.net.peers import PeersConfig, open_peers
from meshd.relay.circuit import enable_circuits
from meshd.store.manifest import Manifest, ManifestError
from meshd.store.ranges import RangeError
from meshd.store.sparse import SparseError
from meshd.store.split import part_paths
from wire.errors import ProtocolError
from wire.identity import NodeIdentity


@contextlib.contextmanager
def fetch_errors(what: str) -> Iterator[None]:
    """A pull's failures, each one line: ``what`` names the model in the manifest's."""
    try:
        yield
    except (HubError, FetchFailed) as exc:
        raise CommandError(str(exc)) from None
    except ManifestError as exc:
        raise CommandError(f"{what}: {exc}") from None
    except SparseError as exc:
        raise CommandError(exc.strerror or str(exc)) from None
    except RangeError as exc:
        # the layers are checked against the model's layer count, which the fetched header says
        raise UsageError(f"--layers: {exc}") from None


def shown_on(bar: Any) -> Callable[[FetchProgress], None]:
    """A fetch's progress, shown on a tqdm ``bar``."""
    def show(p: FetchProgress) -> None:
        bar.total = p.total_bytes
        bar.n = p.done_bytes
        bar.refresh()
    return show


async def hub_pulled_range(reader: HubReader, state_dir: Path, out: Path | None, layers: tuple[int, int]
                           ) -> tuple[Manifest, Path, FetchReport]:
    """The header and the tensors of ``layers`` of the hub model in a sparse file, with progress bars and each
    failure one line (``pull_range``)."""
    model = reader.model
    total = sum(f.size for f in model.files)
    with hub_bar(f"hashing {model.name}", total) as hashing, hub_bar(f"pulling {model.name}", 0) as bar, \
            fetch_errors(model.name):
        return await pull_range(reader, state_dir, out, layers, hashing.update, shown_on(bar))


async def hub_range(model: HubModel, state_dir: Path, layers: tuple[int, int]) -> Path:
    """A stage's own range of a hub model (serve --layers): the header and its tensors, in a sparse file of the
    state directory, the file to load."""
    _, path, _ = await hub_pulled_range(HubReader(model), state_dir, None, layers)
    return path


async def pull_hub(args: argparse.Namespace, spec: HubSpec) -> int:
    model = await resolve_hub(spec)
    if args.layers is None:
        path, read = await hub_whole(model, args.state_dir, args.out)
        print(f"{model.name} of {model.where} in {path}: {mib(read)} read from the hub, every file checked "
              f"against its sha256")
        return 0
    reader = HubReader(model)
    manifest, path, report = await hub_pulled_range(reader, args.state_dir, args.out, args.layers)
    start, end = args.layers
    print(f"layers {start}:{end} of {model.name} ({manifest.model_id[:16]}) of {model.where} in {path}: "
          f"{mib(report.fetched_bytes)} fetched from the hub, {mib(report.reused_bytes)} already there; "
          f"{mib(reader.read_bytes)} read from the hub in all")
    return 0


async def pull(args: argparse.Namespace) -> int:
    if isinstance(args.model_id, HubSpec):
        return await pull_hub(args, args.model_id)
    if args.layers is None or not args.seed:
        raise UsageError("pulling a model by id takes --layers START:END and at least one --seed HOST:PORT")
    out: Path = args.out or args.state_dir / "models" / f"{args.model_id}.gguf"
    sources = [SourceRef(seed) for seed in args.seed]
    short = args.model_id[:16]
    from tqdm import tqdm

    bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc=f"pulling {short}", disable=not sys.stderr.isatty(),
               leave=False)

    # Errors become one line inside the peers' context: out of it they would come wrapped in its nursery's group.
    async with open_peers(NodeIdentity.generate(), PeersConfig(mesh_key=args.mesh_key)) as peers:
        enable_circuits(peers)
        try:
            with fetch_errors(f"model {short}"):
                try:
                    manifest = await fetch_manifest(peers, sources, args.model_id, timeout=args.timeout)
                except ProtocolError as exc:
                    raise CommandError(f"no seed gave model {short}: {exc.message}") from None
                report = await fetch_range(peers, sources, manifest, out, args.layers, progress=shown_on(bar))
        finally:
            bar.close()
    start, end = args.layers
    # a split set's parts lie beside the name given, and load from the first
    loads = part_paths(out, len(manifest.parts))[0] if manifest.more_parts else out
    print(f"layers {start}:{end} of {short} in {loads}: {mib(report.fetched_bytes)} fetched "
          f"({plural(report.fetched_chunks, 'chunk')}, {plural(len(report.by_source), 'source')}), "
          f"{mib(report.reused_bytes)} already there")
    for node, why in report.excluded.items():
        print(f"meshd pull: source {node[:16]} was excluded: {why}", file=sys.stderr)
    return 0
