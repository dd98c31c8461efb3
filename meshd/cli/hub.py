"""Hub models (hf:ORG/REPO...) for `serve` and `pull`: resolved, and fetched whole with a progress bar."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import trio

from meshd.cli.failures import CommandError
from meshd.fetch.hub import HubError, HubModel, HubReader, HubSpec, cached_manifest, resolve
from meshd.fetch.hub_pull import file_paths, pull_whole


async def resolve_hub(spec: HubSpec) -> HubModel:
    """The commit and files `spec` names on the hub (HF_ENDPOINT, HF_TOKEN as huggingface_hub reads them)."""
    try:
        return await trio.to_thread.run_sync(resolve, spec)
    except HubError as exc:
        raise CommandError(str(exc)) from None


def hub_bar(what: str, total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=what,
                disable=not sys.stderr.isatty(), leave=False)


async def hub_whole(model: HubModel, state_dir: Path, out: Path | None = None) -> tuple[Path, int]:
    """The hub model's files, whole, in `out` (default: STATE_DIR/models/ its file name); read from the hub
    unless they are there already with their manifest. Returns the file to load and the bytes read."""
    path = out or state_dir / "models" / model.name
    reader = HubReader(model)
    paths = file_paths(reader, path)
    if out is None and all(p.is_file() for p in paths) and cached_manifest(state_dir, model) is not None:
        return paths[0], 0
    with hub_bar(f"pulling {model.name}", sum(f.size for f in model.files)) as bar:
        try:
            await trio.to_thread.run_sync(pull_whole, reader, path, state_dir, bar.update, abandon_on_cancel=True)
        except HubError as exc:
            raise CommandError(str(exc)) from None
        except OSError as exc:
            raise CommandError(f"cannot write {path}: {exc.strerror or exc}") from None
    return paths[0], reader.read_bytes
