"""The front door's HTTP behaviour against a fake mesh (named FakeMesh): each dialect's shapes, its
error JSON and status codes, keys, bounds. The official clients talk to the ASGI app in process;
the tests that need a real socket (a client that goes away mid-stream) use Hypercorn on loopback."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import anthropic
import httpx2
import openai
import pytest
import trio
import trio.testing
from api_fakes import DIGEST, NAME, TWO_CALLS, FakeMesh, coverage, fails_with, pinned
from starlette.requests import Request

from meshd.cli.main import main
from meshd.client.ask import AskResult, Gap, Unchecked
from meshd.client.asker import Unverified, member_routes
from meshd.front.app import build_app
from meshd.front.door import MAX_KEY_FILE_BYTES, ApiError, FrontDoor, load_api_keys
from meshd.front.http import BODY_SECONDS, MAX_BODY_BYTES, read_body
from meshd.front.mesh import DaemonMember
from meshd.front.server import MAX_HEAD_BYTES, serve_front
from meshd.front.text import AnswerText
from wire.errors import ErrorCode, ProtocolError

USER = [{"role": "user", "content": "hi"}]


def http(front: FrontDoor) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=build_app(front)), base_url="http://front")


def oai(front: FrontDoor, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://front/v1", api_key=key, max_retries=0, http_client=http(front))


def claude(front: FrontDoor, key: str = "none") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url="http://front", api_key=key, max_retries=0, http_client=http(front))


# ----- the answer's text


def test_stop_string_split_across_pieces_is_cut_and_never_shown() -> None:
    text = AnswerText(["END"])
    shown = [text.feed(p) for p in (b"one E", b"N", b"D and more")]
    assert "".join(shown) == "one " and text.stopped_by == "END" and text.finish() == ""
    assert shown[0] == "one "  # "E" could start the stop string: held back


def test_held_back_text_that_is_no_stop_comes_out() -> None:
    text = AnswerText(["END"])
    assert text.feed(b"an E") == "an "
    assert text.feed(b"dge") == "Edge"
    assert text.feed(b" E") == " "
    assert text.finish() == "E" and text.stopped_by is None and text.text == "an Edge E"


def test_a_character_split_between_pieces_comes_out_whole() -> None:
    text = AnswerText()
    euro = "€".encode()
    assert text.feed(euro[:1]) == ""
    assert text.feed(euro[1:] + b"!") == "€!"


# ----- OpenAI


async def test_chat_completion_with_usage_and_finish_reason() -> None:
    mesh = FakeMesh()
    reply = await oai(FrontDoor(mesh)).chat.completions.create(
        model=NAME, messages=[{"role": "system", "content": "be brief"}, *USER,
                              {"role": "assistant", "content": [{"type": "text", "text": "yes?"}]},
                              {"role": "developer", "content": "plain"}],
        temperature=0.5, top_p=0.9, seed=7, max_completion_tokens=50, stop="zzz")
    assert reply.choices[0].message.content == "Hello world" and reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (5, 4)
    model, asked = mesh.asked[0]
    assert model == DIGEST and asked.max_tokens == 50 and asked.stop == ["zzz"]
    assert asked.chat is not None and asked.messages is None
    assert asked.chat.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "yes?"}, {"role": "system", "content": "plain"}]
    assert (asked.sampling.temperature, asked.sampling.top_p, asked.sampling.seed) == (0.5, 0.9, 7)


async def test_n_choices_are_n_sessions_seeded_one_apart_streamed_and_not() -> None:
    mesh = FakeMesh()
    reply = await oai(FrontDoor(mesh)).chat.completions.create(model=NAME, messages=USER, n=3, seed=5)  # type: ignore[arg-type]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.message.content == "Hello world" for c in reply.choices)
    assert reply.usage is not None and (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (5, 12)
    assert sorted(asked.sampling.seed for _, asked in mesh.asked) == [5, 6, 7]
    mesh = FakeMesh()
    texts: dict[int, str] = {}
    finished = set()
    async for chunk in await oai(FrontDoor(mesh)).chat.completions.create(
            model=NAME, messages=USER, n=2, stream=True, stream_options={"include_usage": True}):  # type: ignore[arg-type]
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 8
    assert texts == {0: "Hello world", 1: "Hello world"} and finished == {0, 1} and len(mesh.asked) == 2


async def test_logprobs_of_each_token_streamed_and_not() -> None:
    mesh = FakeMesh()
    reply = await oai(FrontDoor(mesh)).chat.completions.create(model=NAME, messages=USER, logprobs=True,  # type: ignore[arg-type]
                                                               top_logprobs=2)
    assert mesh.asked[0][1].logprobs == 2
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and "".join(t.token for t in content) == "Hello world"
    assert all(t.logprob == -0.5 and len(t.top_logprobs) == 2 for t in content)
    streamed = []
    async for chunk in await oai(FrontDoor(FakeMesh())).chat.completions.create(
            model=NAME, messages=USER, logprobs=True, stream=True):  # type: ignore[arg-type]
        for c in chunk.choices:
            streamed += [t.token for t in (c.logprobs.content or [])] if c.logprobs else []
    assert "".join(streamed) == "Hello world"
    plain = await oai(FrontDoor(FakeMesh())).chat.completions.create(model=NAME, messages=USER)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None


async def test_budget_reached_is_length_and_the_default_budget_applies() -> None:
    mesh = FakeMesh()
    front = FrontDoor(mesh, default_max_tokens=3)
    reply = await oai(front).chat.completions.create(model=NAME, messages=USER)
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content == "Hello wor"
    assert mesh.asked[0][1].max_tokens == 3 and mesh.asked[0][1].sampling.temperature == 1.0


async def test_chat_stream_with_usage_and_done() -> None:
    mesh = FakeMesh(pieces=(b"Hi", b" the", b"re", b"STOP", b"x"), reason="stop")
    stream = await oai(FrontDoor(mesh)).chat.completions.create(
        model=DIGEST[:12], messages=USER, stream=True, stop=["STOP"], stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hi there"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


async def test_stream_ends_with_done_line() -> None:
    async with http(FrontDoor(FakeMesh())) as client:
        r = await client.post("/v1/chat/completions", json={"messages": USER, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    data = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and "usage" not in json.loads(data[0])


async def test_completions_raw_text_default_budget_and_stream() -> None:
    mesh = FakeMesh(pieces=[b"x"] * 40)
    client = oai(FrontDoor(mesh))
    reply = await client.completions.create(model=NAME, prompt="Once upon")
    assert reply.choices[0].text == "x" * 16 and reply.choices[0].finish_reason == "length"
    assert mesh.asked[0][1].text == "Once upon" and mesh.asked[0][1].messages is None
    stream = await client.completions.create(model=NAME, prompt=["Once"], max_tokens=3, stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == "xxx"


async def test_completion_logprobs_in_the_older_shape_streamed_and_not() -> None:
    # a character split between two tokens: its text begins with the token that completes it
    mesh = FakeMesh(pieces=(b"Caf", b"\xc3", b"\xa9", b" ok"))
    client = oai(FrontDoor(mesh))
    reply = await client.completions.create(model=NAME, prompt="Once", logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and mesh.asked[0][1].logprobs == 2 and reply.choices[0].text == "Café ok"
    assert logprobs.tokens == ["Caf", "\ufffd", "\ufffd", " ok"] and logprobs.token_logprobs == [-0.5] * 4
    assert logprobs.text_offset == [0, 3, 3, 4]
    # the fake's alternatives are each the token itself: one text, one entry
    assert logprobs.top_logprobs == [{"Caf": -0.5}, {"\ufffd": -0.5}, {"\ufffd": -0.5}, {" ok": -0.5}]
    streamed = [c.choices[0].logprobs for c in [c async for c in await client.completions.create(
        model=NAME, prompt="Once", logprobs=0, stream=True)] if c.choices[0].logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens or []] == logprobs.tokens
    assert [o for lp in streamed for o in lp.text_offset or []] == [0, 3, 3, 4]
    assert all(top == {} for lp in streamed for top in lp.top_logprobs or [])
    none = await client.completions.create(model=NAME, prompt="Once", extra_body={"logprobs": False})
    assert none.choices[0].logprobs is None and mesh.asked[-1][1].logprobs is None


async def test_parallel_tool_calls_unless_false() -> None:
    tool = {"type": "function", "function": {"name": "get_time", "parameters": TIME_TOOL["input_schema"]}}
    client = oai(FrontDoor(FakeMesh(pieces=TWO_CALLS, template=pinned(QWEN25))))
    for parallel, calls in ((None, 2), (True, 2), (False, 1)):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        reply = await client.chat.completions.create(model=NAME, messages=USER, tools=[tool], **extra)  # type: ignore[arg-type, list-item]
        made = reply.choices[0].message.tool_calls or []
        assert reply.choices[0].finish_reason == "tool_calls" and len(made) == calls, (parallel, reply)
        assert json.loads(made[0].function.arguments) == {"city": "Rome"}  # type: ignore[union-attr]
        streamed: dict[int, str] = {}
        async for chunk in await client.chat.completions.create(model=NAME, messages=USER, tools=[tool],  # type: ignore[arg-type, list-item]
                                                                stream=True, **extra):
            for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                streamed[call.index] = streamed.get(call.index, "") + (call.function.arguments or "" if call.function
                                                                       else "")
        assert [json.loads(a) for a in streamed.values()] == [{"city": "Rome"}, {"city": "Oslo"}][:calls]


async def test_models_list_coverage_in_each_dialect() -> None:
    front = FrontDoor(FakeMesh(models=[coverage(), coverage("Other", "ef" * 32, covered=10, reason="needs 2 GiB")]))
    listed = [m async for m in oai(front).models.list()]
    assert [m.id for m in listed] == [NAME, "Other"]
    other = listed[1].model_dump()
    assert other["digest"] == "ef" * 32 and other["coverage"]["covered"] is False
    assert other["coverage"]["reason"] == "needs 2 GiB"
    assert [m.id async for m in claude(front).models.list()] == [NAME, "Other"]


# ----- Anthropic


async def test_message_with_system_stop_sequence_and_usage() -> None:
    mesh = FakeMesh(pieces=(b"Hel", b"lo", b" wor", b"ld"), reason="stop")
    reply = await claude(FrontDoor(mesh)).messages.create(
        model=NAME, max_tokens=20, system=[{"type": "text", "text": "be brief"}], stop_sequences=["wor"],
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        # this client version no longer has these as arguments; the API still takes them
        extra_body={"temperature": 0.0, "top_k": 5})
    assert reply.content[0].type == "text" and reply.content[0].text == "Hello "
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", "wor")
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (5, 4)
    asked = mesh.asked[0][1]
    assert asked.chat is not None
    assert asked.chat.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (asked.max_tokens, asked.sampling.temperature, asked.sampling.top_k) == (20, 0.0, 5)


async def test_message_stream_events_in_order() -> None:
    mesh = FakeMesh()
    async with claude(FrontDoor(mesh)).messages.stream(model=NAME, max_tokens=2, messages=USER) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [k for k in kinds if k not in ("text",)] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].type == "text" and final.content[0].text == "Hello"
    assert final.stop_reason == "max_tokens" and (final.usage.input_tokens, final.usage.output_tokens) == (5, 2)


# ----- Claude Code's shapes


QWEN25 = "Qwen-Qwen2.5-7B-Instruct"
TIME_TOOL = {"name": "get_time", "description": "The time in a city",
             "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
# what Claude Code sends beside its messages: the service's own fields, cache marks, a beta's
CLAUDE_CODE: dict[str, object] = {
    "metadata": {"user_id": "user_abc_account_def_session_ghi"}, "service_tier": "auto",
    "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
               {"type": "text", "text": " Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
    "context_management": {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens",
                                                                                       "value": 30000}}]},
    "tools": [{**TIME_TOOL, "cache_control": {"type": "ephemeral"}},
              # one of Anthropic's own tools, which its servers run: nobody here can
              {"type": "web_search_20250305", "name": "web_search", "max_uses": 8}],
}
# a conversation as Claude Code sends it back: the model's thinking and its call, the call's result
TURNS = [
    {"role": "user", "content": [{"type": "text", "text": "Time in Rome?", "cache_control": {"type": "ephemeral"}}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Use the tool.", "signature": "c2lnbmF0dXJl"},
        {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"},
        {"type": "tool_use", "id": "toolu_01", "name": "get_time", "input": {"city": "Rome"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "noon"}],
         "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "And now?"}]},
]
BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27",
         "prompt-caching-scope-2026-01-05"]


async def test_claude_codes_request_shapes_are_answered_streamed_and_not() -> None:
    mesh = FakeMesh(template=pinned(QWEN25))
    client = claude(FrontDoor(mesh))
    args = {"model": NAME, "messages": TURNS, "betas": BETAS, "extra_body": {"temperature": 1}, **CLAUDE_CODE}
    # the client streams a request this long (its own rule); Claude Code streams every one
    async with client.beta.messages.stream(**args, max_tokens=32000,  # type: ignore[arg-type]
                                           thinking={"type": "enabled", "budget_tokens": 31999}) as stream:
        streamed = await stream.get_final_message()
    whole = await client.beta.messages.create(**args, max_tokens=4096,  # type: ignore[arg-type]
                                              thinking={"type": "enabled", "budget_tokens": 2048})
    for reply in (whole, streamed):
        assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == "Hello world"  # type: ignore[union-attr]
    for _, asked in mesh.asked:
        assert asked.chat is not None and asked.chat.enable_thinking
        # the client's own tool only, and the system's blocks as one system message
        assert [t["function"]["name"] for t in asked.chat.tools] == ["get_time"]
        assert asked.chat.messages[0] == {"role": "system", "content": "You are Claude Code. Be brief."}
        # the earlier thinking is the template's reasoning; the redacted one is nothing it can render
        assert asked.chat.messages[2]["reasoning_content"] == "Use the tool."
        assert [m["role"] for m in asked.chat.messages] == ["system", "user", "assistant", "tool", "user"]


async def test_count_tokens_counts_the_prompt_a_message_request_renders() -> None:
    mesh = FakeMesh(template=pinned(QWEN25))
    client = claude(FrontDoor(mesh))
    counted = await client.messages.count_tokens(model=NAME, messages=TURNS,  # type: ignore[arg-type]
                                                 system="Be brief.", tools=[TIME_TOOL])  # type: ignore[list-item]
    beta = await client.beta.messages.count_tokens(model=NAME, messages=TURNS, betas=BETAS,  # type: ignore[arg-type]
                                                   thinking={"type": "enabled", "budget_tokens": 2048},
                                                   system=CLAUDE_CODE["system"], tools=CLAUDE_CODE["tools"],  # type: ignore[arg-type]
                                                   context_management=CLAUDE_CODE["context_management"])  # type: ignore[arg-type]
    without_tools = await client.messages.count_tokens(model=NAME, messages=TURNS, system="Be brief.")  # type: ignore[arg-type]
    answered = await client.messages.create(model=NAME, max_tokens=5, messages=TURNS,  # type: ignore[arg-type]
                                            system="Be brief.", tools=[TIME_TOOL])  # type: ignore[list-item]
    # the fake's tokenizer is a token a byte of the rendered prompt: the count is the message's prompt
    assert counted.input_tokens == answered.usage.input_tokens > without_tools.input_tokens > 0
    assert beta.input_tokens > without_tools.input_tokens
    assert [asked.count_only for _, asked in mesh.asked] == [True, True, True, False]


async def test_thinking_follows_the_template_that_thinks_and_a_template_that_does_not_answers_without_it() -> None:
    pieces = (b"<think>\nA greeting.\n</think>\n\n", b"Hello")
    thinking = FakeMesh(pieces=pieces, template=pinned("Qwen-Qwen3-0.6B"))
    client = claude(FrontDoor(thinking))
    on = await client.messages.create(model=NAME, max_tokens=2048, messages=USER,  # type: ignore[arg-type]
                                      thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in on.content] == ["thinking", "text"]
    assert on.content[0].thinking.strip() == "A greeting." and on.content[1].text == "Hello"  # type: ignore[union-attr]
    async with client.messages.stream(model=NAME, max_tokens=2048, messages=USER,  # type: ignore[arg-type]
                                      thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        final = await stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == "Hello"  # type: ignore[union-attr]
    await client.messages.create(model=NAME, max_tokens=20, messages=USER,  # type: ignore[arg-type]
                                 thinking={"type": "disabled"})
    assert [asked.chat.enable_thinking for _, asked in thinking.asked if asked.chat] == [True, True, False]
    # a template without thinking: the request is taken, the answer has none
    plain = await claude(FrontDoor(FakeMesh(template=pinned(QWEN25)))).messages.create(
        model=NAME, max_tokens=2048, messages=USER, thinking={"type": "enabled", "budget_tokens": 1024})  # type: ignore[arg-type]
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text == "Hello world"  # type: ignore[union-attr]


async def test_parallel_tool_use_unless_disabled() -> None:
    client = claude(FrontDoor(FakeMesh(pieces=TWO_CALLS, template=pinned(QWEN25))))
    for choice, calls in (({"type": "auto"}, 2), ({"type": "auto", "disable_parallel_tool_use": True}, 1)):
        reply = await client.messages.create(model=NAME, max_tokens=200, messages=USER, tools=[TIME_TOOL],  # type: ignore[arg-type, list-item]
                                             tool_choice=choice)  # type: ignore[arg-type]
        uses = [b for b in reply.content if b.type == "tool_use"]
        assert reply.stop_reason == "tool_use" and len(uses) == calls, reply
        assert uses[0].input == {"city": "Rome"}  # type: ignore[union-attr]


# ----- what output verification found, in each dialect


async def test_whether_the_answer_was_verified_reaches_each_dialect_streamed_or_not() -> None:
    note = Unchecked(4, 8, "ef" * 32, 12, Gap.NO_REPLICA)
    for mesh, verified in ((FakeMesh(), True), (FakeMesh(unchecked=[note]), False), (FakeMesh(checked=None), False)):
        front = FrontDoor(mesh)
        field = {"verified": verified, "checked": mesh.checked is True,
                 "unchecked": [{"layers": [4, 8], "node": "ef" * 32, "since": 12, "kind": "no_replica",
                                "why": "no replica"}]
                 if mesh.unchecked else [], "crossed_numerics_at": []}
        header = "true" if verified else "false"
        chat = await oai(front).chat.completions.with_raw_response.create(model=NAME, messages=USER)
        assert chat.headers["x-meshd-verified"] == header and chat.parse().model_extra["meshd"] == field
        text = await oai(front).completions.with_raw_response.create(model=NAME, prompt="hi")
        assert text.headers["x-meshd-verified"] == header and text.parse().model_extra["meshd"] == field
        message = await claude(front).messages.with_raw_response.create(model=NAME, max_tokens=8, messages=USER)
        assert message.headers["x-meshd-verified"] == header and (await message.parse()).model_extra["meshd"] == field
        # streamed, it is known only once the answer is in: the last chunk (and message_delta) carry it
        chunks = [c async for c in await oai(front).chat.completions.create(model=NAME, messages=USER, stream=True)]
        assert [c.model_extra.get("meshd") for c in chunks] == [None] * (len(chunks) - 1) + [field]
        async with claude(front).messages.stream(model=NAME, max_tokens=8, messages=USER) as stream:
            deltas = [e for e in [e async for e in stream] if e.type == "message_delta"]
        assert [d.model_extra["meshd"] for d in deltas] == [field]
        assert "x-meshd-crossed-numerics" not in chat.headers


async def test_an_answer_that_crossed_numerics_says_so_in_each_dialect() -> None:
    front = FrontDoor(FakeMesh(crossed=[3]))
    chat = await oai(front).chat.completions.with_raw_response.create(model=NAME, messages=USER)
    assert chat.headers["x-meshd-crossed-numerics"] == "3"
    assert chat.parse().model_extra["meshd"]["crossed_numerics_at"] == [3]
    message = await claude(front).messages.with_raw_response.create(model=NAME, max_tokens=8, messages=USER)
    assert message.headers["x-meshd-crossed-numerics"] == "3"
    # n choices: where any of them crossed
    both = await oai(front).chat.completions.with_raw_response.create(model=NAME, messages=USER, n=2)
    assert both.headers["x-meshd-crossed-numerics"] == "3"


async def test_an_answer_ended_by_a_stages_session_budget_is_a_length_stop_in_each_dialect() -> None:
    front = FrontDoor(FakeMesh(reason="budget"))
    chat = await oai(front).chat.completions.create(model=NAME, messages=USER)
    message = await claude(front).messages.create(model=NAME, max_tokens=8, messages=USER)
    assert (chat.choices[0].finish_reason, message.stop_reason) == ("length", "max_tokens")


async def test_an_answer_withheld_as_unverified_is_503_in_each_dialect() -> None:
    front = FrontDoor(fails_with(Unverified(AskResult(), "no route was found whose every range a replica checked")))
    with pytest.raises(openai.APIStatusError) as oai_error:
        await oai(front).chat.completions.create(model=NAME, messages=USER)
    with pytest.raises(anthropic.APIStatusError) as claude_error:
        await claude(front).messages.create(model=NAME, max_tokens=8, messages=USER)
    for error in (oai_error.value, claude_error.value):
        assert error.status_code == 503 and "the answer is withheld: no route was found" in error.message


# ----- errors in each dialect's shape


async def test_unknown_model_is_404_in_each_dialect() -> None:
    front = FrontDoor(FakeMesh())
    with pytest.raises(openai.NotFoundError) as o:
        await oai(front).chat.completions.create(model="gpt-4o", messages=USER)
    assert o.value.status_code == 404 and "gpt-4o" in o.value.message and NAME in o.value.message
    assert o.value.body["type"] == "not_found_error" and o.value.code == "model_not_found"
    with pytest.raises(anthropic.NotFoundError) as a:
        await claude(front).messages.create(model="claude-x", max_tokens=5, messages=USER)
    assert a.value.body["type"] == "error" and a.value.body["error"]["type"] == "not_found_error"


async def test_a_model_is_named_by_its_file_as_well_as_its_own_name() -> None:
    """Issue 32: the GGUF's own name is rarely the one its user knows; its file's name works too."""
    other = coverage("Other", "ef" * 32).model_copy(update={"file": "Other-Q4_1"})
    front = FrontDoor(FakeMesh(models=[coverage(), other]))
    async with http(front) as client:
        r = await client.post("/v1/chat/completions", json={"messages": USER, "model": "Other-Q4_1"})
    assert r.status_code == 200 and r.json()["model"] == "Other", r.text


async def test_several_models_and_none_named_is_400() -> None:
    front = FrontDoor(FakeMesh(models=[coverage(), coverage("Other", "ef" * 32)]))
    async with http(front) as client:
        r = await client.post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "Other" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, where", [
    ({"messages": USER, "temperature": 3}, "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0.content"),
    ({"messages": USER, "n": 9}, "n"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": USER, "max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
])
async def test_bad_openai_parameters_are_400_naming_the_field(body: dict[str, object], where: str) -> None:
    mesh = FakeMesh()
    async with http(FrontDoor(mesh)) as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and where.split(".")[0] in error["message"]
    assert mesh.asked == []


@pytest.mark.parametrize("body, where", [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 5, "messages": USER, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "content"),
    ({"max_tokens": 5, "messages": USER, "thinking": {"type": "sometimes"}}, "thinking"),
])
async def test_bad_anthropic_parameters_are_400_in_its_shape(body: dict[str, object], where: str) -> None:
    async with http(FrontDoor(FakeMesh())) as client:
        r = await client.post("/v1/messages", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert where in r.json()["error"]["message"]


async def test_not_json_and_too_large_bodies() -> None:
    async with http(FrontDoor(FakeMesh())) as client:
        json_type = {"content-type": "application/json"}
        bad = await client.post("/v1/messages", content=b"{not json", headers=json_type)
        big = await client.post("/v1/chat/completions", content=b"x" * (MAX_BODY_BYTES + 1), headers=json_type)
        # no Content-Length to refuse by: the body is counted as it comes
        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(MAX_BODY_BYTES // 65536 + 2):
                yield b" " * 65536
        streamed = await client.post("/v1/chat/completions", content=chunks(), headers=json_type)
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]
    assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"
    assert streamed.status_code == 413


async def test_uncovered_model_is_503_with_the_reason_in_each_dialect() -> None:
    reason = "no route for Fake Model: layers [8, 30) have no stage; the members offer 64 MiB, the model needs 180 MiB"
    front = FrontDoor(fails_with(ProtocolError(ErrorCode.NOT_FOUND, reason)))
    with pytest.raises(openai.InternalServerError) as o:
        await oai(front).chat.completions.create(model=NAME, messages=USER, stream=True)
    assert o.value.status_code == 503 and "needs 180 MiB" in o.value.message
    with pytest.raises(anthropic.APIStatusError) as a:
        await claude(front).messages.create(model=NAME, max_tokens=5, messages=USER)
    assert a.value.status_code == 503 and "needs 180 MiB" in a.value.body["error"]["message"]


async def test_busy_mesh_is_429_with_retry_after() -> None:
    front = FrontDoor(fails_with(ProtocolError(ErrorCode.OVERLOADED, "all 8 session slots are busy",
                                               retry_after_ms=1500)))
    async with http(front) as client:
        r = await client.post("/v1/messages", json={"max_tokens": 5, "messages": USER})
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["type"] == "rate_limit_error"


async def test_a_front_door_full_of_asks_refuses_more() -> None:
    mesh = FakeMesh(gate=trio.Event())
    front = FrontDoor(mesh, max_asks=1)
    async with http(front) as client, trio.open_nursery() as nursery:
        nursery.start_soon(partial(client.post, "/v1/chat/completions", json={"messages": USER}))
        await mesh.started.wait()
        r = await client.post("/v1/chat/completions", json={"messages": USER})
        assert r.status_code == 429 and "1 requests at once" in r.json()["error"]["message"]
        mesh.gate.set()
    assert front.asking == {}


async def test_failure_mid_stream_is_an_error_event_in_each_dialect() -> None:
    front = FrontDoor(fails_with(ProtocolError(ErrorCode.UNREACHABLE, "stage 127.0.0.1:9 is gone"), after=2))
    stream = await oai(front).chat.completions.create(model=NAME, messages=USER, stream=True)
    got = []
    with pytest.raises(openai.APIError, match="stage 127.0.0.1:9 is gone"):
        async for chunk in stream:
            got.append(chunk.choices[0].delta.content)
    assert "".join(g or "" for g in got) == "Hello"
    async with http(front) as client:
        r = await client.post("/v1/messages", json={"max_tokens": 9, "messages": USER, "stream": True})
    events = [line.removeprefix("event: ") for line in r.text.splitlines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "error"
    assert "overloaded_error" in r.text.split("event: error")[-1]


async def test_a_stream_whose_text_a_caught_lie_withdrew_ends_with_an_error_saying_so() -> None:
    # (a spot check caught a stage lying after two pieces were sent: the answer starts again, which a
    # stream cannot take back, so the request fails instead of sending the answer again after them)
    stream = await oai(FrontDoor(FakeMesh(withdraw_after=2))).chat.completions.create(
        model=NAME, messages=USER, stream=True)
    got = []
    with pytest.raises(openai.APIError, match="caught lying after 2 token"):
        async for chunk in stream:
            got.append(chunk.choices[0].delta.content)
    assert "".join(g or "" for g in got) == "Hello"
    # a whole answer is sent once it is in: the client never had the withdrawn text
    whole = await oai(FrontDoor(FakeMesh(withdraw_after=2))).chat.completions.create(model=NAME, messages=USER)
    assert whole.choices[0].message.content == "Hello world"


async def test_unknown_path_and_method_in_json() -> None:
    async with http(FrontDoor(FakeMesh())) as client:
        missing = await client.get("/v1/nothing")
        wrong = await client.get("/v1/messages")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert wrong.status_code == 405 and wrong.json()["type"] == "error"


# ----- keys


async def test_keys_are_checked_in_each_dialect(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("\nfirst-key\n  second-key  \n")
    front = FrontDoor(FakeMesh(), load_api_keys(keys))
    with pytest.raises(openai.AuthenticationError) as o:
        await oai(front, "wrong").chat.completions.create(model=NAME, messages=USER)
    assert o.value.status_code == 401 and o.value.body["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError) as a:
        await claude(front, "first-ke").messages.create(model=NAME, max_tokens=5, messages=USER)
    assert a.value.body["error"]["type"] == "authentication_error"
    assert (await oai(front, "second-key").chat.completions.create(model=NAME, messages=USER)).choices
    assert (await claude(front, "first-key").messages.create(model=NAME, max_tokens=5, messages=USER)).content
    async with http(front) as client:
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/v1/models", headers={"authorization": "Basic first-key"})).status_code == 401
        assert (await client.get("/v1/models", headers={"x-api-key": "first-key"})).status_code == 200


@pytest.mark.parametrize("content, why", [("", "holds no API key"), ("\n  \n", "holds no API key")])
def test_a_key_file_without_keys_is_refused(tmp_path: Path, content: str, why: str) -> None:
    keys = tmp_path / "keys"
    keys.write_text(content)
    with pytest.raises(ValueError, match=why):
        load_api_keys(keys)


@pytest.mark.parametrize("argv, line", [
    (["--api", "0.0.0.0:8080"], "meshd join: --api 0.0.0.0:8080 is beyond loopback: give --api-key-file FILE"),
    (["--api", "[::]:8080"], "meshd join: --api [::]:8080 is beyond loopback"),
    (["--api", "192.0.2.1:80"], "meshd join: --api 192.0.2.1:80 is beyond loopback"),
    (["--api-key-file", "keys"], "meshd join: --api-key-file needs --api HOST:PORT"),
    (["--api", "localhost:8080", "--api-key-file", "/nonexistent/keys"], "meshd join: cannot read the API key file"),
    (["--api", "70000"], "meshd join: argument --api: must be a whole number from 0 to 65535"),
])
def test_api_beyond_loopback_without_a_key_is_refused_at_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], line: str) -> None:
    try:
        code = main(["join", "--no-model", "--state-dir", str(tmp_path / "state"), *argv])
    except SystemExit as exit:  # argparse's own refusals
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(line) and err.count("\n") == 1, err
    assert not (tmp_path / "state").exists()  # refused before anything started


# ----- a client that goes away


async def test_client_gone_mid_stream_cancels_the_ask() -> None:
    mesh = FakeMesh(gate=trio.Event())
    front = FrontDoor(mesh)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_front, build_app(front), "127.0.0.1", 0)
        async with httpx2.AsyncClient(base_url=url) as client:
            async with client.stream("POST", "/v1/messages", json={"max_tokens": 9, "messages": USER,
                                                                    "stream": True}) as r:
                async for line in r.aiter_lines():
                    if "content_block_delta" in line:
                        break
        with trio.fail_after(10):
            while mesh.cancelled == 0 or front.asking:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert mesh.cancelled == 1 and not mesh.gate.is_set()


async def test_client_gone_before_a_whole_answer_cancels_the_ask() -> None:
    mesh = FakeMesh(gate=trio.Event())
    front = FrontDoor(mesh)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_front, build_app(front), "127.0.0.1", 0)
        async with httpx2.AsyncClient(base_url=url) as client, trio.open_nursery() as asking:
            asking.start_soon(partial(client.post, "/v1/chat/completions", json={"messages": USER}))
            await mesh.started.wait()
            asking.cancel_scope.cancel()  # the client hangs up while the answer is made
        with trio.fail_after(10):
            while mesh.cancelled == 0 or front.asking:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert mesh.cancelled == 1 and not mesh.gate.is_set()


class FakeDaemon:
    """Routes nothing: the duty's own words for a model it cannot route."""

    def status(self) -> None:
        raise AssertionError("not asked")

    async def planned_route(self, model: str | None, exclude: list[str]) -> None:
        raise ProtocolError(ErrorCode.NOT_FOUND, "no route for Fake Model: layers [8, 30) have no stage")


