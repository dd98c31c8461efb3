"""OpenAI's Responses API: POST /v1/responses, streamed as its typed events or whole.

Stateless, as a mesh is: an answer is not stored, so `previous_response_id` and `conversation` are
refused by name. `input` is a string or a list of items: messages, the model's earlier function calls
and their outputs; `instructions` is the system message. A chat is rendered with the model's own
template, as chat completions are (meshd.client.chat): function `tools` with `tool_choice` (auto,
none, required, a named function) and `text.format` (json_object, json_schema) are enforced by a
grammar at the tail, and the answer is parsed into a message and function calls by the template's
parser. With `include: ["message.output_text.logprobs"]` the message's text carries each token's
log-probability (and `top_logprobs` of the likeliest tokens'), whole and in each streamed delta.
Errors are OpenAI's error body; a stream that fails after it began ends with an `error` event (the
official client raises it).
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
from meshd.client.chat import ChatRequest as ChatTurn
from meshd.front.dialect import CLIENT_GONE, MAX_NEW_TOKENS, Answer, answer_of, ask_whole, guarded, sampling
from meshd.front.door import ApiError, FrontDoor, Problem
from meshd.front.http import AskStream, Emit, read_json
from meshd.front.openai_api import Content, error_body, error_response, logprobs_of
from meshd.front.text import AnswerText
from meshd.front.tools import Delta, DeltaStream, ToolCall, parse_answer
from wire.meshrpc import ModelCoverage
from wire.stage import MAX_TOP_LOGPROBS

DIALECT = "responses"
# what `include` names to have the message's text carry its tokens' log-probabilities
LOGPROBS = "message.output_text.logprobs"


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

    def as_chat(self) -> dict[str, Any]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


Name = Annotated[str, Field(min_length=1, max_length=128)]
CallId = Annotated[str, Field(min_length=1, max_length=128)]


class FunctionCall(BaseModel):
    """An earlier turn's function call, as the model made it."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: CallId
    name: Name
    arguments: Content


