"""The model's own chat template, tool calls and grammars through llama.cpp's common/chat (meshd.engine.chat):
every pinned template renders as its golden (tools/chat_goldens.py made them with the same renderer), the
tool-call formats parse, and a grammar at the sampler makes even the 135M default model answer in shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from chat_goldens import GOLDENS, requests, summary, templates_dir

from meshd.client.chat import ChatRequest, Rendered
from meshd.engine import chat
from meshd.engine.chain import LocalChain
from meshd.engine.engine import InvalidInput, Model, Sampler
from wire.stage import ChatTemplate

GOLDEN = json.loads(GOLDENS.read_text())
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather now in a city",
                                           "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def templates() -> Path:
    return templates_dir()


def test_every_pinned_template_has_a_golden(templates: Path) -> None:
    assert sorted(p.name for p in templates.glob("*.jinja")) == sorted(GOLDEN)
    assert len(GOLDEN) >= 70


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_each_pinned_template_renders_as_its_golden(templates: Path, name: str) -> None:
    for kind, request in requests((templates / name).read_text()).items():
        try:
            got = summary(chat.render(request))
        except InvalidInput as exc:
            got = {"error": str(exc)}
        assert got == GOLDEN[name][kind], f"{name} {kind}"


def test_the_goldens_render_tools_and_the_tool_result() -> None:
    """Not vacuous: nearly every template renders both conversations, and the tool-use ones show the
    tool's name and the tool's result in the prompt."""
    rendered = [g for g in GOLDEN.values() if "prompt" in g["plain"] and "prompt" in g["tools"]]
    assert len(rendered) >= 65
    assert sum("get_weather" in g["tools"]["prompt"] and "21" in g["tools"]["prompt"] for g in rendered) >= 50


def render(template: str, **fields: Any) -> dict[str, Any]:
    return chat.render({"template": template, "bos_token": "<s>", "eos_token": "</s>", "now": 0, **fields})


@pytest.mark.parametrize(("name", "output"), [
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>'),
    ("Qwen-Qwen2.5-7B-Instruct.jinja",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>'),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja",
     '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}'),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja",
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}, "id": "abcdef123"}]'),
])
def test_a_tool_call_in_the_templates_format_parses_into_the_call(templates: Path, name: str, output: str) -> None:
    out = render((templates / name).read_text(), messages=[{"role": "user", "content": "Weather in Rome?"}],
                 tools=TOOLS, tool_choice="auto")
    spec = {"format": out["format"], "parser": out["parser"], "generation_prompt": out["generation_prompt"]}
    message = chat.parse(spec, output, False)
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"], message
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome", "unit": "celsius"}
    # plain text stays content
    assert chat.parse(spec, "It is sunny.", False)["content"] == "It is sunny."


def test_required_tool_choice_gives_a_strict_grammar_and_auto_a_lazy_one(templates: Path) -> None:
    template = (templates / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    required = render(template, messages=messages, tools=TOOLS, tool_choice="required")
    auto = render(template, messages=messages, tools=TOOLS, tool_choice="auto")
    assert required["grammar"] and not required["grammar_lazy"]
    assert auto["grammar"] and auto["grammar_lazy"] and auto["grammar_triggers"]
    assert not render(template, messages=messages)["grammar"]


def test_a_broken_template_or_request_is_a_clear_error() -> None:
    with pytest.raises(InvalidInput, match="chat template"):
        render("{% for m in messages %}{{ m.content }", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(InvalidInput, match="chat template"):
        chat.render({"template": "{{ 1 }}", "messages": "not a list"})
    with pytest.raises(InvalidInput, match="json schema"):
        chat.schema_grammar({"type": "no-such-type"})


@pytest.fixture(scope="module")
def smollm2(default_model: Path) -> Any:
    chain = LocalChain(default_model, None, n_ctx=1024, n_threads=1)
    yield chain
    chain.close()


async def rendered_for(head: Model, request: ChatRequest, template: str | None = None) -> Rendered:
    """``request`` rendered with the model's template, or with ``template`` (a pinned tool-use one: the
    default model's own describes no tools, so llama.cpp offers it none)."""
    from meshd.client.chat import render as render_chat

    info = head.chat_info()
    return await render_chat(request, ChatTemplate(**{**info, **({"template": template} if template else {})}))


