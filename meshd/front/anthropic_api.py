"""Anthropic's dialect: /v1/messages, streaming (message_start, content_block_start/delta/stop,
message_delta, message_stop) and not, with its error shape; and its shape of /v1/models for
clients that send `anthropic-version` (OpenAI's clients get OpenAI's)."""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from meshd.client.ask import AskRequest, AskResult
from meshd.front.dialect import CLIENT_GONE, MAX_NEW_TOKENS, MAX_STOP_CHARS, Answer, answer_of, ask_whole, guarded, sampling
from meshd.front.door import ApiError, FrontDoor, Problem
from meshd.front.http import AskStream, Emit, read_json, retry_headers
from meshd.front.text import AnswerText
from wire.meshrpc import ModelCoverage

DIALECT = "anthropic"

ERROR_TYPES = {
    Problem.BAD_REQUEST: "invalid_request_error",
    Problem.UNAUTHORIZED: "authentication_error",
    Problem.FORBIDDEN: "permission_error",
    Problem.NOT_FOUND: "not_found_error",
    Problem.TOO_LARGE: "request_too_large",
    Problem.UNSUPPORTED_MEDIA: "invalid_request_error",
    Problem.BUSY: "rate_limit_error",
    Problem.INTERNAL: "api_error",
    Problem.UNAVAILABLE: "overloaded_error",
    Problem.TIMEOUT: "timeout_error",
}
# "budget": a stage's session budget ended the answer, a limit as max_tokens is
STOP_REASONS = {"eog": "end_turn", "stop": "stop_sequence", "max_tokens": "max_tokens", "budget": "max_tokens"}

Content = Annotated[str, Field(max_length=1 << 20)]


def error_body(exc: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES[exc.problem], "message": exc.message}}


def error_response(exc: ApiError) -> Response:
    return JSONResponse(error_body(exc), exc.status, headers=retry_headers(exc))


def error_event(exc: ApiError) -> ServerSentEvent:
    return ServerSentEvent(json.dumps(error_body(exc)), event="error")


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Content


Blocks = Annotated[list[TextBlock], Field(max_length=256)]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: Content | Blocks


class Thinking(BaseModel):
    """No thinking budget can be honoured; "adaptive" leaves it to the model, which here thinks aloud or not."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["disabled", "adaptive"]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Annotated[str, Field(max_length=256)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)]
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    system: Content | Blocks | None = None
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                              Field(max_length=16)] | None = None
    # newer clients send these only through extra_body; older ones and plain HTTP still do
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_NEW_TOKENS)] | None = None
    stream: bool = False
    tools: Annotated[list[Any], Field(max_length=0)] | None = None
    thinking: Thinking | None = None


def text_of(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def usage(answer: Answer) -> dict[str, int]:
    return {**input_usage(answer.prompt_tokens, answer.cached_tokens), "output_tokens": answer.new_tokens}


def input_usage(prompt_tokens: int, cached_tokens: int) -> dict[str, int]:
    """As Anthropic's: input_tokens are those not read from the cache (the three add up to the prompt)."""
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens}


def routes(front: FrontDoor) -> list[BaseRoute]:
    def ask_request(body: MessagesRequest) -> AskRequest:
        system = [] if body.system is None else [{"role": "system", "content": text_of(body.system)}]
        return AskRequest(messages=system + [{"role": m.role, "content": text_of(m.content)} for m in body.messages],
                          max_tokens=body.max_tokens, stop=list(body.stop_sequences or []),
                          sampling=sampling(1.0 if body.temperature is None else body.temperature,
                                            body.top_p, body.top_k, None))

    def stream(model: ModelCoverage, request: AskRequest, message_id: str) -> Response:
        async def produce(emit: Emit) -> None:
            text = AnswerText(request.stop)
            result = AskResult()
            started = False

            async def event(kind: str, data: dict[str, Any]) -> None:
                await emit(ServerSentEvent(json.dumps({"type": kind, **data}), event=kind))

            async def send(delta: str) -> None:
                nonlocal started
                if not started:
                    started = True
                    opening = message(message_id, model, [], None, None)
                    opening["usage"] = {**input_usage(len(result.prompt_tokens), result.cached_tokens),
                                        "output_tokens": 0}
                    await event("message_start", {"message": opening})
                    await event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                if delta:
                    await event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": delta}})

            async def on_token(token: int, piece: bytes) -> None:
                await send(text.feed(piece))

            await front.ask(model, request, DIALECT, True, on_token, result)
            await send(text.finish())
            answer = answer_of(result, text)
            await event("content_block_stop", {"index": 0})
            await event("message_delta", {"delta": {"stop_reason": STOP_REASONS[answer.reason],
                                                    "stop_sequence": answer.stop}, "usage": usage(answer),
                                          "meshd": answer.verification})
            await event("message_stop", {})

        return AskStream(produce, error_response, error_event)

    async def messages(request: Request) -> Response:
        body = await read_json(request, MessagesRequest)
        model = front.resolve(body.model)
        ask = ask_request(body)
        message_id = f"msg_{secrets.token_hex(12)}"
        if body.stream:
            return stream(model, ask, message_id)
        answer = await ask_whole(front, request, model, ask, DIALECT)
        if answer is None:
            return Response(status_code=CLIENT_GONE)
        reply = message(message_id, model, [{"type": "text", "text": answer.text}], STOP_REASONS[answer.reason],
                        answer.stop)
        reply["usage"] = usage(answer)
        reply["meshd"] = answer.verification
        return JSONResponse(reply, headers=answer.headers)

    return [Route("/v1/messages", guarded(front, messages, error_response), methods=["POST"])]


def message(message_id: str, model: ModelCoverage, content: list[dict[str, str]], stop_reason: str | None,
            stop_sequence: str | None) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model.name, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence}


def model_list(models: list[ModelCoverage]) -> dict[str, Any]:
    """/v1/models as Anthropic's clients read it."""
    data = [{"type": "model", "id": m.name, "display_name": m.name, "created_at": "1970-01-01T00:00:00Z"}
            for m in models]
    return {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}