async def test_no_route_is_not_coverage_once_failed_stages_are_avoided() -> None:
    find_route, _ = member_routes(None, DaemonMember(FakeDaemon()), DIGEST, 5.0)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError) as first:
        await find_route([])
    assert first.value.code is ErrorCode.NOT_FOUND  # the front door says "not covered", with the reason
    with pytest.raises(ProtocolError) as failover:
        await find_route(["ef" * 32])
    assert failover.value.code is ErrorCode.UNREACHABLE and "around the 1 stage(s)" in failover.value.message


# ----- bounds, attacked


async def test_a_body_that_never_ends_is_refused_after_its_time(autojump_clock: trio.testing.MockClock) -> None:
    async def receive() -> dict[str, object]:
        if not sent:
            sent.append(True)
            return {"type": "http.request", "body": b'{"messages": [', "more_body": True}
        await trio.sleep_forever()
        raise AssertionError

    sent: list[bool] = []
    request = Request({"type": "http", "method": "POST", "path": "/v1/messages", "headers": []}, receive)
    start = trio.current_time()
    with pytest.raises(ApiError) as refused:
        await read_body(request)
    assert refused.value.status == 400 and "did not arrive within 30 s" in refused.value.message
    assert trio.current_time() - start == pytest.approx(BODY_SECONDS)


def test_a_key_file_too_large_is_refused_unread(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_bytes(b"k" * (MAX_KEY_FILE_BYTES + 1))
    with pytest.raises(ValueError, match="not an API key file"):
        load_api_keys(keys)


async def test_a_request_head_too_large_is_refused_by_the_server() -> None:
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_front, build_app(FrontDoor(FakeMesh())), "127.0.0.1", 0)
        port = int(url.rsplit(":", 1)[1])
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        # a head that goes on and on, never ending: refused once its bytes pass the bound
        head = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + b"x-junk: aaaaaaaa\r\n" * (MAX_HEAD_BYTES // 16 + 64)
        with trio.fail_after(10):
            await stream.send_all(head)
            reply = b""
            while chunk := await stream.receive_some(65536):
                reply += chunk
        await stream.aclose()
        nursery.cancel_scope.cancel()
    assert reply.startswith(b"HTTP/1.1 431"), reply[:300]  # Request Header Fields Too Large
