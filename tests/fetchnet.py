"""Fetch test helpers: chunk sources on loopback, in this process or as a process of their own.

In process: ``async with source_node(holding) as (peers, address)``, and
``async with peers_node() as peers`` for the fetching side.

As a process (to be SIGKILLed mid-fetch)::

    python tests/fetchnet.py whole MODEL.gguf [--chunk-size N]   # or: sparse PARTIAL.gguf

prints ``ready HOST:PORT NODE_ID`` once it listens, then serves until killed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from meshd.fetch.source import ChunkSource, SourceConfig, register
from meshd.net.link import LinkTimings
from meshd.net.peers import Peers, PeersConfig, open_peers
from meshd.store.holding import Holding, WholeFile
from meshd.store.manifest import CHUNK_SIZE, Manifest, compute
from meshd.store.sparse import SparseFile
from wire.identity import NodeIdentity

# chunks small enough that each of a tiny model's tensors spans several
SMALL_CHUNK = 4 << 10


def chunked(path: Path) -> tuple[Path, Manifest]:
    """A model file and its manifest in SMALL_CHUNK chunks."""
    return path, compute(path, SMALL_CHUNK)


CALM = PeersConfig(timings=LinkTimings(keepalive_interval=300, dead_after=900), drain_timeout=0.2)
READY = re.compile(r"^ready (\S+) (\w+)$")


@asynccontextmanager
async def peers_node(config: PeersConfig = CALM) -> AsyncIterator[Peers]:
    async with open_peers(NodeIdentity.generate(), config) as peers:
        yield peers


@asynccontextmanager
async def source_node(
    holding: Holding, config: SourceConfig = SourceConfig(), peers_config: PeersConfig = CALM,
    source: ChunkSource | None = None,
) -> AsyncIterator[tuple[Peers, str, ChunkSource]]:
    """A node on loopback serving ``holding`` (with ``source``, or one of ``config``): its peers, address, source."""
    async with peers_node(peers_config) as peers:
        source = source or ChunkSource(config)
        register(peers, source)
        source.offer(holding)
        port = await peers.listen("127.0.0.1", 0)
        yield peers, f"127.0.0.1:{port}", source


@dataclass
class SourceProcess:
    proc: subprocess.Popen[str]
    address: str
    node_id: str


def start_source_process(kind: str, path: Path, chunk_size: int = CHUNK_SIZE) -> SourceProcess:
    """A source process (see the module docstring), ready; the caller stops it by PID."""
    from localmesh import spawn, stop_process

    root = Path(__file__).resolve().parent.parent
    # This checkout's packages, not whichever the venv has installed.
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = spawn([sys.executable, __file__, kind, str(path), "--chunk-size", str(chunk_size)],
                 stdout=subprocess.PIPE, text=True, cwd=root, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    ready = READY.match(line)
    if ready is None:
        stop_process(proc)
        raise RuntimeError(f"the source process did not start: {line!r}")
    return SourceProcess(proc, ready.group(1), ready.group(2))


async def _serve_forever(kind: str, path: Path, chunk_size: int) -> None:
    holding: Holding
    if kind == "whole":
        holding = WholeFile(path, compute(path, chunk_size))
    else:
        holding = SparseFile.resume(path)
    async with source_node(holding) as (peers, address, _):
        print(f"ready {address} {peers.node_id}", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["whole", "sparse"])
    parser.add_argument("path", type=Path)
    parser.add_argument("--chunk-size", type=int, default=CHUNK_SIZE)
    args = parser.parse_args()
    trio.run(_serve_forever, args.kind, args.path, args.chunk_size)