class FunctionOutput(BaseModel):
    """What the client's function gave back for a call."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: CallId
    output: Content


Item = Annotated[InputMessage | FunctionCall | FunctionOutput, Field(union_mode="left_to_right")]


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: Name
    description: Annotated[str, Field(max_length=1 << 16)] | None = None
    parameters: dict[str, Any] | None = None

    def as_chat(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters or {"type": "object", "properties": {}}}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: Name


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    # json_schema's
    name: Annotated[str, Field(max_length=128)] | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Annotated[str, Field(max_length=256)] | None = None
    input: Content | Annotated[list[Item], Field(min_length=1, max_length=4096)]
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
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    # what else the answer carries: of OpenAI's list, only the text's logprobs mean anything here
    include: Annotated[list[Annotated[str, Field(max_length=128)]], Field(max_length=16)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @property
    def parallel(self) -> bool:
        """As OpenAI's: parallel calls unless the request says false (then at most one call)."""
        return self.parallel_tool_calls is not False

    def top(self) -> int | None:
        """How many of the likeliest tokens' log-probabilities each token gets (None: no logprobs)."""
        return (self.top_logprobs or 0) if LOGPROBS in (self.include or []) else None

    def messages(self) -> list[dict[str, Any]]:
        """The input as chat messages: an earlier call is the assistant's turn, its output a tool's."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, InputMessage):
                out.append(item.as_chat())
            elif isinstance(item, FunctionCall):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return out

    def chat(self) -> ChatTurn:
        """The request as the asker renders it with the model's template (as chat completions' are)."""
        tools = [t.as_chat() for t in self.tools or []]
        choice = self.tool_choice if isinstance(self.tool_choice, str) else "auto"
        if isinstance(self.tool_choice, NamedFunction):
            # a named function: a call is required, and only that tool is offered
            wanted = self.tool_choice.name
            tools = [t for t in tools if t["function"]["name"] == wanted]
            if not tools:
                raise ApiError(Problem.BAD_REQUEST, f"tool_choice names {wanted!r}, which is not in tools",
                               param="tool_choice")
            choice = "required"
        if not tools:
            choice = "none"
        form = self.text.format if self.text is not None else None
        schema = None
        if form is not None and form.type != "text":
            if choice != "none":
                raise ApiError(Problem.BAD_REQUEST, "give tools or a text format schema, not both", param="text")
            schema = form.schema_ or {"type": "object"} if form.type == "json_schema" else {"type": "object"}
        return ChatTurn(messages=self.messages(), tools=tools, tool_choice=choice, parallel_tool_calls=self.parallel,
                        json_schema=schema)


class Reply:
    """One answer's ids and the Response object around its output items, as the API shapes them."""

    def __init__(self, model: ModelCoverage, body: ResponsesRequest) -> None:
        self.id = f"resp_{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.model = model
        self.body = body
        # the output items so far, in order: (their id, a message's text or a call)
        self.items: list[tuple[str, str | ToolCall]] = []
        # with logprobs asked: the answer's tokens', which the message's text carries
        self.logprobs: list[dict[str, Any]] = []

    @staticmethod
    def part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    def item(self, k: int, done: bool) -> dict[str, Any]:
        """Output item ``k``: a message or a function call, still being written or done."""
        item_id, what = self.items[k]
        status = "completed" if done else "in_progress"
        if isinstance(what, ToolCall):
            return {"id": item_id, "type": "function_call", "call_id": what.id, "name": what.name,
                    "arguments": what.arguments if done else "", "status": status}
        return {"id": item_id, "type": "message", "role": "assistant", "status": status,
                "content": [self.part(what, self.logprobs)] if done else []}

    def add(self, what: str | ToolCall) -> int:
        self.items.append((f"{'fc' if isinstance(what, ToolCall) else 'msg'}_{secrets.token_hex(12)}", what))
        return len(self.items) - 1

    def take(self, answer: Answer) -> None:
        """The whole answer's items: its text (a message, unless it only calls functions) and its calls."""
        self.logprobs = logprobs_of(answer.logprobs)["content"]
        if answer.rendered is None:
            self.add(answer.text)
            return
        parsed = parse_answer(answer.rendered, answer.text)
        if parsed.content or not parsed.calls:
            self.add(parsed.content)
        for call in parsed.calls:
            self.add(call)

    def response(self, answer: Answer | None) -> dict[str, Any]:
        """The Response object: without an answer, one in progress."""
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model.name,
            "status": "in_progress", "output": [], "parallel_tool_calls": self.body.parallel,
            "tool_choice": (choice.model_dump() if isinstance(choice := self.body.tool_choice, NamedFunction)
                            else choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in self.body.tools or []],
            "instructions": self.body.instructions, "max_output_tokens": self.body.max_output_tokens,
            "temperature": self.body.temperature, "top_p": self.body.top_p,
            "text": {"format": {"type": "text"}}, "incomplete_details": None, "error": None, "usage": None}
        if answer is not None:
            called = any(isinstance(what, ToolCall) for _, what in self.items)
            cut = answer.reason in ("max_tokens", "budget") and not called
            out |= {"status": "incomplete" if cut else "completed",
                    "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                    "output": [self.item(k, True) for k in range(len(self.items))], "usage": usage(answer),
                    "meshd": answer.verification}
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


