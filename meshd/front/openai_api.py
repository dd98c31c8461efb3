"""OpenAI's dialect: /v1/chat/completions, /v1/completions and /v1/models, streaming and not.

Requests are checked by pydantic models before anything reaches the mesh; fields a client
may send that change nothing here (user, metadata, penalties at their defaults) are accepted,
fields that would change the answer in a way the mesh cannot honour (n > 1, tools, logprobs)
are refused by name.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from meshd.client.ask import AskRequest, AskResult
from meshd.front import anthropic_api
from meshd.front.dialect import CLIENT_GONE, MAX_NEW_TOKENS, MAX_STOP_CHARS, Answer, answer_of, ask_whole, guarded, sampling
from meshd.front.door import ApiError, FrontDoor, Problem
from meshd.front.http import AskStream, Emit, read_json, retry_headers
from meshd.front.text import AnswerText
from wire.meshrpc import ModelCoverage

DIALECT = "openai"
# As OpenAI's: a completion without max_tokens gets 16 new tokens.
COMPLETIONS_MAX_TOKENS = 16

ERROR_TYPES = {
    Problem.BAD_REQUEST: "invalid_request_error",
    Problem.UNAUTHORIZED: "authentication_error",
    Problem.FORBIDDEN: "permission_error",
    Problem.NOT_FOUND: "not_found_error",
    Problem.TOO_LARGE: "invalid_request_error",
    Problem.UNSUPPORTED_MEDIA: "invalid_request_error",
    Problem.BUSY: "rate_limit_error",
    Problem.INTERNAL: "server_error",
    Problem.UNAVAILABLE: "service_unavailable",
    Problem.TIMEOUT: "timeout",
}
ERROR_CODES = {Problem.UNAUTHORIZED: "invalid_api_key"}

Content = Annotated[str, Field(max_length=1 << 20)]
Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


def error_body(exc: ApiError) -> dict[str, Any]:
    # a model that is not there is OpenAI's "model_not_found"; a path that is not there is no model's
    missing_model = exc.problem is Problem.NOT_FOUND and exc.param == "model"
    return {"error": {"message": exc.message, "type": ERROR_TYPES[exc.problem], "param": exc.param,
                      "code": "model_not_found" if missing_model else ERROR_CODES.get(exc.problem)}}


def error_response(exc: ApiError) -> Response:
    return JSONResponse(error_body(exc), exc.status, headers=retry_headers(exc))


def error_event(exc: ApiError) -> ServerSentEvent:
    # OpenAI's clients raise an APIError for a streamed event that carries "error"
    return ServerSentEvent(json.dumps(error_body(exc)))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class CommonRequest(BaseModel):
    """Fields both endpoints take."""

    model_config = ConfigDict(extra="ignore")

    model: Annotated[str, Field(max_length=256)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    # llama-server's extension, kept for its clients
    top_k: Annotated[int, Field(ge=0, le=MAX_NEW_TOKENS)] | None = None
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 63)] | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    logprobs: Literal[False] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class TextPart(BaseModel):
    type: Literal["text"]
    text: Content


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # "developer" is what newer clients call the system message
    role: Literal["system", "developer", "user", "assistant"]
    content: Content | Annotated[list[TextPart], Field(max_length=256)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(CommonRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)] | None = None
    tools: Annotated[list[Any], Field(max_length=0)] | None = None
    tool_choice: Literal["none"] | None = None
    top_logprobs: Literal[0] | None = None

    @model_validator(mode="after")
    def _one_budget(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None and \
                self.max_tokens != self.max_completion_tokens:
            raise ValueError("give max_completion_tokens or max_tokens, not both with different values")
        return self


class CompletionRequest(CommonRequest):
    prompt: Content | Annotated[list[Content], Field(min_length=1, max_length=1)]
    echo: Literal[False] = False
    suffix: Literal[""] | None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def usage(answer: Answer) -> dict[str, Any]:
    # as OpenAI's: prompt_tokens counts the cached ones too, and the details say how many they were
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.new_tokens,
            "total_tokens": answer.prompt_tokens + answer.new_tokens,
            "prompt_tokens_details": {"cached_tokens": answer.cached_tokens}}


def finish_reason(answer: Answer) -> str:
    # a stage's session budget ("budget") is a length limit too
    return "length" if answer.reason in ("max_tokens", "budget") else "stop"


def routes(front: FrontDoor) -> list[BaseRoute]:
    def ask_request(body: CommonRequest, max_tokens: int | None, default_max: int, **prompt: Any) -> AskRequest:
        return AskRequest(**prompt, max_tokens=max_tokens or default_max, stop=body.stops(),
                          sampling=sampling(1.0 if body.temperature is None else body.temperature,
                                            body.top_p, body.top_k, body.seed))

    def stream(model: ModelCoverage, request: AskRequest, body: CommonRequest, chunk: Chunk) -> Response:
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        async def produce(emit: Emit) -> None:
            text = AnswerText(request.stop)
            result = AskResult()
            started = False

            async def send(delta: str) -> None:
                nonlocal started
                if not started and chunk.chat:
                    await emit(chunk.event({"role": "assistant", "content": ""}, None, include_usage))
                started = True
                if delta:
                    await emit(chunk.event({"content": delta}, None, include_usage))

            async def on_token(token: int, piece: bytes) -> None:
                await send(text.feed(piece))

            await front.ask(model, request, DIALECT, True, on_token, result)
            await send(text.finish())
            answer = answer_of(result, text)
            await emit(chunk.event({}, finish_reason(answer), include_usage, answer.verification))
            if include_usage:
                await emit(chunk.usage_event(answer))
            await emit(ServerSentEvent("[DONE]"))

        return AskStream(produce, error_response, error_event)

    async def respond(request: Request, body: CommonRequest, model: ModelCoverage, ask: AskRequest, chunk: Chunk,
                      kind: str, content: Callable[[Answer], dict[str, Any]]) -> Response:
        """A streamed answer as chunks, or the whole one as one `kind` object, its choice's `content` added."""
        if body.stream:
            return stream(model, ask, body, chunk)
        answer = await ask_whole(front, request, model, ask, DIALECT)
        if answer is None:
            return Response(status_code=CLIENT_GONE)
        return JSONResponse({
            "id": chunk.id, "object": kind, "created": chunk.created, "model": model.name,
            "system_fingerprint": model.model[:12],
            "choices": [{"index": 0, **content(answer), "logprobs": None, "finish_reason": finish_reason(answer)}],
            "usage": usage(answer), "meshd": answer.verification}, headers=answer.headers)

    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, ChatRequest)
        model = front.resolve(body.model)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        ask = ask_request(body, body.max_completion_tokens or body.max_tokens, front.default_max_tokens,
                          messages=messages)
        return await respond(request, body, model, ask, Chunk("chat.completion.chunk", model), "chat.completion",
                             lambda answer: {"message": {"role": "assistant", "content": answer.text}})

    async def completions(request: Request) -> Response:
        body = await read_json(request, CompletionRequest)
        model = front.resolve(body.model)
        ask = ask_request(body, body.max_tokens, COMPLETIONS_MAX_TOKENS, text=body.text())
        return await respond(request, body, model, ask, Chunk("text_completion", model), "text_completion",
                             lambda answer: {"text": answer.text})

    async def models(request: Request) -> Response:
        if "anthropic-version" in request.headers:
            return JSONResponse(anthropic_api.model_list(front.models()))
        return JSONResponse({"object": "list", "data": [model_entry(m) for m in front.models()]})

    return [
        Route("/v1/chat/completions", guarded(front, chat_completions, error_response), methods=["POST"]),
        Route("/v1/completions", guarded(front, completions, error_response), methods=["POST"]),
        Route("/v1/models", guarded(front, models, error_response), methods=["GET"]),
    ]


