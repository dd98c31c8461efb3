"""OpenAI's dialect: /v1/chat/completions, /v1/completions and /v1/models, streaming and not.

Requests are checked by pydantic models before anything reaches the mesh; fields a client
may send that change nothing here (user, metadata, penalties at their defaults) are accepted,
fields that would change the answer in a way the mesh cannot honour (a completion's echo, suffix,
best_of) are refused by name; n > 1 runs n sessions. Chats are rendered with the model's own template;
tools and response_format are enforced by a grammar at the tail (meshd.client.chat). Log-probabilities
come from the tail: chat's shape, and completions' older one (tokens, token_logprobs, top_logprobs,
text_offset).
"""

from __future__ import annotations

import codecs
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
from meshd.client.chat import ChatRequest as ChatTurn
from meshd.front import anthropic_api
from meshd.front.dialect import (
    CLIENT_GONE,
    MAX_NEW_TOKENS,
    MAX_STOP_CHARS,
    Answer,
    answer_headers,
    answer_of,
    ask_whole,
    each_of,
    guarded,
    sampling,
)
from meshd.front.door import ApiError, FrontDoor, Problem
from meshd.front.http import AskStream, Emit, read_json, retry_headers
from meshd.front.text import AnswerText
from meshd.front.tools import Delta, DeltaStream, parse_answer
from wire.meshrpc import ModelCoverage
from wire.stage import MAX_TOP_LOGPROBS

DIALECT = "openai"
# The most choices (n) one request may ask for: each is a session on the route's stages.
MAX_CHOICES = 8
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
    # n choices: n sessions of the same prompt (seeded seed, seed + 1, ...)
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class TextPart(BaseModel):
    type: Literal["text"]
    text: Content


