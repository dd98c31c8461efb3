"""Agents against a real mesh: tool calls (both dialects, streamed and not), structured output and a
conversation with a tool's result, asked with the official `openai` and `anthropic` clients of a
`meshd join --no-model --api` member in front of three volunteers that split the default model.

The volunteers serve a copy of the default model carrying Qwen 2.5's pinned tool-use template
(ChatML, as SmolLM2's own, whose tokens the model knows, with Hermes-style <tool_call> blocks): the
model's own template describes no tools, so llama.cpp's common/chat offers it none. The 135M model is
weak; the grammar at the tail is what makes its calls well-formed."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from chat_goldens import templates_dir
from localmesh import Served, start_join, stop_all
from test_api_mesh import KEY, Mesh, claude, oai, wait_covered

pytestmark = pytest.mark.slow  # four daemons, three engine workers

# three stages of the default model; two sessions each, room for the tools' system prompt (~300 tokens)
VOLUNTEER = ["--memory", "64M", "--threads", "1", "--max-sessions", "2", "--session-tokens", "512"]


def with_template(src: Path, dst: Path, template: Path) -> Path:
    """A copy of ``src`` whose tokenizer.chat_template is ``template`` (the gguf package's own tool)."""
    done = subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--chat-template-file",
                           str(template), "--force", str(src), str(dst)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return dst


def tool_mesh(base: Path, model: Path, volunteer: list[str]) -> Iterator[Mesh]:
    """A `--no-model --api` member (keyed) in front of three volunteers of ``model`` started with
    ``volunteer``'s flags, once the model is covered by three stages; stopped by PID after."""
    (base / "keys").write_text(KEY + "\n")
    nodes: list[Served] = []
    try:
        # spot checks off, so the stages' prefix caches serve the asks (`join --verify`): each ask's prompt
        # is the tools' long system part and a short question, and what these tests show is the calls, not
        # the checks (test_verify_*'s); uncached, every ask ran all of it again on every stage
        nodes.append(start_join("--no-model", "--state-dir", str(base / "seed"), "--api", "127.0.0.1:0",
                                "--api-key-file", str(base / "keys"), "--verify", "0"))
        url = next(line.split()[4] for line in nodes[0].lines if line.startswith("meshd: HTTP API on "))
        for i in range(3):
            nodes.append(start_join("--seed", nodes[0].address, "--model", str(model), "--state-dir",
                                    str(base / f"v{i}"), *volunteer))
        wait_covered(url)
        yield Mesh(nodes[0], url, nodes[1:])
    finally:
        stop_all(nodes)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Iterator[Mesh]:
    base = tmp_path_factory.mktemp("toolmesh")
    model = with_template(default_model, base / "smollm2-qwen25-tools.gguf",
                          templates_dir() / "Qwen-Qwen2.5-7B-Instruct.jinja")
    yield from tool_mesh(base, model, VOLUNTEER)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": WEATHER}}
OTHER = {"type": "function", "function": {"name": "get_time", "description": "Time in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ASK_WEATHER = [{"role": "user", "content": "Weather in Rome?"}]
TOOL_TOKENS = 48


async def openai_call(mesh: Mesh, choice: Any, stream: bool, **extra: Any) -> tuple[str, str, str | None]:
    """The one tool call of an answer (parallel calls off: the weak model goes on making calls while it
    may): its name, its arguments and the finish reason."""
    client = oai(mesh)
    args: dict[str, Any] = {"model": "", "messages": ASK_WEATHER, "tools": [TOOL, OTHER], "tool_choice": choice,
                            "max_tokens": TOOL_TOKENS, "temperature": 0, "parallel_tool_calls": False, **extra}
    if not stream:
        reply = await client.chat.completions.create(**args)
        calls = reply.choices[0].message.tool_calls
        assert calls and len(calls) == 1 and calls[0].id, reply
        return calls[0].function.name, calls[0].function.arguments, reply.choices[0].finish_reason
    names, arguments, finish, ids = "", "", None, set()
    async for chunk in await client.chat.completions.create(**args, stream=True):
        for choice_ in chunk.choices:
            for call in choice_.delta.tool_calls or []:
                assert call.index == 0
                ids.add(call.id) if call.id else None
                names += call.function.name or "" if call.function else ""
                arguments += call.function.arguments or "" if call.function else ""
            finish = choice_.finish_reason or finish
    assert len(ids) == 1
    return names, arguments, finish


async def test_tool_choice_required_and_named_give_a_call_whose_arguments_validate(mesh: Mesh) -> None:
    """Even the 135M default model calls in shape: the tail samples under the call's grammar."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    answers = {}
    for choice in ("required", named):
        for stream in (False, True):
            name, arguments, finish = await openai_call(mesh, choice, stream)
            assert finish == "tool_calls", (choice, stream, name, arguments)
            assert name in ("get_weather", "get_time") if choice == "required" else name == "get_weather"
            if name == "get_weather":
                jsonschema.validate(json.loads(arguments), WEATHER)
            answers[(str(choice), stream)] = (name, arguments)
    # streamed or not, the same greedy call
    assert answers[("required", False)] == answers[("required", True)]
    assert answers[(str(named), False)] == answers[(str(named), True)]


async def test_a_seeded_tool_call_is_the_same_twice(mesh: Mesh) -> None:
    first = await openai_call(mesh, "required", False, temperature=0.9, seed=7)
    assert await openai_call(mesh, "required", False, temperature=0.9, seed=7) == first


async def test_anthropic_tool_choice_any_and_tool_give_a_tool_use_whose_input_validates(mesh: Mesh) -> None:
    client = claude(mesh)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],  # type: ignore[index]
              "input_schema": t["function"]["parameters"]} for t in (TOOL, OTHER)]  # type: ignore[index]
    for choice in ({"type": "any", "disable_parallel_tool_use": True},
                   {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}):
        args: dict[str, Any] = {"model": "", "messages": ASK_WEATHER, "tools": tools, "tool_choice": choice,
                                "max_tokens": TOOL_TOKENS, "extra_body": {"temperature": 0.0}}
        reply = await client.messages.create(**args)
        uses = [b for b in reply.content if b.type == "tool_use"]
        assert reply.stop_reason == "tool_use" and len(uses) == 1, reply
        async with client.messages.stream(**args) as events:
            streamed = await events.get_final_message()
        streamed_uses = [b for b in streamed.content if b.type == "tool_use"]
        assert streamed.stop_reason == "tool_use" and len(streamed_uses) == 1, streamed
        assert (streamed_uses[0].name, streamed_uses[0].input) == (uses[0].name, uses[0].input)
        if choice["type"] == "tool":
            assert uses[0].name == "get_weather"
        if uses[0].name == "get_weather":
            jsonschema.validate(uses[0].input, WEATHER)


async def test_responses_api_calls_a_function_whose_arguments_validate_and_goes_on_with_its_output(
        mesh: Mesh) -> None:
    client = oai(mesh)
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],  # type: ignore[index]
              "parameters": t["function"]["parameters"]} for t in (TOOL, OTHER)]  # type: ignore[index]
    args: dict[str, Any] = {"model": "", "input": "Weather in Rome?", "tools": tools, "max_output_tokens": TOOL_TOKENS,
                            "temperature": 0, "tool_choice": {"type": "function", "name": "get_weather"},
                            "parallel_tool_calls": False}
    reply = await client.responses.create(**args)
    calls = [item for item in reply.output if item.type == "function_call"]
    assert reply.status == "completed" and len(calls) == 1, reply
    assert calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    # streamed: the call's item and its arguments as deltas, the same greedy call
    events = [e async for e in await client.responses.create(**args, stream=True)]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert events[-1].type == "response.completed" and len(done) == 1
    assert (done[0].name, done[0].arguments, deltas) == (calls[0].name, calls[0].arguments, calls[0].arguments)
    # the call and its output go back in the input, and the answer goes on from them
    follow = await client.responses.create(model="", temperature=0, max_output_tokens=TOOL_TOKENS, tools=tools,
                                           input=[{"role": "user", "content": "Weather in Rome?"},
                                                  {"type": "function_call", "call_id": calls[0].call_id,
                                                   "name": calls[0].name, "arguments": calls[0].arguments},
                                                  {"type": "function_call_output", "call_id": calls[0].call_id,
                                                   "output": '{"temperature": 21}'}])
    assert follow.status in ("completed", "incomplete") and follow.output


async def test_a_json_schema_answer_validates(mesh: Mesh) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    for stream in (False, True):
        args: dict[str, Any] = {"model": "", "max_tokens": TOOL_TOKENS, "temperature": 0,
                                "messages": [{"role": "user", "content": "A person as JSON."}],
                                "response_format": {"type": "json_schema",
                                                    "json_schema": {"name": "person", "schema": schema}}}
        if stream:
            text = "".join([c.choices[0].delta.content or "" async for c in
                            await oai(mesh).chat.completions.create(**args, stream=True) if c.choices])
        else:
            text = (await oai(mesh).chat.completions.create(**args)).choices[0].message.content or ""
        jsonschema.validate(json.loads(text), schema)


async def test_a_conversation_with_a_tool_result_continues(mesh: Mesh) -> None:
    messages = [*ASK_WEATHER,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": "Rome", "unit": "celsius"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]
    reply = await oai(mesh).chat.completions.create(model="", messages=messages, tools=[TOOL],  # type: ignore[arg-type, list-item]
                                                    max_tokens=TOOL_TOKENS, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    # and in Anthropic's shapes: tool_use, then its tool_result
    answer = await claude(mesh).messages.create(model="", max_tokens=TOOL_TOKENS, extra_body={"temperature": 0.0},
                                                tools=[{"name": "get_weather", "input_schema": WEATHER}],
                                                messages=[*ASK_WEATHER,  # type: ignore[list-item]
                                                          {"role": "assistant", "content": [{
                                                              "type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                              "input": {"city": "Rome", "unit": "celsius"}}]},
                                                          {"role": "user", "content": [{
                                                              "type": "tool_result", "tool_use_id": "toolu_1",
                                                              "content": "21 degrees and sunny"}]}])
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


async def test_logprobs_come_from_the_tail_streamed_and_not(mesh: Mesh) -> None:
    """Greedy: each token is its position's likeliest, so its log-probability is the first of the top ones;
    the tokens spell the answer, and the streamed ones are the same."""
    args: dict[str, Any] = {"model": "", "messages": [{"role": "user", "content": "Name a colour."}],
                            "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    reply = await oai(mesh).chat.completions.create(**args)
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and reply.usage is not None and len(content) == reply.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].logprob == t.logprob and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    assert "".join(t.token for t in content).startswith(reply.choices[0].message.content or "")
    streamed = []
    async for chunk in await oai(mesh).chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            streamed += [(t.token, t.logprob) for t in (c.logprobs.content or [])] if c.logprobs else []
    assert streamed == [(t.token, t.logprob) for t in content]
