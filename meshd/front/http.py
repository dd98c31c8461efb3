"""What both dialects do with HTTP: read a bounded JSON body into a pydantic model, and stream an ask as SSE.

The stream is sse-starlette's `EventSourceResponse`, which runs under trio (it works through
anyio; only its uvicorn shutdown watcher needs asyncio, and it skips that when there is none):
the ask runs in a task of the response itself, so a client that goes away cancels the ask,
and the asker's release path frees the session's KV on every stage.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import pydantic
import trio
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from meshd.front.door import ApiError, Problem

# A chat of a long context is well under this; larger is not a request we can serve.
MAX_BODY_BYTES = 4 << 20
# A client gets this long to send its request body (a slow trickle holds a connection and a task).
BODY_SECONDS = 30.0
# Events an ask may run ahead of a slow client before its tokens wait.
STREAM_BUFFER = 64

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)
T = TypeVar("T")


async def read_body(request: Request, limit: int = MAX_BODY_BYTES, seconds: float = BODY_SECONDS) -> bytes:
    """The request body, refused once it passes `limit` (by its Content-Length before reading, or as it comes)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(Problem.TOO_LARGE, f"the request body is {declared} bytes; at most {limit} are accepted")
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(seconds) as slow:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(Problem.TOO_LARGE, f"the request body exceeds {limit} bytes")
            chunks.append(chunk)
    if slow.cancelled_caught:
        raise ApiError(Problem.BAD_REQUEST, f"the request body did not arrive within {seconds:g} s")
    return b"".join(chunks)


async def read_json(request: Request, model: type[ModelT]) -> ModelT:
    body = await read_body(request)
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        raise invalid(exc) from None


async def unless_gone(request: Request, work: Callable[[], Awaitable[T]]) -> T | None:
    """`work()`'s result, or None (its work cancelled) if the client hangs up first: an answer
    nobody waits for would hold its sessions on every stage to the end."""
    done: list[T] = []
    failed: list[ApiError] = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            try:
                done.append(await work())
            except ApiError as exc:  # raised below, not as a group of one
                failed.append(exc)
            nursery.cancel_scope.cancel()

        async def watch() -> None:
            # the body was read: what comes now is the client's hang-up
            while (await request.receive())["type"] != "http.disconnect":
                pass
            nursery.cancel_scope.cancel()

        nursery.start_soon(run)
        nursery.start_soon(watch)
    if failed:
        raise failed[0]
    return done[0] if done else None


def invalid(exc: pydantic.ValidationError) -> ApiError:
    """The first thing wrong with a request, as one line that names the field."""
    error = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in error["loc"])
    if error["type"] == "json_invalid":
        return ApiError(Problem.BAD_REQUEST, f"the request body is not JSON: {error['msg']}")
    return ApiError(Problem.BAD_REQUEST, f"{where}: {error['msg']}" if where else error["msg"], param=where or None)


Emit = Callable[[ServerSentEvent], Awaitable[None]]
Events = Callable[[Emit], Awaitable[None]]


class AskStream(Response):
    """An SSE response whose events `produce` emits, run as a task of the response.

    Nothing is sent until the first event: an ask that fails before it (the model not
    covered, the mesh busy) gets the dialect's error response, with its status, instead;
    one that fails later ends the stream with the dialect's error event. When the client
    goes away the response ends, and `produce` (the ask) is cancelled.
    """

    def __init__(self, produce: Events, error_response: Callable[[ApiError], Response],
                 error_event: Callable[[ApiError], ServerSentEvent]) -> None:
        super().__init__()
        self._produce = produce
        self._error_response = error_response
        self._error_event = error_event

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender, events = trio.open_memory_channel[ServerSentEvent](STREAM_BUFFER)
        failure: list[ApiError] = []
        emitted = False

        async def emit(event: ServerSentEvent) -> None:
            nonlocal emitted
            emitted = True
            await sender.send(event)

        async def produce() -> None:
            async with sender:
                try:
                    await self._produce(emit)
                except ApiError as exc:
                    if not emitted:
                        failure.append(exc)
                    else:
                        await sender.send(self._error_event(exc))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            first = await _first_event(events, receive)
            if first is None:
                # the client left while the prompt was read
                nursery.cancel_scope.cancel()
                return
            response: Response
            if isinstance(first, trio.EndOfChannel):
                response = self._error_response(
                    failure[0] if failure else ApiError(Problem.INTERNAL, "the answer ended before it began"))
            else:
                response = EventSourceResponse(_chain(first, events), ping=15)
            await response(scope, receive, send)
            nursery.cancel_scope.cancel()


async def _first_event(events: trio.MemoryReceiveChannel[ServerSentEvent], receive: Receive) \
        -> ServerSentEvent | trio.EndOfChannel | None:
    """The first event, or the end of the events; None if the client disconnects first."""
    got: list[ServerSentEvent | trio.EndOfChannel] = []
    left = False
    async with trio.open_nursery() as nursery:

        async def first() -> None:
            try:
                got.append(await events.receive())
            except trio.EndOfChannel as end:
                got.append(end)
            nursery.cancel_scope.cancel()

        async def disconnect() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True
            nursery.cancel_scope.cancel()

        nursery.start_soon(first)
        nursery.start_soon(disconnect)
    return None if left or not got else got[0]


async def _chain(first: ServerSentEvent, rest: trio.MemoryReceiveChannel[ServerSentEvent]) \
        -> AsyncIterator[ServerSentEvent]:
    yield first
    async for event in rest:
        yield event


def retry_headers(exc: ApiError) -> dict[str, str]:
    return {} if exc.retry_after is None else {"retry-after": str(max(1, math.ceil(exc.retry_after)))}
