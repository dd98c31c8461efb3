"""What an operator's tools ask of the front door: `GET /health` (a load balancer's or a supervisor's
probe, answered as llama-server answers it) and `GET /metrics` (Prometheus' scrape).

/health needs no key, as llama-server's does not: a probe carries none, and it tells only whether a
model can be asked and, if none can, why. /metrics needs the API's key (Prometheus sends one as a
bearer token): it names the members and counts the traffic.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from meshd.front import openai_api
from meshd.front.console import Console
from meshd.front.dialect import guarded
from meshd.front.door import FrontDoor
from meshd.front.metrics import Figures, exposition

# llama-server's answers, so a probe written for it reads these alike
HEALTHY = {"status": "ok"}
UNAVAILABLE = "unavailable"


def routes(front: FrontDoor, view: Console) -> list[BaseRoute]:
    """/health and /metrics; `view` is the console's, whose snapshot the scrapes share."""

    async def health(request: Request) -> Response:
        models = front.models()
        if any(m.n_layers > 0 and m.covered_layers == m.n_layers for m in models):
            return JSONResponse(HEALTHY, headers={"Cache-Control": "no-store"})
        reason = "; ".join(f"{m.name}: {m.reason or f'{m.covered_layers} of its {m.n_layers} layers are served'}"
                           for m in models) or "no member of the mesh holds a model yet"
        return JSONResponse({"status": UNAVAILABLE, "reason": reason}, 503, headers={"Cache-Control": "no-store"})

    async def metrics(request: Request) -> Response:
        figures = Figures(await view.state(), len(front.asking), front.connections)
        return Response(exposition(front.metrics, figures), media_type=CONTENT_TYPE_LATEST,
                        headers={"Cache-Control": "no-store"})

    return [Route("/health", health, methods=["GET"]),
            Route("/metrics", guarded(front, metrics, openai_api.error_response), methods=["GET"])]
