"""The model's own chat template, tool calls and grammars: llama.cpp's common/chat behind meshengine.

Rendering and parsing need no model: a template is a string, so any member renders a request
(``render``) and parses an answer (``parse``) with the template the model's head stage reports
(``Model.chat_info``). The shapes of requests and results are llama-server's (its ``--jinja`` path),
as JSON: a template behaves here as it does there.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from meshd.engine.engine import EngineError, InvalidInput, _init_once, _raise
from meshd.engine.native import load

# the most bytes a rendered prompt, a parsed answer or a grammar may take (a query that says more is refused
# before the library is asked to fill it)
MAX_RESULT = 64 << 20


def _fill(what: str, capacity: int, call: Callable[[Any, int, Any], int]) -> str:
    """The query-size-then-fill idiom for a text result."""
    # the library's log level (MESHD_LLAMA_LOG), which common/'s own log follows too
    _init_once()
    ffi, lib = load()
    n = ffi.new("int32_t *")
    while True:
        buf = ffi.new("char[]", capacity)
        rc = call(buf, capacity, n)
        if rc == lib.ME_ERR_BUFFER_TOO_SMALL and capacity < n[0] <= MAX_RESULT:
            capacity = n[0]
            continue
        if rc != lib.ME_OK:
            _raise(rc, what)
        return bytes(ffi.buffer(buf, n[0])).decode(errors="replace")


def _object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise EngineError(f"{what} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise EngineError(f"{what} is not a JSON object")
    return value


def _request(value: dict[str, Any], what: str) -> bytes:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{what} cannot be sent as JSON: {exc}") from None


def render(request: dict[str, Any]) -> dict[str, Any]:
    """A chat request rendered with its template (``request["template"]``): the prompt, and what the
    answer needs (the tool-call format and its parser, the grammar and its triggers, extra stops)."""
    raw = _request(request, "the chat request")
    _, lib = load()
    text = _fill("render", 4 * len(raw) + 4096, lambda buf, cap, n: lib.me_chat_render(raw, buf, cap, n))
    return _object(text, "the rendered chat")


def parse(spec: dict[str, Any], output: str, partial: bool) -> dict[str, Any]:
    """The model's output as an OpenAI assistant message ({"content", "reasoning_content", "tool_calls"}),
    by the parser ``render`` gave (``spec``: its "format", "parser" and "generation_prompt")."""
    raw_spec = _request(spec, "the parser")
    raw = output.encode()
    _, lib = load()
    text = _fill("parse", 2 * len(raw) + 1024,
                 lambda buf, cap, n: lib.me_chat_parse(raw_spec, raw, len(raw), partial, buf, cap, n))
    return _object(text, "the parsed answer")


def schema_grammar(schema: dict[str, Any]) -> str:
    """A JSON schema as GBNF, by llama.cpp's json-schema-to-grammar."""
    raw = _request(schema, "the JSON schema")
    _, lib = load()
    return _fill("grammar", 8 * len(raw) + 4096, lambda buf, cap, n: lib.me_json_schema_grammar(raw, buf, cap, n))
