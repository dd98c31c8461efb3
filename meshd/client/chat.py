"""A chat request rendered by the asker with the model's own template, and its answer parsed.

The head reports its GGUF's chat template (``Opened.chat``); the asker renders the request with it
through llama.cpp's common/chat (``meshd.engine.chat``, no model needed), sends the head the rendered
text, and the tail the grammar that tool calls or a JSON schema need (``wire.stage.Grammar``). The
answer's text is parsed back into content, reasoning and tool calls by the parser the render chose.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio

from meshd.engine import chat as native_chat
from meshd.engine.engine import EngineError
from wire.errors import ErrorCode, ProtocolError
from wire.stage import ChatTemplate, Grammar, GrammarTrigger

# the longest a render may take: the 70 pinned templates take 2 to 6 ms each with tools here
RENDER_SECONDS = 5.0


@dataclass
class ChatRequest:
    """What a chat asks beyond its messages, in OpenAI's shapes (llama-server's request fields)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    # "auto", "required" or "none"; a named function is "required" with only that tool
    tool_choice: str = "auto"
    parallel_tool_calls: bool = False
    # response_format: a JSON schema the answer must follow ({} : any JSON object)
    json_schema: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    enable_thinking: bool = True

    @property
    def constrained(self) -> bool:
        """Whether the answer may need a grammar at the tail (tools or a schema)."""
        return bool(self.tools) and self.tool_choice != "none" or self.json_schema is not None

    def as_request(self, template: ChatTemplate) -> dict[str, Any]:
        request: dict[str, Any] = {
            **template.model_dump(), "messages": self.messages, "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls, "chat_template_kwargs": self.chat_template_kwargs,
            "enable_thinking": self.enable_thinking, "add_generation_prompt": True,
            # as llama-server's default: a thinking model's reasoning is parsed apart from its content
            "reasoning_format": "auto",
        }
        if self.tools:
            request["tools"] = self.tools
        if self.json_schema is not None:
            request["json_schema"] = self.json_schema
        return request


@dataclass(frozen=True)
class Rendered:
    """A rendered chat: the prompt the head tokenizes, the grammar the tail obeys, how to parse the answer."""

    prompt: str
    grammar: Grammar | None
    parser: dict[str, Any]
    # more than one call may be answered (parallel_tool_calls); if not, calls after the first are dropped
    parallel: bool = False


def own_or_chatml(template: ChatTemplate | None) -> ChatTemplate:
    """The file's own template, or llama.cpp's own fallback, chatml, where the file has none."""
    if template is None:
        return ChatTemplate(template="chatml")
    if not (template.template or template.tool_use_template):
        return template.model_copy(update={"template": "chatml"})
    return template


async def render(chat: ChatRequest, template: ChatTemplate | None) -> Rendered:
    """``chat`` rendered with the head's template (in a thread: a long template takes milliseconds)."""
    template = own_or_chatml(template)
    try:
        # the template came from a peer (the head): one that loops is given up on, not waited for
        with trio.fail_after(RENDER_SECONDS):
            out = await trio.to_thread.run_sync(native_chat.render, chat.as_request(template),
                                                abandon_on_cancel=True)
            if chat.tools and chat.tool_choice == "required":
                out = await trio.to_thread.run_sync(_force_call, chat, template, out, abandon_on_cancel=True)
    except EngineError as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
    except trio.TooSlowError:
        raise ProtocolError(ErrorCode.INTERNAL, f"the model's chat template did not render in {RENDER_SECONDS:g} s"
                            ) from None
    grammar = None
    if out.get("grammar"):
        if not chat.constrained:
            raise ProtocolError(ErrorCode.INTERNAL, "the template asked for a grammar the request did not")
        grammar = Grammar(gbnf=out["grammar"], lazy=bool(out.get("grammar_lazy")),
                          triggers=[GrammarTrigger(type=t["type"], value=t["value"]) for t in out["grammar_triggers"]],
                          preserved_tokens=list(out.get("preserved_tokens", [])),
                          generation_prompt=out.get("generation_prompt", ""), prefill=True)
    parser = {"format": out["format"], "parser": out.get("parser", ""),
              "generation_prompt": out.get("generation_prompt", ""), "reasoning_format": "auto"}
    return Rendered(out["prompt"], grammar, parser, chat.parallel_tool_calls)


def _force_call(chat: ChatRequest, template: ChatTemplate, out: dict[str, Any]) -> dict[str, Any]:
    """A required call starts the answer. llama.cpp's grammar for tool_choice "required" lets any text
    come before the call's opening marker, and a weak model may ramble there until its budget ends (the
    default 135M model did, for 64 tokens, under Qwen 2.5's template); so where the format opens a call
    with a marker (the word that triggers its lazy grammar), the marker is put after the generation
    prompt: the prompt ends with it, and the grammar and the parser read it as the answer's start."""
    auto = native_chat.render({**chat.as_request(template), "tool_choice": "auto"})
    words = [t["value"] for t in auto.get("grammar_triggers", []) if t.get("type") == "word"]
    if len(words) != 1 or not out.get("grammar") or out.get("grammar_lazy"):
        return out
    marker = words[0]
    return {**out, "prompt": out["prompt"] + marker, "generation_prompt": out["generation_prompt"] + marker}


def parse(rendered: Rendered, text: str, partial: bool) -> dict[str, Any]:
    """The answer so far as an OpenAI assistant message: content, reasoning_content, tool_calls."""
    return native_chat.parse(rendered.parser, text, partial)
