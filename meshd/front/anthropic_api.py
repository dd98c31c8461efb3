"""Anthropic's dialect: /v1/messages, streaming (message_start, content_block_start/delta/stop,
message_delta, message_stop) and not, with its error shape; /v1/messages/count_tokens; and its shape
of /v1/models for clients that send `anthropic-version` (OpenAI's clients get OpenAI's).

Claude Code's shapes are taken as the API takes them: `?beta=true` and `anthropic-beta` headers (the
path and the body say everything meshd acts on), `thinking` of each type (the model's template thinks
or not: its `enable_thinking`), earlier thinking blocks (the template's reasoning_content), and the
fields that steer only Anthropic's own service (cache_control, metadata, service_tier,
context_management, container, ...) ignored, as is a tool of Anthropic's own `type` (web search, ...),
which no member can run. The API has no logprobs.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from meshd.client.ask import AskRequest, AskResult
from meshd.client.chat import ChatRequest as ChatTurn
from meshd.front.dialect import CLIENT_GONE, MAX_NEW_TOKENS, MAX_STOP_CHARS, Answer, answer_of, ask_whole, guarded, sampling
from meshd.front.door import ApiError, FrontDoor, Problem
from meshd.front.http import AskStream, Emit, read_json, retry_headers, unless_gone
from meshd.front.text import AnswerText
from meshd.front.tools import Delta, DeltaStream, parse_answer
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


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_use"]
    id: Annotated[str, Field(max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(max_length=256)]
    content: Content | Annotated[list[TextBlock], Field(max_length=256)] = ""
    is_error: bool = False


class ThinkingBlock(BaseModel):
    """An earlier turn's reasoning, which the template renders where it renders reasoning (or drops);
    its signature is Anthropic's, meaningless here."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["thinking"]
    thinking: Content


class RedactedThinkingBlock(BaseModel):
    """Reasoning Anthropic encrypted: nothing a template can render."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]
TextBlocks = Annotated[list[TextBlock], Field(max_length=256)]
Blocks = Annotated[list[Block], Field(max_length=256)]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: Content | Blocks

    def as_chat(self) -> list[dict[str, Any]]:
        """The message in OpenAI's shapes, as llama.cpp's common/chat reads them: an assistant's tool_use
        blocks are its tool_calls, a user's tool_result blocks each a "tool" message before its text."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text = "".join(b.text for b in self.content if isinstance(b, TextBlock))
        out: list[dict[str, Any]] = []
        for b in self.content:
            if isinstance(b, ToolResultBlock):
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": text_of(b.content)})
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in self.content if isinstance(b, ToolUseBlock)]
        reasoning = "".join(b.thinking for b in self.content if isinstance(b, ThinkingBlock))
        said: dict[str, Any] = {"reasoning_content": reasoning} if reasoning and self.role == "assistant" else {}
        if calls:
            out.append({"role": "assistant", "content": text, "tool_calls": calls, **said})
        elif text or said or not out:
            out.append({"role": self.role, "content": text, **said})
        return out


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # "custom" (or none): the client's own tool; any other is one of Anthropic's (web_search_20250305, ...)
    type: Annotated[str, Field(max_length=64)] | None = None
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: Annotated[str, Field(max_length=1 << 16)] = ""
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})

    @property
    def custom(self) -> bool:
        return self.type in (None, "custom")


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: Annotated[str, Field(max_length=256)] | None = None
    disable_parallel_tool_use: bool = False


class Thinking(BaseModel):
    """Thinking on ("enabled", "adaptive", "between_tools") or off ("disabled"), as the model's template
    takes it (its enable_thinking); a template that does not think answers without thinking blocks. No
    budget is enforced: thinking ends when the model ends it, or at max_tokens, which it counts toward
    (as Anthropic's does)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, Field(ge=0, le=MAX_NEW_TOKENS)] | None = None


class CountRequest(BaseModel):
    """What count_tokens takes: the prompt's part of a message request."""

    model_config = ConfigDict(extra="ignore")

    model: Annotated[str, Field(max_length=256)] | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    system: Content | TextBlocks | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def chat(self) -> ChatTurn:
        """The request as the asker renders it with the model's template."""
        system = [] if self.system is None else [{"role": "system", "content": text_of(self.system)}]
        # Anthropic's own tools (web search, code execution) run on its servers: nobody here can run them
        tools: list[dict[str, Any]] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in self.tools or [] if t.custom]
        choice = self.tool_choice or ToolChoice(type="auto")
        mode = {"auto": "auto", "any": "required", "tool": "required", "none": "none"}[choice.type]
        if choice.type == "tool":
            tools = [t for t in tools if t["function"]["name"] == choice.name]
            if not tools:
                raise ApiError(Problem.BAD_REQUEST, f"tool_choice names {choice.name!r}, which is not in tools")
        if not tools:
            mode = "none"
        return ChatTurn(messages=system + [m for msg in self.messages for m in msg.as_chat()], tools=tools,
                        tool_choice=mode,
                        # as Anthropic's: several calls (of one tool or more) unless disable_parallel_tool_use
                        parallel_tool_calls=not choice.disable_parallel_tool_use,
                        enable_thinking=self.thinking is None or self.thinking.type != "disabled")


class MessagesRequest(CountRequest):
    max_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)]
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                              Field(max_length=16)] | None = None
    # newer clients send these only through extra_body; older ones and plain HTTP still do
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_NEW_TOKENS)] | None = None
    stream: bool = False