def model_entry(m: ModelCoverage) -> dict[str, Any]:
    """A model as OpenAI lists it, with what the mesh knows of its coverage."""
    return {"id": m.name, "object": "model", "created": 0, "owned_by": "meshd", "digest": m.model,
            "coverage": {"covered": m.covered_layers == m.n_layers, "covered_layers": m.covered_layers,
                         "n_layers": m.n_layers, "replicas": m.replicas, "stages": list(m.assigned),
                         "reason": m.reason}}


class Chunk:
    """The streamed chunks of one answer, in OpenAI's shape for chat (delta) or completions (text)."""

    def __init__(self, kind: str, model: ModelCoverage) -> None:
        self.kind = kind
        self.chat = kind == "chat.completion.chunk"
        prefix = "chatcmpl" if self.chat else "cmpl"
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.model = model

    def event(self, delta: dict[str, str], finish: str | None, include_usage: bool,
              verification: dict[str, Any] | None = None) -> ServerSentEvent:
        """A chunk of new text (or, with `finish`, the end): chat's `delta`, or a completion's `text`;
        the last carries the answer's `verification` (its "meshd" field), known only once it is in."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta.get("content", "")
        data: dict[str, Any] = {"id": self.id, "object": self.kind, "created": self.created, "model": self.model.name,
                                "system_fingerprint": self.model.model[:12], "choices": [choice]}
        if include_usage:
            # as OpenAI's: with include_usage every chunk has a usage field, null but in the last
            data["usage"] = None
        if verification is not None:
            data["meshd"] = verification
        return ServerSentEvent(json.dumps(data))

    def usage_event(self, answer: Answer) -> ServerSentEvent:
        return ServerSentEvent(json.dumps({
            "id": self.id, "object": self.kind, "created": self.created, "model": self.model.name,
            "system_fingerprint": self.model.model[:12], "choices": [], "usage": usage(answer)}))
