"""The front door's ASGI app: each dialect's routes (and the console's) on one Starlette app.

Every part of the front door contributes `routes(front) -> list[BaseRoute]` and is listed in
`PARTS`; the console's page and its mesh-state endpoints mount the same way, on the same port.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from meshd.front import anthropic_api, console, openai_api
from meshd.front.door import ApiError, FrontDoor, Problem

PARTS: tuple[Callable[[FrontDoor], list[BaseRoute]], ...] = (openai_api.routes, anthropic_api.routes, console.routes)

PROBLEMS = {400: Problem.BAD_REQUEST, 401: Problem.UNAUTHORIZED, 404: Problem.NOT_FOUND, 413: Problem.TOO_LARGE,
            429: Problem.BUSY, 503: Problem.UNAVAILABLE, 504: Problem.TIMEOUT}


def build_app(front: FrontDoor) -> Starlette:
    routes = [route for part in PARTS for route in part(front)]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such path, wrong method) in the dialect the path belongs to."""
    assert isinstance(exc, HTTPException)
    problem = PROBLEMS.get(exc.status_code, Problem.BAD_REQUEST)
    error = ApiError(problem, f"{request.method} {request.url.path}: {exc.detail}")
    render = anthropic_api.error_response if request.url.path.startswith("/v1/messages") else \
        openai_api.error_response
    response = render(error)
    response.status_code = exc.status_code
    return response
