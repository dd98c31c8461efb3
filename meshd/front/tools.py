"""What both dialects share of tool calls and structured output: the answer's text parsed into content,
reasoning and tool calls (by the parser the model's template chose, meshd.client.chat), whole or as
streamed deltas."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from meshd.client.chat import Rendered, parse
from meshd.engine.engine import EngineError


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class Parsed:
    """An answer as the template's parser reads it."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def _parsed(message: dict[str, Any], ids: list[str]) -> Parsed:
    """``message`` (OpenAI's shape) with each call's id: the model's, else one made up and kept (``ids``),
    so a streamed call keeps its id from its first delta to the last."""
    calls = []
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function") or {}
        if len(ids) <= i:
            ids.append(call.get("id") or call_id())
        calls.append(ToolCall(ids[i], str(fn.get("name") or ""), str(fn.get("arguments") or "")))
    content = message.get("content")
    return Parsed(content if isinstance(content, str) else "", str(message.get("reasoning_content") or ""), calls)


def _read(rendered: Rendered, text: str, partial: bool, ids: list[str]) -> Parsed:
    parsed = _parsed(parse(rendered, text, partial), ids)
    if not rendered.parallel:
        # the grammar admits more calls after the first, and a weak model goes on to make them: without
        # parallel_tool_calls the answer is its first call
        parsed.calls = parsed.calls[:1]
    return parsed


def parse_answer(rendered: Rendered, text: str, ids: list[str] | None = None) -> Parsed:
    """The whole answer parsed; text the parser cannot read stays content (as llama-server answers it)."""
    try:
        return _read(rendered, text, False, [] if ids is None else ids)
    except EngineError:
        return Parsed(content=text)


@dataclass
class Delta:
    """What one step of a streamed answer adds: text, reasoning, or a tool call's start or arguments."""

    content: str = ""
    reasoning: str = ""
    # (index, id, name) of a call that starts here
    call_start: tuple[int, str, str] | None = None
    # (index, more arguments)
    arguments: tuple[int, str] | None = None


class DeltaStream:
    """A streamed answer's deltas, from the parse of its text so far after each piece (partial), then of
    the whole (final). A delta only ever adds: what a later parse says differently of text already sent
    (a revision) is not sent again."""

    def __init__(self, rendered: Rendered) -> None:
        self.rendered = rendered
        self.ids: list[str] = []
        self.sent = Parsed()

    def feed(self, text: str, final: bool = False) -> list[Delta]:
        try:
            now = _read(self.rendered, text, not final, self.ids)
        except EngineError:
            if not final:
                return []
            now = Parsed(content=text)
        deltas: list[Delta] = []
        if now.reasoning.startswith(self.sent.reasoning) and len(now.reasoning) > len(self.sent.reasoning):
            deltas.append(Delta(reasoning=now.reasoning[len(self.sent.reasoning):]))
            self.sent.reasoning = now.reasoning
        if now.content.startswith(self.sent.content) and len(now.content) > len(self.sent.content):
            deltas.append(Delta(content=now.content[len(self.sent.content):]))
            self.sent.content = now.content
        for i, call in enumerate(now.calls):
            if not call.name:
                continue
            if i >= len(self.sent.calls):
                self.sent.calls.append(ToolCall(call.id, call.name, ""))
                deltas.append(Delta(call_start=(i, call.id, call.name)))
            sent = self.sent.calls[i]
            if call.arguments.startswith(sent.arguments) and len(call.arguments) > len(sent.arguments):
                deltas.append(Delta(arguments=(i, call.arguments[len(sent.arguments):])))
                sent.arguments = call.arguments
        return deltas