Name = Annotated[str, Field(min_length=1, max_length=256)]
# a tool's or a schema's JSON: bounded as the request is (read_json), its depth by pydantic's parse
Schema = dict[str, Any]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Name
    arguments: Content


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: Annotated[str, Field(max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # "developer" is what newer clients call the system message
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # an assistant's turn that only calls tools has no content
    content: Content | Annotated[list[TextPart], Field(max_length=256)] | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=128)] | None = None
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def as_chat(self) -> dict[str, Any]:
        """The message as llama.cpp's common/chat reads OpenAI's."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Name
    description: Annotated[str, Field(max_length=1 << 16)] = ""
    parameters: Schema | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: Name


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Annotated[str, Field(max_length=256)] = "response"
    # OpenAI's clients send the schema as "schema"
    schema_: Schema = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class ChatRequest(CommonRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # each new token's log-probability, and the likeliest tokens' at each position
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # llama-server's extension: the template's own variables (enable_thinking, ...)
    chat_template_kwargs: dict[str, Any] | None = None

    def chat(self) -> ChatTurn:
        """The request as the asker renders it with the model's template."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        choice = self.tool_choice if isinstance(self.tool_choice, str) else "auto"
        if isinstance(self.tool_choice, NamedToolChoice):
            # a named function: a call is required, and only that tool is offered
            wanted = self.tool_choice.function.name
            tools = [t for t in tools if t["function"]["name"] == wanted]
            if not tools:
                raise ApiError(Problem.BAD_REQUEST, f"tool_choice names {wanted!r}, which is not in tools",
                               param="tool_choice")
            choice = "required"
        if choice != "none" and self.tools is not None and not tools:
            choice = "none"
        schema = None
        if self.response_format is not None and self.response_format.type != "text":
            if self.response_format.type == "json_schema":
                if self.response_format.json_schema is None:
                    raise ApiError(Problem.BAD_REQUEST, "response_format json_schema needs its json_schema",
                                   param="response_format")
                schema = self.response_format.json_schema.schema_ or {"type": "object"}
            else:
                schema = {"type": "object"}
            if tools and choice != "none":
                raise ApiError(Problem.BAD_REQUEST, "give tools or a response_format schema, not both",
                               param="response_format")
        kwargs = dict(self.chat_template_kwargs or {})
        # as OpenAI's: parallel calls unless the request says false (then at most one call)
        return ChatTurn(messages=[m.as_chat() for m in self.messages], tools=tools, tool_choice=choice,
                        parallel_tool_calls=self.parallel_tool_calls is not False, json_schema=schema,
                        chat_template_kwargs=kwargs, enable_thinking=kwargs.get("enable_thinking") is not False)

    @model_validator(mode="after")
    def _logprobs_asked(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def top(self) -> int | None:
        """How many of the likeliest tokens' log-probabilities each token gets (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _one_budget(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None and \
                self.max_tokens != self.max_completion_tokens:
            raise ValueError("give max_completion_tokens or max_tokens, not both with different values")
        return self


class CompletionRequest(CommonRequest):
    prompt: Content | Annotated[list[Content], Field(min_length=1, max_length=1)]
    # each new token's log-probability and this many of the likeliest tokens' (OpenAI's cap is 5;
    # the tail gives up to 20, as chat's top_logprobs); false, as some clients send it, is none
    # (strict: 0, asking for the tokens' own only, is not read as false)
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS, strict=True)] | Literal[False] | None = None
    echo: Literal[False] = False
    suffix: Literal[""] | None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def top(self) -> int | None:
        """How many of the likeliest tokens' log-probabilities each token gets (None: no logprobs)."""
        return None if self.logprobs is None or self.logprobs is False else self.logprobs


def usage(answers: list[Answer]) -> dict[str, Any]:
    """As OpenAI counts n choices: the prompt once, every choice's new tokens; prompt_tokens counts the
    cached ones too, and the details say how many they were."""
    prompt = answers[0].prompt_tokens if answers else 0
    new = sum(a.new_tokens for a in answers)
    return {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new,
            "prompt_tokens_details": {"cached_tokens": answers[0].cached_tokens if answers else 0}}


def finish_reason(answer: Answer) -> str:
    # a stage's session budget ("budget") is a length limit too
    return "length" if answer.reason in ("max_tokens", "budget") else "stop"


def routes(front: FrontDoor) -> list[BaseRoute]:
    def ask_request(body: CommonRequest, max_tokens: int | None, default_max: int, **prompt: Any) -> list[AskRequest]:
        """The request's n asks: one session each, seeded seed, seed + 1, ... (or each afresh without a seed)."""
        temperature = 1.0 if body.temperature is None else body.temperature
        return [AskRequest(**prompt, max_tokens=max_tokens or default_max, stop=body.stops(),
                           sampling=sampling(temperature, body.top_p, body.top_k,
                                             None if body.seed is None else body.seed + i))
                for i in range(body.n)]

    def stream(model: ModelCoverage, asks: list[AskRequest], body: CommonRequest, chunk: Chunk) -> Response:
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        async def one(emit: Emit, request: AskRequest, index: int) -> Answer:
            """One choice's chunks (its ``index``), as its ask streams."""
            text = AnswerText(request.stop)
            result = AskResult()
            started = False
            parsed: DeltaStream | None = None
            told = 0  # the tokens whose logprobs a chunk carried
            offsets = TextOffsets()

            def logprobs() -> dict[str, Any] | None:
                """The logprobs of the tokens since the last chunk that carried some."""
                nonlocal told
                if request.logprobs is None:
                    return None
                new, told = result.logprobs[told:], len(result.logprobs)
                return logprobs_of(new) if chunk.chat else completion_logprobs(new, offsets)

            async def start() -> None:
                nonlocal started
                if not started and chunk.chat:
                    await emit(chunk.event({"role": "assistant", "content": ""}, None, include_usage, index=index))
                started = True

            async def send(delta: str, final: bool = False) -> None:
                nonlocal parsed
                await start()
                if result.rendered is None:
                    if delta:
                        await emit(chunk.event({"content": delta}, None, include_usage, index=index,
                                               logprobs=logprobs()))
                    return
                # a chat rendered with the model's template: its parser splits content, reasoning and calls
                parsed = parsed or DeltaStream(result.rendered)
                for d in parsed.feed(text.text, final):
                    await emit(chunk.event(delta_of(d), None, include_usage, index=index, logprobs=logprobs()))

            async def on_token(token: int, piece: bytes) -> None:
                await send(text.feed(piece))

            await front.ask(model, request, DIALECT, True, on_token, result)
            await send(text.finish(), final=True)
            answer = answer_of(result, text)
            called = parsed is not None and bool(parsed.sent.calls)
            rest = logprobs()
            await emit(chunk.event({}, "tool_calls" if called else finish_reason(answer),
                                   include_usage, answer.verification, index=index,
                                   logprobs=rest if rest is not None and (rest.get("content") or rest.get("tokens"))
                                   else None))
            return answer

        async def produce(emit: Emit) -> None:
            answers: list[Answer | None] = [None] * len(asks)

            async def run(i: int) -> None:
                answers[i] = await one(emit, asks[i], i)

            # n choices: n sessions at once, their chunks interleaved as they come (each names its index)
            await each_of(len(asks), run)
            if include_usage:
                await emit(chunk.usage_event([a for a in answers if a is not None]))
            await emit(ServerSentEvent("[DONE]"))

        return AskStream(produce, error_response, error_event)

    async def respond(request: Request, body: CommonRequest, model: ModelCoverage, asks: list[AskRequest],
                      chunk: Chunk, kind: str, content: Callable[[Answer], dict[str, Any]]) -> Response:
        """Streamed answers as chunks, or the whole ones as one `kind` object, each choice's `content` added."""
        if body.stream:
            return stream(model, asks, body, chunk)
        answers: list[Answer | None] = [None] * len(asks)

        async def run(i: int) -> None:
            answers[i] = await ask_whole(front, request, model, asks[i], DIALECT)

        await each_of(len(asks), run)
        whole = [a for a in answers if a is not None]
        if len(whole) < len(asks):
            return Response(status_code=CLIENT_GONE)
        choices = []
        for i, answer in enumerate(whole):
            choice = content(answer)
            # an answer with a call ends with it (calls after the first are dropped unless parallel)
            reason = "tool_calls" if choice.get("message", {}).get("tool_calls") else finish_reason(answer)
            logprobs = None if asks[i].logprobs is None else logprobs_of(answer.logprobs) if chunk.chat else \
                completion_logprobs(answer.logprobs, TextOffsets())
            choices.append({"index": i, **choice, "logprobs": logprobs, "finish_reason": reason})
        first = whole[0]
        return JSONResponse({
            "id": chunk.id, "object": kind, "created": chunk.created, "model": model.name,
            "system_fingerprint": model.model[:12], "choices": choices, "usage": usage(whole),
            # one choice's verification as before; n choices', one each
            "meshd": first.verification if len(whole) == 1 else {"choices": [a.verification for a in whole]}},
            headers=answer_headers(whole))

    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, ChatRequest)
        model = front.resolve(body.model)
        ask = ask_request(body, body.max_completion_tokens or body.max_tokens, front.default_max_tokens,
                          chat=body.chat(), logprobs=body.top())
        return await respond(request, body, model, ask, Chunk("chat.completion.chunk", model), "chat.completion",
                             chat_choice)

    async def completions(request: Request) -> Response:
        body = await read_json(request, CompletionRequest)
        model = front.resolve(body.model)
        ask = ask_request(body, body.max_tokens, COMPLETIONS_MAX_TOKENS, text=body.text(), logprobs=body.top())
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


