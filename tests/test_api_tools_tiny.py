"""Tool calls from a model that knows nothing: a tiny random-weight llama carrying Qwen 2.5's pinned tool-use
template, split across three `meshd join` volunteers behind a `--no-model --api` member, asked with the
official `openai` and `anthropic` clients. Its weights are noise, so every well-formed call here is the
grammar's doing at the tail: "required" and a named tool give a call whose arguments validate against the
tool's schema, in both dialects, streamed and not, and through the Responses API; the same greedy request
gives the same call twice."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import jsonschema
import pytest
from chat_goldens import templates_dir
from gguf_factory import TINY_SPECS, write_tiny_gguf
from test_api_mesh import Mesh, claude, oai
from test_api_tools_mesh import ASK_WEATHER, OTHER, openai_call, tool_mesh, with_template

pytestmark = pytest.mark.slow  # four daemons, three engine workers

# the template's tool prompt is some 1,100 bytes, and the tiny model's tokens are bytes; each volunteer's
# memory holds two of the six layers with that budget's KV, so the route is three stages
VOLUNTEER = ["--memory", "1600K", "--threads", "1", "--max-sessions", "2", "--session-tokens", "2048"]
# The city is an enum here: noise spells a free string byte by byte, bytes that need not be UTF-8, and the
# grammar's maxLength counts what it reads as characters, not what a decoder makes of them.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Rome", "Paris"]},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": WEATHER}}
# a call spelled byte by byte: <tool_call> {"name": ..., "arguments": {"city": ..., "unit": ...}} </tool_call>
CALL_TOKENS = 200


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    base = tmp_path_factory.mktemp("tinytools")
    tiny = write_tiny_gguf(base / "tiny.gguf", dataclasses.replace(TINY_SPECS["llama-gqa-untied"], n_ctx=2048))
    model = with_template(tiny, base / "tiny-qwen25-tools.gguf", templates_dir() / "Qwen-Qwen2.5-7B-Instruct.jinja")
    yield from tool_mesh(base, model, VOLUNTEER)


async def test_a_random_weight_model_calls_tools_in_shape_in_every_dialect(mesh: Mesh) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls = {}
    for choice in ("required", named):
        for stream in (False, True):
            name, arguments, finish = await openai_call(mesh, choice, stream, max_tokens=CALL_TOKENS,
                                                        tools=[TOOL, OTHER])
            assert finish == "tool_calls", (choice, stream, name, arguments)
            assert name in ("get_weather", "get_time") if choice == "required" else name == "get_weather"
            if name == "get_weather":
                jsonschema.validate(json.loads(arguments), WEATHER)
            calls[(str(choice), stream)] = (name, arguments)
    assert calls[(str(named), False)] == calls[(str(named), True)]
    # greedy: the same request, the same call
    again = await openai_call(mesh, named, False, max_tokens=CALL_TOKENS, tools=[TOOL, OTHER])
    assert again[:2] == calls[(str(named), False)]

    reply = await claude(mesh).messages.create(
        model="", max_tokens=CALL_TOKENS, extra_body={"temperature": 0.0}, messages=ASK_WEATHER,  # type: ignore[arg-type]
        tools=[{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    (use,) = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)

    response = await oai(mesh).responses.create(
        model="", input="Weather in Rome?", max_output_tokens=CALL_TOKENS, temperature=0,
        tools=[{"type": "function", "name": "get_weather", "description": "Weather in a city",
                "parameters": WEATHER, "strict": False}, {"type": "function", **OTHER["function"]}],
        tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    (item,) = [i for i in response.output if i.type == "function_call"]
    assert item.name == "get_weather"
    jsonschema.validate(json.loads(item.arguments), WEATHER)
