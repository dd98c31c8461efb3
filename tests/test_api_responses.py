"""OpenAI's Responses API (/v1/responses) with the official client, against the fake mesh (api_fakes)."""

from __future__ import annotations

import openai
import pytest
from api_fakes import NAME, FakeMesh, fails_with
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