def chat_choice(answer: Answer) -> dict[str, Any]:
    """A chat answer's message: content, and the tool calls and reasoning the template's parser found."""
    if answer.rendered is None:
        return {"message": {"role": "assistant", "content": answer.text}}
    parsed = parse_answer(answer.rendered, answer.text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content or (None if parsed.calls else "")}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                              "arguments": c.arguments}}
                                 for c in parsed.calls]
    return {"message": message}


def logprobs_of(tokens: list[tuple[bytes, float, list[tuple[int, float, bytes]]]]) -> dict[str, Any]:
    """Tokens' log-probabilities (and the likeliest tokens' at each) in OpenAI's shape."""
    def entry(piece: bytes, logprob: float) -> dict[str, Any]:
        return {"token": piece.decode(errors="replace"), "logprob": logprob, "bytes": list(piece)}

    return {"content": [{**entry(piece, lp), "top_logprobs": [entry(p, v) for _, v, p in top]}
                        for piece, lp, top in tokens], "refusal": None}


class TextOffsets:
    """Where each token's text begins in the answer's, as a client decoding its pieces in order sees it
    (a character split between tokens belongs to the token that completes it)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at = 0

    def next(self, piece: bytes) -> int:
        at = self._at
        self._at += len(self._decoder.decode(piece))
        return at


def completion_logprobs(tokens: list[tuple[bytes, float, list[tuple[int, float, bytes]]]],
                        offsets: TextOffsets) -> dict[str, Any]:
    """Tokens' log-probabilities in completions' older shape: each token's text, its log-probability,
    the likeliest tokens' by their text (two with the same text are one entry, as OpenAI's), and where
    its text begins in the answer's (``offsets`` goes on from the tokens before)."""
    return {"tokens": [piece.decode(errors="replace") for piece, _, _ in tokens],
            "token_logprobs": [lp for _, lp, _ in tokens],
            "top_logprobs": [likeliest_by_text(top) for _, _, top in tokens],
            "text_offset": [offsets.next(piece) for piece, _, _ in tokens]}


def likeliest_by_text(top: list[tuple[int, float, bytes]]) -> dict[str, float]:
    """The likeliest tokens (likeliest first) keyed by their text; of two with one text, the likelier."""
    out: dict[str, float] = {}
    for _, logprob, piece in top:
        out.setdefault(piece.decode(errors="replace"), logprob)
    return out


def delta_of(d: Delta) -> dict[str, Any]:
    """A parsed step of a streamed chat as OpenAI's chunk delta."""
    if d.call_start is not None:
        index, cid, name = d.call_start
        return {"tool_calls": [{"index": index, "id": cid, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}
    if d.arguments is not None:
        index, more = d.arguments
        return {"tool_calls": [{"index": index, "function": {"arguments": more}}]}
    if d.reasoning:
        return {"reasoning_content": d.reasoning}
    return {"content": d.content}


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

    def event(self, delta: dict[str, Any], finish: str | None, include_usage: bool,
              verification: dict[str, Any] | None = None, index: int = 0,
              logprobs: dict[str, Any] | None = None) -> ServerSentEvent:
        """A chunk of new text (or, with `finish`, the end): chat's `delta`, or a completion's `text`;
        the last carries the answer's `verification` (its "meshd" field), known only once it is in."""
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
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

    def usage_event(self, answers: list[Answer]) -> ServerSentEvent:
        return ServerSentEvent(json.dumps({
            "id": self.id, "object": self.kind, "created": self.created, "model": self.model.name,
            "system_fingerprint": self.model.model[:12], "choices": [], "usage": usage(answers)}))
