"""Hypercorn under trio serving the front door's app: bound before it reports started, its
connections capped and its sends timed (`meshd.front.connections`).

Hypercorn's `serve` builds its own listeners, leaving no place for a cap on accepts, so this runs
Hypercorn's trio connection handler (`TCPServer`, the one `serve` runs) on capped listeners of
its own. The app has no startup or shutdown work, so no ASGI lifespan runs.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import cast

import trio
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ASGIFramework, ConnectionState
from hypercorn.utils import repr_socket_addr, wrap_app
from starlette.types import ASGIApp, Receive, Scope, Send

from meshd.front.connections import CappedListener, Connections
from meshd.mesh.records import join_address

log = logging.getLogger("meshd.front.http")

# Hypercorn's bounds, made explicit: request heads, idle keep-alive connections (and those whose
# request head has not all come), pending accepts.
MAX_HEAD_BYTES = 16 << 10
KEEP_ALIVE_SECONDS = 5.0
BACKLOG = 1024


async def serve_front(app: ASGIApp, host: str, port: int, connections: Connections | None = None, *,
                      task_status: trio.TaskStatus[str]) -> None:
    """Serves `app` on host:port within the caps of `connections`; reports the URL it listens on
    (with the port picked, for port 0)."""
    book = connections if connections is not None else Connections()
    config = Config()
    config.bind = [join_address(host, port)]
    config.h11_max_incomplete_size = MAX_HEAD_BYTES
    config.keep_alive_timeout = KEEP_ALIVE_SECONDS
    # Hypercorn's lines go through meshd's logging (its level, its format); no access log
    config.errorlog = log
    config.accesslog = None
    config.include_server_header = False
    sockets = config.create_sockets().insecure_sockets
    listeners = []
    for sock in sockets:
        sock.listen(BACKLOG)
        listeners.append(CappedListener(trio.SocketListener(trio.socket.from_stdlib_socket(sock)), book))
    # Starlette's and Hypercorn's ASGI types describe the same protocol in two vocabularies
    served = wrap_app(cast(ASGIFramework, marking_busy(app, book)), config.wsgi_max_body_size, "asgi")
    handler = partial(TCPServer, served, config, WorkerContext(None), ConnectionState({}))
    async with trio.open_nursery() as nursery:
        # TCPServer takes any stream with a `socket` (BoundedStream has one), though its type names TLS's
        await nursery.start(trio.serve_listeners, handler, listeners)
        task_status.started(f"http://{repr_socket_addr(sockets[0].family, sockets[0].getsockname())}")


def marking_busy(app: ASGIApp, book: Connections) -> ASGIApp:
    """`app`, with each connection marked busy while a request runs on it (a busy one is never the
    one closed to make room)."""
    async def served(scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client")
        connection = book.find((client[0], client[1])) if client else None
        if connection is None:
            await app(scope, receive, send)
            return
        connection.busy += 1
        try:
            await app(scope, receive, send)
        finally:
            connection.busy -= 1
    return served