def qwen25(templates: Path) -> str:
    """Qwen 2.5's template: ChatML, as SmolLM2's, whose tokens the default model knows, with Hermes-style
    <tool_call> blocks."""
    return (templates / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()


def answer(chain: LocalChain, rendered: Rendered, new_tokens: int = 64) -> str:
    assert rendered.grammar is not None
    prompt = chain.head.tokenize(rendered.prompt, add_special=True, parse_special=True)
    spec = rendered.grammar.model_dump()
    tokens = [t for t in chain.generate(prompt, new_tokens, grammar=spec) if not chain.head.is_eog(t)]
    return chain.head.detokenize(tokens)


async def test_the_default_models_template_is_its_own(smollm2: LocalChain) -> None:
    info = smollm2.head.chat_info()
    assert "<|im_start|>" in info["template"]
    out = await rendered_for(smollm2.head, ChatRequest(messages=[{"role": "user", "content": "Hi"}]))
    # SmolLM2's template names its default system prompt; llama.cpp's built-in chatml does not
    assert "SmolLM" in out.prompt and out.prompt.endswith("<|im_start|>assistant\n")
    assert "SmolLM" not in smollm2.head.apply_chat([{"role": "user", "content": "Hi"}])


async def test_a_json_schema_answer_of_the_default_model_validates(smollm2: LocalChain) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    rendered = await rendered_for(smollm2.head, ChatRequest(
        messages=[{"role": "user", "content": "Give a person's name and age as JSON."}], json_schema=schema))
    text = answer(smollm2, rendered)
    # the grammar lets a fenced block (```json) hold the object; the template's parser takes it out
    jsonschema.validate(json.loads(chat.parse(rendered.parser, text, False)["content"]), schema)


@pytest.mark.parametrize("choice", ["required", "named"])
async def test_a_required_tool_call_of_the_default_model_parses_and_validates(smollm2: LocalChain, templates: Path,
                                                                            choice: str) -> None:
    tools = TOOLS + [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    if choice == "named":
        tools = TOOLS
    rendered = await rendered_for(smollm2.head, ChatRequest(
        messages=[{"role": "user", "content": "What is the weather in Rome?"}], tools=tools, tool_choice="required"),
        qwen25(templates))
    text = answer(smollm2, rendered)
    message = chat.parse(rendered.parser, text, False)
    calls = message["tool_calls"]
    assert calls, (text, message)
    assert calls[0]["function"]["name"] in {t["function"]["name"] for t in tools}
    if calls[0]["function"]["name"] == "get_weather":
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER)


async def test_a_grammar_fed_an_answers_start_continues_it_exactly(smollm2: LocalChain, templates: Path) -> None:
    """A failover's new tail: its grammar reads the tokens generated so far (grammar_accept) and the
    rest of the greedy answer is the same."""
    rendered = await rendered_for(smollm2.head, ChatRequest(
        messages=[{"role": "user", "content": "Weather in Rome?"}], tools=TOOLS, tool_choice="required"),
        qwen25(templates))
    assert rendered.grammar is not None
    head = smollm2.head
    prompt = head.tokenize(rendered.prompt, add_special=True, parse_special=True)
    spec = rendered.grammar.model_dump()
    whole = list(smollm2.generate(prompt, 40, grammar=spec))
    cut = 12
    sampler = Sampler(head)
    sampler.set_grammar(spec)
    for t in whole[:cut]:
        sampler.grammar_accept(t)
    for c in smollm2.contexts:
        c.clear()
    logits = smollm2.forward(prompt + whole[:cut], 0)
    pos = len(prompt) + cut
    rest: list[int] = []
    for _ in range(len(whole) - cut):
        token = sampler.sample(logits[-1])
        rest.append(token)
        if head.is_eog(token):
            break
        logits = smollm2.forward([token], pos)
        pos += 1
    sampler.close()
    assert whole[cut:] == rest
    with pytest.raises(InvalidInput, match="grammar"):
        # a token the grammar cannot take there
        bad = Sampler(head)
        bad.set_grammar(spec)
        bad.grammar_accept(head.tokenize("zzz", add_special=False)[0])


def test_a_bad_grammar_from_a_peer_fails_that_sampler_alone(smollm2: LocalChain) -> None:
    """What an asker sends the tail (wire.stage.Grammar) reaches llama.cpp's grammar parser: a bad one is
    a clear error of that session, and the sampler still samples unconstrained."""
    head = smollm2.head
    bad_specs: list[dict[str, Any]] = [
        {"gbnf": "root ::= ("},
        {"gbnf": "root ::= undefined-rule"},
        {"gbnf": 'root ::= "a"', "lazy": True, "triggers": []},
        {"gbnf": 'root ::= "a"', "triggers": [{"type": "nonsense", "value": "x"}]},
        {"gbnf": ""},
    ]
    for spec in bad_specs:
        sampler = Sampler(head)
        with pytest.raises(InvalidInput):
            sampler.set_grammar(spec)
        for c in smollm2.contexts:
            c.clear()
        logits = smollm2.forward(head.tokenize("Hello", add_special=False), 0)
        assert 0 <= sampler.sample(logits[-1]) < head.report.n_vocab
        sampler.close()
    # a grammar that admits one string gives exactly it
    sampler = Sampler(head)
    sampler.set_grammar({"gbnf": 'root ::= "yes"'})
    for c in smollm2.contexts:
        c.clear()
    prompt = head.tokenize("Say no:", add_special=False)
    out: list[int] = []
    logits = smollm2.forward(prompt, 0)
    for i in range(8):
        token = sampler.sample(logits[-1])
        if head.is_eog(token):
            break
        out.append(token)
        logits = smollm2.forward([token], len(prompt) + i)
    sampler.close()
    assert head.detokenize(out) == "yes"


def test_documents_and_template_kwargs_reach_the_template(templates: Path) -> None:
    """chat_template_kwargs become the template's variables (llama-server's way): Granite's documents, and
    Qwen 3's enable_thinking."""
    granite = (templates / "ibm-granite-granite-3.3-2B-Instruct.jinja").read_text()
    docs = [{"doc_id": 1, "title": "Lighthouses", "text": "The Pharos stood at Alexandria."}]
    out = render(granite, messages=[{"role": "user", "content": "What does the document say?"}],
                 chat_template_kwargs={"documents": docs})
    assert "The Pharos stood at Alexandria." in out["prompt"]
    assert "Alexandria" not in render(granite, messages=[{"role": "user", "content": "Hi"}])["prompt"]
    qwen3 = (templates / "Qwen-Qwen3-0.6B.jinja").read_text()
    messages = [{"role": "user", "content": "Hi"}]
    thinking = render(qwen3, messages=messages)["prompt"]
    plain = render(qwen3, messages=messages, chat_template_kwargs={"enable_thinking": False})["prompt"]
    assert plain != thinking and "<think>" in plain and "<think>" not in thinking[-20:]
