#!/usr/bin/env python3
"""Make the chat-template goldens: every template of the pinned llama.cpp's models/templates rendered
by llama.cpp's own renderer (common/chat, the code behind llama-server --jinja, through meshengine),
for a plain conversation and one with tools, a tool call and its result.

Run once (and again only when the llama.cpp pin changes); tests/test_chat_template.py checks that the
engine still renders each the same. With the `jinja2` package present, each plain rendering is also
made by Jinja2's sandbox with the globals Hugging Face's `apply_chat_template` gives a template (a
second opinion, as transformers would render it); where the two differ the golden says so.

    .venv/bin/python tools/chat_goldens.py            # writes tests/chat_goldens.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

GOLDENS = ROOT / "tests" / "chat_goldens.json"
BOS, EOS = "<s>", "</s>"

PLAIN: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "What is 2+2?"},
]
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}]
WITH_TOOLS: list[dict[str, Any]] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21}"},
    {"role": "user", "content": "And in Rome?"},
]


def requests(template: str) -> dict[str, dict[str, Any]]:
    """The two renderings each template gets (the goldens' keys)."""
    base = {"template": template, "bos_token": BOS, "eos_token": EOS, "now": 0}
    return {"plain": {**base, "messages": PLAIN},
            "tools": {**base, "messages": WITH_TOOLS, "tools": TOOLS, "tool_choice": "auto"}}


# Templates print today's date (strftime_now, and the datetime / date_string common/chat gives them) from the
# clock, not from the request: in a golden it is a placeholder, or the goldens would fail tomorrow.
DATE_FORMATS = ("%Y-%m-%d", "%d %b %Y", "%B %d, %Y", "%b %d %Y")


def undated(text: str) -> str:
    today = time.localtime()
    for fmt in DATE_FORMATS:
        text = text.replace(time.strftime(fmt, today), "{today}")
    return text


def summary(out: dict[str, Any]) -> dict[str, Any]:
    """What a golden keeps of a rendering: the prompt whole (today's date a placeholder), the grammar by its
    hash."""
    return {"prompt": undated(out["prompt"]), "format": out["format"], "grammar_lazy": out["grammar_lazy"],
            "grammar_sha256": hashlib.sha256(out["grammar"].encode()).hexdigest() if out["grammar"] else "",
            "triggers": out["grammar_triggers"], "generation_prompt": undated(out["generation_prompt"])}


def render_one(request: dict[str, Any]) -> dict[str, Any]:
    from meshd.engine import chat
    from meshd.engine.engine import EngineError

    try:
        return summary(chat.render(request))
    except EngineError as exc:
        return {"error": str(exc)}


def jinja2_plain(template: str) -> str | None:
    """The plain conversation as transformers' apply_chat_template renders it (None: no jinja2, or it failed)."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: "01 Jan 1970"
    try:
        return env.from_string(template).render(messages=PLAIN, add_generation_prompt=True, bos_token=BOS,
                                                eos_token=EOS)
    except Exception:
        return None


def templates_dir() -> Path:
    from build_native import patched_source, read_lock

    return patched_source(read_lock()) / "models" / "templates"


def make() -> dict[str, Any]:
    goldens: dict[str, Any] = {}
    for path in sorted(templates_dir().glob("*.jinja")):
        template = path.read_text()
        entry: dict[str, Any] = {name: render_one(req) for name, req in requests(template).items()}
        second = jinja2_plain(template)
        if second is not None and "prompt" in entry["plain"]:
            entry["jinja2_agrees"] = undated(second) == entry["plain"]["prompt"]
        goldens[path.name] = entry
    return goldens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=GOLDENS)
    args = parser.parse_args()
    goldens = make()
    args.out.write_text(json.dumps(goldens, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
    failed = [n for n, g in goldens.items() if "error" in g["plain"] or "error" in g["tools"]]
    agree = [n for n, g in goldens.items() if g.get("jinja2_agrees")]
    judged = [n for n, g in goldens.items() if "jinja2_agrees" in g]
    print(f"{len(goldens)} templates, {len(failed)} with a rendering that failed "
          f"({', '.join(failed) or 'none'}); jinja2 agrees on {len(agree)} of {len(judged)} plain renderings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
