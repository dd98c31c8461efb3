"""The front door's core, shared by both dialects and the console: which model a request names,
who may ask, the asks in flight, and every failure as one dialect-neutral `ApiError`.

Each request is an ask through the mesh (`Mesh.ask`, the asker's failover path); the door
bounds how many run at once and keeps a record of each while it runs, for the console.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import itertools
import logging
import time
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import trio

from meshd.client.ask import (
    AnswerWithdrawn,
    AskRequest,
    AskResult,
    ClientStopped,
    OnToken,
    RouteError,
    deliver,
    over_budget,
)
from meshd.client.asker import Unverified
from meshd.front.connections import Connections
from meshd.front.metrics import FrontMetrics
from wire.credit import SHARE_WHOLE
from wire.errors import ErrorCode, ProtocolError
from wire.meshrpc import ModelCoverage, StatusReply

# The API key the request being served presented, as a label that does not give the key away ("": no
# keys): set by the key check, read where the ask is counted, so each key's usage is its own on /metrics.
# Every key's asks are the member's: the stages count them against its credit (wire.credit.Voucher), each
# key's with its own share of the member's priority (meshd.mesh.credit.key_share).
KEY_USED: ContextVar[str] = ContextVar("meshd_api_key", default="")


def key_label(key: str) -> str:
    """A key as /metrics names it: a short hash, which tells keys apart without showing one."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]

log = logging.getLogger(__name__)

# Digest prefixes shorter than this are too easy to collide (status shows 12).
MIN_DIGEST_PREFIX = 12
# Asks running at once through one front door; more get "busy" (429) at once rather than queueing.
MAX_ASKS = 64
# A key file holds a few keys, one a line; anything larger is not a key file.
MAX_KEY_FILE_BYTES = 64 << 10


class Problem(enum.Enum):
    """What went wrong, before a dialect names it: each dialect maps these to its error type."""

    BAD_REQUEST = 400
    UNAUTHORIZED = 401
    FORBIDDEN = 403
    NOT_FOUND = 404
    TOO_LARGE = 413
    UNSUPPORTED_MEDIA = 415
    BUSY = 429
    INTERNAL = 500
    UNAVAILABLE = 503
    TIMEOUT = 504


