"""OpenAI's Responses API (/v1/responses) with the official client, against the fake mesh (api_fakes)."""

from __future__ import annotations

import json

import openai
import pytest
from api_fakes import NAME, TWO_CALLS, FakeMesh, fails_with, pinned
from test_api_front import http, oai

from meshd.front.door import FrontDoor
from wire.errors import ErrorCode, ProtocolError


async def test_a_whole_response_carries_the_answer_usage_and_verification() -> None:
    mesh = FakeMesh()
    response = await oai(FrontDoor(mesh)).responses.create(model=NAME, input="hi", instructions="Be brief.",
                                                           max_output_tokens=50, temperature=0, extra_body={"seed": 7})
    assert response.status == "completed" and response.output_text == "Hello world"
    assert response.model == NAME and response.id.startswith("resp_")
    assert response.usage is not None and (response.usage.input_tokens, response.usage.output_tokens) == (5, 4)
    # the instructions are the system message, before the input as the user's
    (_, asked), = mesh.asked
    assert asked.chat is not None and asked.chat.tool_choice == "none"
    assert asked.chat.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (asked.max_tokens, asked.sampling.temperature, asked.sampling.seed) == (50, 0.0, 7)
    assert response.model_extra is not None and response.model_extra["meshd"]["verified"] is True


async def test_a_conversation_as_messages_and_a_cut_answer_is_incomplete() -> None:
    mesh = FakeMesh()
    response = await oai(FrontDoor(mesh)).responses.create(model=NAME, max_output_tokens=2, input=[
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "noon"},
        {"role": "user", "content": "again"}])
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens" and response.output_text == "Hello"
    (_, asked), = mesh.asked
    assert asked.chat is not None
    # an earlier call is the assistant's turn, its output a tool's, as chat completions take them
    assert [m["role"] for m in asked.chat.messages] == ["system", "user", "assistant", "assistant", "tool", "user"]
    assert asked.chat.messages[3]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert asked.chat.messages[4] == {"role": "tool", "tool_call_id": "c1", "content": "noon"}


async def test_tools_and_a_text_format_reach_the_chat_as_chat_completions_take_them() -> None:
    mesh = FakeMesh()
    tool = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
    await oai(FrontDoor(mesh)).responses.create(model=NAME, input="hi", tools=[tool],  # type: ignore[list-item]
                                                tool_choice={"type": "function", "name": "get_time"})
    await oai(FrontDoor(mesh)).responses.create(model=NAME, input="hi", text={"format": {
        "type": "json_schema", "name": "t", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}})
    (_, named), (_, schema) = mesh.asked
    assert named.chat is not None and named.chat.tool_choice == "required"
    assert [t["function"]["name"] for t in named.chat.tools] == ["get_time"]
    assert schema.chat is not None and schema.chat.json_schema == {"type": "object",
                                                                   "properties": {"a": {"type": "integer"}}}


async def test_a_stream_is_the_typed_events_in_order_and_ends_completed() -> None:
    stream = await oai(FrontDoor(FakeMesh())).responses.create(model=NAME, input="hi", stream=True)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello world"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == "Hello world"


async def test_a_failure_mid_stream_is_an_error_the_client_raises() -> None:
    front = FrontDoor(fails_with(ProtocolError(ErrorCode.UNREACHABLE, "stage 127.0.0.1:9 is gone"), after=2))
    stream = await oai(front).responses.create(model=NAME, input="hi", stream=True)
    deltas = []
    with pytest.raises(openai.APIError, match="stage 127.0.0.1:9 is gone"):
        async for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
    assert "".join(deltas) == "Hello"


TOOLS = [{"type": "function", "name": "f", "parameters": {}}]


@pytest.mark.parametrize(("extra", "field"), [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text"),
])
async def test_what_the_endpoint_cannot_honour_is_refused_by_name(extra: dict[str, object], field: str) -> None:
    mesh = FakeMesh()
    async with http(FrontDoor(mesh)) as client:
        r = await client.post("/v1/responses", json={"model": NAME, "input": "hi", **extra})
    assert r.status_code == 400 and field in (r.json()["error"]["message"] + str(r.json()["error"]["param"]))
    assert mesh.asked == []


async def test_no_response_is_kept_to_fetch_again() -> None:
    with pytest.raises(openai.NotFoundError, match="keeps no response"):
        await oai(FrontDoor(FakeMesh())).responses.retrieve("resp_123")


async def test_the_texts_logprobs_when_included_whole_and_streamed() -> None:
    mesh = FakeMesh()
    client = oai(FrontDoor(mesh))
    response = await client.responses.create(model=NAME, input="hi", include=["message.output_text.logprobs"],
                                             top_logprobs=2)
    part = response.output[0].content[0]  # type: ignore[union-attr]
    assert mesh.asked[0][1].logprobs == 2 and part.type == "output_text" and part.logprobs is not None
    assert "".join(t.token for t in part.logprobs) == "Hello world"
    assert all(t.logprob == -0.5 and len(t.top_logprobs) == 2 for t in part.logprobs)
    events = [e async for e in await client.responses.create(model=NAME, input="hi", stream=True,
                                                              include=["message.output_text.logprobs"])]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    # each delta carries its own tokens' logprobs (the fake's tokens are its text's pieces)
    assert [[t.token for t in e.logprobs] for e in deltas] == [["Hel"], ["lo"], [" wor"], ["ld"]]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [t.token for t in done.logprobs] == ["Hel", "lo", " wor", "ld"]
    # not included: none, whatever top_logprobs says (as OpenAI's)
    plain = await client.responses.create(model=NAME, input="hi", top_logprobs=3)
    assert mesh.asked[-1][1].logprobs is None and not plain.output[0].content[0].logprobs  # type: ignore[union-attr]


async def test_parallel_function_calls_unless_false() -> None:
    tool = {"type": "function", "name": "get_time",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    client = oai(FrontDoor(FakeMesh(pieces=TWO_CALLS, template=pinned("Qwen-Qwen2.5-7B-Instruct"))))
    for parallel, calls in ((None, 2), (False, 1)):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        response = await client.responses.create(model=NAME, input="hi", tools=[tool], **extra)  # type: ignore[arg-type, list-item]
        made = [item for item in response.output if item.type == "function_call"]
        assert [json.loads(c.arguments) for c in made] == [{"city": "Rome"}, {"city": "Oslo"}][:calls]
        assert response.parallel_tool_calls is (parallel is not False)
        events = [e async for e in await client.responses.create(model=NAME, input="hi", tools=[tool],  # type: ignore[arg-type, list-item]
                                                                  stream=True, **extra)]
        done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
        assert [c.arguments for c in done] == [c.arguments for c in made]