def text_of(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def content_blocks(answer: Answer) -> list[dict[str, Any]]:
    """The answer's content blocks: its text, and a tool_use block for each call the template's parser found."""
    if answer.rendered is None:
        return [{"type": "text", "text": answer.text}]
    parsed = parse_answer(answer.rendered, answer.text)
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content or not parsed.calls:
        blocks.append({"type": "text", "text": parsed.content})
    blocks += [{"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": arguments_of(c.arguments)}
               for c in parsed.calls]
    return blocks


def tool_use_id(cid: str) -> str:
    return cid if cid.startswith("toolu_") else f"toolu_{cid.removeprefix('call_')}"


def arguments_of(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's clients expect (a grammar made them JSON; a model
    free to write anything may not have: then they are kept whole under one key)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def usage(answer: Answer) -> dict[str, int]:
    return {**input_usage(answer.prompt_tokens, answer.cached_tokens), "output_tokens": answer.new_tokens}


def input_usage(prompt_tokens: int, cached_tokens: int) -> dict[str, int]:
    """As Anthropic's: input_tokens are those not read from the cache (the three add up to the prompt)."""
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens}


def routes(front: FrontDoor) -> list[BaseRoute]:
    def ask_request(body: MessagesRequest) -> AskRequest:
        return AskRequest(chat=body.chat(), max_tokens=body.max_tokens, stop=list(body.stop_sequences or []),
                          sampling=sampling(1.0 if body.temperature is None else body.temperature,
                                            body.top_p, body.top_k, None))

    def stream(model: ModelCoverage, request: AskRequest, message_id: str) -> Response:
        async def produce(emit: Emit) -> None:
            text = AnswerText(request.stop)
            result = AskResult()
            started = False

            async def event(kind: str, data: dict[str, Any]) -> None:
                await emit(ServerSentEvent(json.dumps({"type": kind, **data}), event=kind))

            blocks = StreamBlocks(event)
            parsed: DeltaStream | None = None

            async def send(delta: str, final: bool = False) -> None:
                nonlocal started, parsed
                if not started:
                    started = True
                    opening = message(message_id, model, [], None, None)
                    opening["usage"] = {**input_usage(len(result.prompt_tokens), result.cached_tokens),
                                        "output_tokens": 0}
                    await event("message_start", {"message": opening})
                if result.rendered is None:
                    await blocks.text(delta)
                    return
                parsed = parsed or DeltaStream(result.rendered)
                for d in parsed.feed(text.text, final):
                    await blocks.add(d)

            async def on_token(token: int, piece: bytes) -> None:
                await send(text.feed(piece))

            await front.ask(model, request, DIALECT, True, on_token, result)
            await send(text.finish(), final=True)
            answer = answer_of(result, text)
            await blocks.close()
            called = parsed is not None and bool(parsed.sent.calls)
            reason = "tool_use" if called else STOP_REASONS[answer.reason]
            await event("message_delta", {"delta": {"stop_reason": reason,
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
        content = content_blocks(answer)
        called = any(b["type"] == "tool_use" for b in content)
        reply = message(message_id, model, content, "tool_use" if called else STOP_REASONS[answer.reason],
                        answer.stop)
        reply["usage"] = usage(answer)
        reply["meshd"] = answer.verification
        return JSONResponse(reply, headers=answer.headers)

    async def count_tokens(request: Request) -> Response:
        body = await read_json(request, CountRequest)
        model = front.resolve(body.model)
        # the head tokenizes the prompt as a message request's would be rendered; nothing runs
        result = await unless_gone(request.receive, lambda: front.ask(
            model, AskRequest(chat=body.chat(), max_tokens=1, count_only=True), DIALECT, False))
        if result is None:
            return Response(status_code=CLIENT_GONE)
        return JSONResponse({"input_tokens": len(result.prompt_tokens)})

    return [Route("/v1/messages", guarded(front, messages, error_response), methods=["POST"]),
            Route("/v1/messages/count_tokens", guarded(front, count_tokens, error_response), methods=["POST"])]


class StreamBlocks:
    """A streamed answer's content blocks, opened and closed in order: text (or thinking) deltas go to
    the open block of their kind, a tool call opens a tool_use block whose input comes as JSON deltas."""

    def __init__(self, event: Callable[[str, dict[str, Any]], Awaitable[None]]) -> None:
        self.event = event
        self.index = -1
        self.kind: str | None = None

    async def _open(self, kind: str, block: dict[str, Any]) -> None:
        await self.close()
        self.index += 1
        self.kind = kind
        await self.event("content_block_start", {"index": self.index, "content_block": block})

    async def close(self) -> None:
        if self.kind is not None:
            await self.event("content_block_stop", {"index": self.index})
            self.kind = None

    async def text(self, delta: str) -> None:
        if self.kind != "text":
            await self._open("text", {"type": "text", "text": ""})
        if delta:
            await self.event("content_block_delta", {"index": self.index,
                                                     "delta": {"type": "text_delta", "text": delta}})

    async def add(self, d: Delta) -> None:
        if d.call_start is not None:
            _, cid, name = d.call_start
            await self._open("tool_use", {"type": "tool_use", "id": tool_use_id(cid), "name": name, "input": {}})
        elif d.arguments is not None:
            await self.event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": d.arguments[1]}})
        elif d.reasoning:
            if self.kind != "thinking":
                await self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            await self.event("content_block_delta", {"index": self.index,
                                                     "delta": {"type": "thinking_delta", "thinking": d.reasoning}})
        elif d.content:
            await self.text(d.content)


def message(message_id: str, model: ModelCoverage, content: list[dict[str, Any]], stop_reason: str | None,
            stop_sequence: str | None) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model.name, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence}


def model_list(models: list[ModelCoverage]) -> dict[str, Any]:
    """/v1/models as Anthropic's clients read it."""
    data = [{"type": "model", "id": m.name, "display_name": m.name, "created_at": "1970-01-01T00:00:00Z"}
            for m in models]
    return {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}