class ApiError(Exception):
    def __init__(self, problem: Problem, message: str, retry_after: float | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.problem = problem
        self.message = message
        self.retry_after = retry_after
        self.param = param

    @property
    def status(self) -> int:
        return self.problem.value


class Mesh(Protocol):
    """What the front door needs of the mesh: its view, and asks through it."""

    def status(self) -> StatusReply: ...

    async def ask(self, model: str, request: AskRequest, on_token: OnToken | None, result: AskResult) -> AskResult:
        """Runs `request` on `model` (a digest) with failover, filling `result` as it goes;
        a ProtocolError or RouteError if it cannot."""
        ...


@dataclass
class Asking:
    """One ask in flight, as the console shows it."""

    id: int
    model: str
    dialect: str
    stream: bool
    started: float
    result: AskResult = field(default_factory=AskResult)


def load_api_keys(path: Path) -> list[str]:
    """The keys in `path`, one a line (blank lines ignored); ValueError with the reason if it has none."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read the API key file {path}: {exc.strerror}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ValueError(f"{path} is larger than {MAX_KEY_FILE_BYTES >> 10} KiB: not an API key file")
    try:
        keys = [line.strip() for line in data.decode().splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not text: an API key file holds keys, one a line") from None
    if not keys:
        raise ValueError(f"{path} holds no API key (one a line)")
    return keys


@dataclass
class FrontDoor:
    mesh: Mesh
    # None: anyone who reaches the port may ask (loopback only, the CLI sees to that)
    api_keys: Sequence[str] | None = None
    default_max_tokens: int = 512
    max_asks: int = MAX_ASKS
    asking: dict[int, Asking] = field(default_factory=dict)
    # the open HTTP connections within their caps (the server admits them, /metrics shows them)
    connections: Connections = field(default_factory=Connections)
    # what the asks did, for /metrics: a registry of this front door's own
    metrics: FrontMetrics = field(default_factory=FrontMetrics)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    # ----- who may ask

    def key_ok(self, presented: str | None) -> bool:
        """Whether `presented` is one of the keys; every key is compared in constant time, none skipped."""
        if self.api_keys is None:
            return True
        if presented is None:
            return False
        given = presented.encode()
        ok = False
        for key in self.api_keys:
            ok |= hmac.compare_digest(given, key.encode())
        return ok

    def check_key(self, bearer: str | None, x_api_key: str | None) -> None:
        """Either header may carry the key (OpenAI's clients send a bearer token, Anthropic's x-api-key)."""
        if self.api_keys is None:
            return
        token = None
        if bearer is not None:
            scheme, _, value = bearer.partition(" ")
            token = value.strip() if scheme.lower() == "bearer" else None
        presented = token if token is not None else x_api_key
        if not self.key_ok(presented):
            raise ApiError(Problem.UNAUTHORIZED, "a valid API key is required (Authorization: Bearer KEY or "
                                                 "x-api-key: KEY)")
        assert presented is not None
        KEY_USED.set(key_label(presented))

    # ----- which model

    def models(self) -> list[ModelCoverage]:
        return list(self.mesh.status().coverage)

    def resolve(self, name: str | None) -> ModelCoverage:
        """The model a request names: its name, its file's or digest (or a 12+ digit prefix); the only one if none."""
        models = self.models()
        if not name:
            if len(models) == 1:
                return models[0]
            if not models:
                raise ApiError(Problem.UNAVAILABLE, "no member of the mesh holds a model yet")
            raise ApiError(Problem.BAD_REQUEST, "the mesh holds several models; name one of: "
                                                + ", ".join(m.name for m in models), param="model")
        wanted = name.strip().lower()
        for m in models:
            # a model with no file name told ("") is not named by a request's blank one
            if wanted in {m.name.lower(), m.file.lower(), m.model} - {""} or \
                    (len(wanted) >= MIN_DIGEST_PREFIX and m.model.startswith(wanted)):
                return m
        known = ", ".join(f"{m.name} ({m.model[:12]})" for m in models) or "none yet"
        raise ApiError(Problem.NOT_FOUND, f"the mesh has no model {name!r}; it has: {known}", param="model")

    # ----- asking

    async def ask(self, model: ModelCoverage, request: AskRequest, dialect: str, stream: bool,
                  on_token: OnToken | None = None, result: AskResult | None = None) -> AskResult:
        """One ask through the mesh, recorded while it runs; every failure an ApiError.
        `result` fills as the ask runs (the prompt's tokens come before the first new one)."""
        if len(self.asking) >= self.max_asks:
            raise ApiError(Problem.BUSY, f"this front door runs {self.max_asks} requests at once; try again shortly",
                           retry_after=1.0)
        asking = Asking(next(self._ids), model.model, dialect, stream, time.time(), result or AskResult())
        self.asking[asking.id] = asking
        # what stays if the ask is cancelled: its client went away (or the server is stopping)
        outcome = "cancelled"
        error: ApiError | None = None
        async def take(token: int, piece: bytes) -> None:
            if asking.result.withdrawn:
                # a spot check caught a stage lying after the client had part of its text, and the answer
                # given again differs from it, which a stream cannot take back: the request fails, saying
                # so, rather than the answer start again in it
                raise AnswerWithdrawn(f"a stage was caught lying after {asking.result.withdrawn} token(s) of "
                                      "this answer were sent; they are withdrawn: ask again")
            await deliver(on_token, token, piece)

        try:
            answered = await self.mesh.ask(model.model, request, None if on_token is None else take, asking.result)
            outcome = "counted" if request.count_only else "answered"
            return answered
        except ProtocolError as exc:
            error = api_error(model, exc)
        except ClientStopped as exc:
            error = ApiError(Problem.UNAVAILABLE, f"the mesh could not answer: {exc}")
        except RouteError as exc:
            error = ApiError(Problem.UNAVAILABLE, f"{model.name} cannot be served: {exc}")
        except Unverified as exc:
            # the operator's policy (join --require-verified): no answer rather than an unchecked one
            error = ApiError(Problem.UNAVAILABLE, f"the answer is withheld: {exc.why}")
        except trio.TooSlowError:
            error = ApiError(Problem.TIMEOUT, "the mesh did not answer in time")
        finally:
            del self.asking[asking.id]
            share = None if request.payer is None else request.payer.share / SHARE_WHOLE
            self.metrics.asked(dialect, asking.result, outcome if error is None else error.problem.name.lower(),
                               KEY_USED.get(), share)
        # the operator's record of what the client is told
        log.log(logging.WARNING if error.status >= 500 else logging.INFO, "%s request failed (%d): %s", dialect,
                error.status, error.message)
        raise error


def api_error(model: ModelCoverage, exc: ProtocolError) -> ApiError:
    """A mesh failure as the HTTP client should see it."""
    retry = None if exc.retry_after_ms is None else exc.retry_after_ms / 1000
    if exc.code is ErrorCode.NOT_FOUND:
        # the route finder's word: no route, and (from the coverage code) why
        return ApiError(Problem.UNAVAILABLE, f"{model.name} is not covered: {exc.message}", retry)
    if over_budget(exc):
        return ApiError(Problem.BAD_REQUEST, exc.message)
    if exc.code is ErrorCode.OVERLOADED:
        return ApiError(Problem.BUSY, f"the mesh is busy: {exc.message}", retry)
    if exc.code is ErrorCode.BAD_REQUEST:
        return ApiError(Problem.BAD_REQUEST, exc.message)
    if exc.code is ErrorCode.DEADLINE_EXCEEDED:
        return ApiError(Problem.TIMEOUT, f"the mesh did not answer in time: {exc.message}")
    return ApiError(Problem.UNAVAILABLE, f"the mesh could not answer: {exc.code.value}: {exc.message}", retry)
