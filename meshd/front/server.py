"""Hypercorn under trio serving the front door's app: bound before it reports started."""

from __future__ import annotations

import logging
from functools import partial
from typing import cast

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from hypercorn.typing import ASGIFramework
from starlette.types import ASGIApp

from meshd.mesh.records import join_address

log = logging.getLogger("meshd.front.http")

# Hypercorn's bounds, made explicit: request heads, idle keep-alive connections, pending accepts.
MAX_HEAD_BYTES = 16 << 10
KEEP_ALIVE_SECONDS = 5.0
BACKLOG = 128


async def serve_front(app: ASGIApp, host: str, port: int, *, task_status: trio.TaskStatus[str]) -> None:
    """Serves `app` on host:port; reports the URL it listens on (with the port picked, for port 0)."""
    config = Config()
    config.bind = [join_address(host, port)]
    config.h11_max_incomplete_size = MAX_HEAD_BYTES
    config.keep_alive_timeout = KEEP_ALIVE_SECONDS
    config.backlog = BACKLOG
    # Hypercorn's lines go through meshd's logging (its level, its format); no access log
    config.errorlog = log
    config.accesslog = None
    config.include_server_header = False
    # Starlette's and Hypercorn's ASGI types describe the same protocol in two vocabularies
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(partial(serve, cast(ASGIFramework, app), config, mode="asgi"))
        task_status.started(binds[0])