class Streamed:
    """A streamed answer's output items as its deltas open and extend them (the message's text, each call's
    arguments), told as the API's events; ``finish`` closes them. A text delta carries the logprobs of
    the tokens since the last that carried some (``result``'s, where they were asked for)."""

    def __init__(self, reply: Reply, events: Events, result: AskResult) -> None:
        self.reply = reply
        self.events = events
        self.result = result
        self.told = 0
        # the output index of the message, and of each call by its index in the answer
        self.message: int | None = None
        self.calls: dict[int, int] = {}

    async def _open(self, what: str | ToolCall) -> int:
        k = self.reply.add(what)
        await self.events("response.output_item.added", output_index=k, item=self.reply.item(k, False))
        if not isinstance(what, ToolCall):
            await self.events("response.content_part.added", item_id=self.reply.items[k][0], output_index=k,
                              content_index=0, part=Reply.part(""))
        return k

    async def text(self, delta: str) -> None:
        if self.message is None:
            self.message = await self._open("")
        item_id, text = self.reply.items[self.message]
        assert isinstance(text, str)
        self.reply.items[self.message] = (item_id, text + delta)
        new, self.told = self.result.logprobs[self.told:], len(self.result.logprobs)
        await self.events("response.output_text.delta", item_id=item_id, output_index=self.message,
                          content_index=0, delta=delta, logprobs=logprobs_of(new)["content"])

    async def delta(self, d: Delta) -> None:
        if d.content:
            await self.text(d.content)
        if d.call_start is not None:
            index, call_id, name = d.call_start
            self.calls[index] = await self._open(ToolCall(call_id, name, ""))
        if d.arguments is not None and d.arguments[0] in self.calls:
            k = self.calls[d.arguments[0]]
            item_id, call = self.reply.items[k]
            assert isinstance(call, ToolCall)
            call.arguments += d.arguments[1]
            await self.events("response.function_call_arguments.delta", item_id=item_id, output_index=k,
                              delta=d.arguments[1])

    async def finish(self) -> None:
        self.reply.logprobs = logprobs_of(self.result.logprobs)["content"]
        if not self.reply.items:
            self.message = await self._open("")
        for k, (item_id, what) in enumerate(self.reply.items):
            if isinstance(what, ToolCall):
                await self.events("response.function_call_arguments.done", item_id=item_id, output_index=k,
                                  name=what.name, arguments=what.arguments)
            else:
                await self.events("response.output_text.done", item_id=item_id, output_index=k, content_index=0,
                                  text=what, logprobs=self.reply.logprobs)
                await self.events("response.content_part.done", item_id=item_id, output_index=k, content_index=0,
                                  part=Reply.part(what, self.reply.logprobs))
            await self.events("response.output_item.done", output_index=k, item=self.reply.item(k, True))


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
            out = Streamed(reply, events, result)
            parsed: DeltaStream | None = None
            started = False

            async def send(delta: str, final: bool = False) -> None:
                nonlocal started, parsed
                if not started:
                    started = True
                    await events("response.created", response=reply.response(None))
                    await events("response.in_progress", response=reply.response(None))
                if result.rendered is None:
                    if delta:
                        await out.text(delta)
                    return
                # rendered with the model's template: its parser splits the text into content and calls
                parsed = parsed or DeltaStream(result.rendered)
                for d in parsed.feed(text.text, final):
                    await out.delta(d)

            async def on_token(token: int, piece: bytes) -> None:
                await send(text.feed(piece))

            await front.ask(model, ask, DIALECT, True, on_token, result)
            await send(text.finish(), final=True)
            await out.finish()
            done = reply.response(answer_of(result, text))
            await events("response.completed" if done["status"] == "completed" else "response.incomplete",
                         response=done)

        return AskStream(produce, error_response, error_event)

    async def create(request: Request) -> Response:
        body = await read_json(request, ResponsesRequest)
        model = front.resolve(body.model)
        ask = AskRequest(chat=body.chat(), max_tokens=body.max_output_tokens or front.default_max_tokens,
                         logprobs=body.top(),
                         sampling=sampling(1.0 if body.temperature is None else body.temperature, body.top_p, None,
                                           body.seed))
        reply = Reply(model, body)
        if body.stream:
            return stream(model, ask, reply)
        answer = await ask_whole(front, request, model, ask, DIALECT)
        if answer is None:
            return Response(status_code=CLIENT_GONE)
        reply.take(answer)
        return JSONResponse(reply.response(answer), headers=answer.headers)

    async def not_kept(request: Request) -> Response:
        raise ApiError(Problem.NOT_FOUND, "this mesh keeps no response: each is answered and forgotten")

    return [Route("/v1/responses", guarded(front, create, error_response), methods=["POST"]),
            Route("/v1/responses/{response_id}", guarded(front, not_kept, error_response), methods=["GET", "DELETE"])]
