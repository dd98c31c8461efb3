"""The front door's ASGI app: each dialect's routes, the console's and the operator's on one Starlette app.

Every dialect contributes `routes(front) -> list[BaseRoute]` and is listed in `PARTS`; the
console's page and its mesh-state endpoints, /health and /metrics mount on the same port, the
console's snapshot shared by its viewers and the scrapes. Before any route, a keyless API's rules
(`meshd.front.local`) refuse what a web page could send it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshd.front import anthropic_api, console, local, openai_api, operations, responses_api
from meshd.front.door import ApiError, FrontDoor, Problem

log = logging.getLogger(__name__)

PARTS: tuple[Callable[[FrontDoor], list[BaseRoute]], ...] = (openai_api.routes, responses_api.routes,
                                                              anthropic_api.routes)

PROBLEMS = {400: Problem.BAD_REQUEST, 401: Problem.UNAUTHORIZED, 404: Problem.NOT_FOUND, 413: Problem.TOO_LARGE,
            429: Problem.BUSY, 503: Problem.UNAVAILABLE, 504: Problem.TIMEOUT}


def build_app(front: FrontDoor) -> Starlette:
    view = console.Console(console.source_of(front.mesh), front.asking)
    routes = [route for part in PARTS for route in part(front)]
    routes += console.routes(front, view) + operations.routes(front, view)
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error},
                     middleware=[Middleware(Gate, front=front)])


def error_response(path: str, error: ApiError) -> Response:
    """`error` in the dialect the path belongs to."""
    render = anthropic_api.error_response if path.startswith("/v1/messages") else openai_api.error_response
    return render(error)


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such path, wrong method) in the dialect the path belongs to."""
    assert isinstance(exc, HTTPException)
    problem = PROBLEMS.get(exc.status_code, Problem.BAD_REQUEST)
    response = error_response(request.url.path, ApiError(problem, f"{request.method} {request.url.path}: {exc.detail}"))
    response.status_code = exc.status_code
    return response


class Gate:
    """Before any route: a keyless API's rules; after, each response's status counted for /metrics."""

    def __init__(self, app: ASGIApp, front: FrontDoor) -> None:
        self.app = app
        self.front = front

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.front.metrics.responses.labels(str(message["status"])).inc()
            await send(message)

        server = scope.get("server")
        refused = None if self.front.api_keys is not None else \
            local.refusal(scope["method"], Headers(scope=scope), scope["scheme"], server[0] if server else None)
        if refused is None:
            await self.app(scope, receive, counted)
            return
        # the operator's record: a page in someone's browser may be trying the API
        log.info("refused %s %s (%d): %s", scope["method"], scope["path"], refused.status, refused.message)
        await error_response(scope["path"], refused)(scope, receive, counted)
