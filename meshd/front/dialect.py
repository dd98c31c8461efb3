"""What the two dialects share: the answer's text and why it ended, sampling from a request, endpoint wrapping."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import Response

from meshd.client.ask import AskRequest, AskResult
from meshd.client.chat import Rendered
from meshd.front.door import ApiError, FrontDoor
from meshd.front.http import unless_gone
from meshd.front.text import AnswerText
from wire.meshrpc import ModelCoverage
from wire.stage import Sampling

# Most new tokens one request may ask for (the stages' session budgets are the real bound).
MAX_NEW_TOKENS = 1 << 20
# A stop string longer than this is not one a client means.
MAX_STOP_CHARS = 256


# The response header that says whether a replica checked every range of the answer: "true" or "false"
VERIFIED_HEADER = "x-meshd-verified"
# on an answer a failover carried onto other numerics (another engine build or backend): after how many
# tokens, comma-separated (the same as the "meshd" field's crossed_numerics_at); absent where it did not
CROSSED_HEADER = "x-meshd-crossed-numerics"


@dataclass(frozen=True)
class Answer:
    text: str
    # "eog" (the model ended its turn), "stop" (a stop string), "max_tokens"
    reason: str
    stop: str | None
    prompt_tokens: int
    new_tokens: int
    # what output verification found (the "meshd" field of either dialect's answer)
    verification: dict[str, Any]
    # prompt tokens taken from the stages' prefix caches (meshd.client.prefix), not run again
    cached_tokens: int = 0
    # a chat rendered with the model's template: how its text parses into content and tool calls
    rendered: Rendered | None = None
    # with logprobs asked: each new token's piece, log-probability and the likeliest tokens'
    logprobs: list[tuple[bytes, float, list[tuple[int, float, bytes]]]] = field(default_factory=list)

    @property
    def headers(self) -> dict[str, str]:
        return answer_headers([self])


def answer_headers(answers: list[Answer]) -> dict[str, str]:
    """The headers of a non-streamed answer of one or more choices: verified only if all are, and
    where any crossed numerics (a streamed answer says both in its last event's "meshd" field alone)."""
    headers = {VERIFIED_HEADER: "true" if all(a.verification["verified"] for a in answers) else "false"}
    crossed = sorted({at for a in answers for at in a.verification["crossed_numerics_at"]})
    if crossed:
        headers[CROSSED_HEADER] = ",".join(map(str, crossed))
    return headers


def verification(result: AskResult) -> dict[str, Any]:
    """The answer's verification as a client reads it: verified (a replica checked every range to the
    end), whether spot checks ran at all, each range left unchecked, from where and why, and where a
    failover moved the answer onto other numerics (another engine build or backend)."""
    return {"verified": result.verified, "checked": bool(result.checked),
            "unchecked": [note.as_json() for note in result.unverified],
            "crossed_numerics_at": list(result.crossed_numerics_at)}


def whole_answer(result: AskResult, stops: list[str]) -> Answer:
    text = AnswerText(stops)
    for piece in result.pieces:
        text.feed(piece)
    text.finish()
    return answer_of(result, text)


async def ask_whole(front: FrontDoor, request: Request, model: ModelCoverage, ask: AskRequest,
                    dialect: str) -> Answer | None:
    """The whole answer of a request that is not streamed; None if its client hung up first."""
    result = await unless_gone(request.receive, lambda: front.ask(model, ask, dialect, False))
    return None if result is None else whole_answer(result, ask.stop)


# nginx's "client closed request": nobody reads it, but the access log of a proxy in front may
CLIENT_GONE = 499


def answer_of(result: AskResult, text: AnswerText) -> Answer:
    reason = "stop" if text.stopped_by is not None else (result.reason or "eog")
    return Answer(text.text, reason, text.stopped_by, len(result.prompt_tokens), len(result.tokens),
                  verification(result), result.cached_tokens, result.rendered, result.logprobs)


def sampling(temperature: float, top_p: float | None, top_k: int | None, seed: int | None) -> Sampling:
    """A request's sampling; without a seed, a fresh one (each answer at a temperature differs, as clients expect)."""
    return Sampling(temperature=temperature, top_p=1.0 if top_p is None else top_p, top_k=top_k or 0,
                    seed=secrets.randbits(32) if seed is None else seed & 0xFFFF_FFFF)


Endpoint = Callable[[Request], Awaitable[Response]]


def guarded(front: FrontDoor, endpoint: Endpoint, error_response: Callable[[ApiError], Response]) -> Endpoint:
    """`endpoint` behind the key check, with every ApiError answered in the dialect's shape."""
    async def run(request: Request) -> Response:
        try:
            front.check_key(request.headers.get("authorization"), request.headers.get("x-api-key"))
            return await endpoint(request)
        except ApiError as exc:
            return error_response(exc)
    return run


async def each_of(n: int, work: Callable[[int], Awaitable[None]]) -> None:
    """``work(0)`` .. ``work(n - 1)`` at once (a request's n choices); the first to fail fails them all,
    with its own error (an ApiError stays one, not a group)."""
    if n == 1:
        await work(0)
        return
    try:
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(work, i)
    except BaseExceptionGroup as group:
        first: BaseException = group
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None

