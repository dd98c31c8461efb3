"""OpenAI's Responses API: POST /v1/responses, streamed as its typed events or whole.

Stateless, as a mesh is: an answer is not stored, so `previous_response_id` and `conversation`
are refused by name, as are fields that would change the answer in a way this endpoint does not
honour (tools, a text format other than plain text). `input` is a string or a list of messages;
`instructions` is the system message. Errors are OpenAI's error body, and a stream that fails
after it began ends with an `error` event (the official client raises it).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from meshd.client.ask import AskRequest, AskResult
from meshd.front.dialect import CLIENT_GONE, MAX_NEW_TOKENS, Answer, answer_of, ask_whole, guarded, sampling
from meshd.front.door import ApiError, FrontDoor, Problem
from meshd.front.http import AskStream, Emit, read_json
from meshd.front.openai_api import Content, error_body, error_response
from meshd.front.text import AnswerText
from wire.meshrpc import ModelCoverage

DIALECT = "responses"


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # what a message's parts are called on the way in, and (an earlier turn's answer) on the way out
    type: Literal["input_text", "output_text"]
    text: Content


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Content | Annotated[list[InputText], Field(max_length=256)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Annotated[str, Field(max_length=256)] | None = None
    input: Content | Annotated[list[InputMessage], Field(min_length=1, max_length=4096)]
    instructions: Content | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    # not OpenAI's, but its chat endpoint's: a seeded answer is the same on any route
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 63)] | None = None
    stream: bool = False
    # an answer is not kept: `store` may be asked for, but nothing can come back by its id
    store: bool | None = None
    previous_response_id: None = None
    conversation: None = None
    tools: Annotated[list[Any], Field(max_length=0)] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    text: TextOptions | None = None

    def messages(self) -> list[dict[str, str]]:
        said = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else \
            [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.input]
        return ([{"role": "system", "content": self.instructions}] if self.instructions else []) + said


class Reply:
    """One answer's ids and the Response object around its text, as the API shapes it."""

    def __init__(self, model: ModelCoverage, body: ResponsesRequest) -> None:
        self.id = f"resp_{secrets.token_hex(12)}"
        self.item_id = f"msg_{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.model = model
        self.body = body

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": []}

    def item(self, text: str | None) -> dict[str, Any]:
        """The answer's message item: without text, one still being written."""
        return {"id": self.item_id, "type": "message", "role": "assistant",
                "status": "in_progress" if text is None else "completed",
                "content": [] if text is None else [self.part(text)]}

    def response(self, answer: Answer | None) -> dict[str, Any]:
        """The Response object: without an answer, one in progress."""
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model.name,
            "status": "in_progress", "output": [], "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
            "instructions": self.body.instructions, "max_output_tokens": self.body.max_output_tokens,
            "temperature": self.body.temperature, "top_p": self.body.top_p, "text": {"format": {"type": "text"}},
            "incomplete_details": None, "error": None, "usage": None}
        if answer is not None:
            cut = answer.reason in ("max_tokens", "budget")
            out |= {"status": "incomplete" if cut else "completed",
                    "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                    "output": [self.item(answer.text)], "usage": usage(answer), "meshd": answer.verification}
        return out


def usage(answer: Answer) -> dict[str, Any]:
    return {"input_tokens": answer.prompt_tokens, "input_tokens_details": {"cached_tokens": answer.cached_tokens},
            "output_tokens": answer.new_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": answer.prompt_tokens + answer.new_tokens}


class Events:
    """The stream's typed events, each numbered in order (its sequence_number)."""

    def __init__(self, emit: Emit) -> None:
        self._emit = emit
        self._n = 0

    async def __call__(self, kind: str, **fields: Any) -> None:
        data = {"type": kind, "sequence_number": self._n, **fields}
        self._n += 1
        await self._emit(ServerSentEvent(json.dumps(data), event=kind))


def error_event(exc: ApiError) -> ServerSentEvent:
    """The stream's end when the ask fails: the API's "error" event, which the official client raises
    as an APIError when its data also carries OpenAI's error body (under "error")."""
    body = error_body(exc)
    err = body["error"]
    return ServerSentEvent(json.dumps({"type": "error", "code": err["code"] or err["type"], "message": err["message"],
                                       "param": err["param"], "sequence_number": 0, **body}), event="error")


def routes(front: FrontDoor) -> list[BaseRoute]:
    def stream(model: ModelCoverage, ask: AskRequest, reply: Reply) -> Response:
        async def produce(emit: Emit) -> None:
            events = Events(emit)
            text = AnswerText(ask.stop)
            result = AskResult()
            where = {"item_id": reply.item_id, "output_index": 0, "content_index": 0}
            started = False

            async def opened() -> None:
                nonlocal started
                if not started:
                    started = True
                    await events("response.created", response=reply.response(None))
                    await events("response.in_progress", response=reply.response(None))
                    await events("response.output_item.added", output_index=0, item=reply.item(None))
                    await events("response.content_part.added", **where, part=reply.part(""))

            async def send(delta: str) -> None:
                await opened()
                if delta:
                    await events("response.output_text.delta", **where, delta=delta, logprobs=[])

            async def on_token(token: int, piece: bytes) -> None:
                await send(text.feed(piece))

            await front.ask(model, ask, DIALECT, True, on_token, result)
            await send(text.finish())
            answer = answer_of(result, text)
            await events("response.output_text.done", **where, text=answer.text, logprobs=[])
            await events("response.content_part.done", **where, part=reply.part(answer.text))
            await events("response.output_item.done", output_index=0, item=reply.item(answer.text))
            done = reply.response(answer)
            await events("response.completed" if done["status"] == "completed" else "response.incomplete",
                         response=done)

        return AskStream(produce, error_response, error_event)

    async def create(request: Request) -> Response:
        body = await read_json(request, ResponsesRequest)
        model = front.resolve(body.model)
        ask = AskRequest(messages=body.messages(), max_tokens=body.max_output_tokens or front.default_max_tokens,
                         sampling=sampling(1.0 if body.temperature is None else body.temperature, body.top_p, None,
                                           body.seed))
        reply = Reply(model, body)
        if body.stream:
            return stream(model, ask, reply)
        answer = await ask_whole(front, request, model, ask, DIALECT)
        if answer is None:
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(reply.response(answer), headers=answer.headers)

    async def not_kept(request: Request) -> Response:
        raise ApiError(Problem.NOT_FOUND, "this mesh keeps no response: each is answered and forgotten")

    return [Route("/v1/responses", guarded(front, create, error_response), methods=["POST"]),
            Route("/v1/responses/{response_id}", guarded(front, not_kept, error_response), methods=["GET", "DELETE"])]
