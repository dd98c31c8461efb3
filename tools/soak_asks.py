"""What tools/soak.py asks, and how it judges each answer: `meshd ask` (greedy, seeded, Ctrl-C'd mid-way) and
HTTP through the official `openai` client (greedy, streamed, seeded, the stream closed mid-way), each
against the whole model's answer generated in-process."""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

PROMPTS = ["Name three colours.", "What is the capital of France?", "Tell me about lighthouses."]
SAMPLED = 0.8  # the temperature of seeded asks
# an ask's stall timeout (`meshd ask --timeout`, the API member's --api-stall-timeout): short, so a stopped stage
# is routed around within it
ASK_STALL = 8.0
ASK_BOUND = 120.0  # seconds any one ask may take before the harness gives up on it (a failure)
FAILOVER = re.compile(r"failed over (\d+) time")


def meshd_command(words: list[str]) -> list[str]:
    """`meshd WORDS` as its user runs it: the `meshd` command's entry point (`python -m meshd`), which
    answers a Ctrl-C that comes while it imports with its one line (`-m meshd.cli` prints a traceback)."""
    return [sys.executable, "-m", "meshd", *words]


# -- the whole model's answers ------------------------------------------------------------------------

def reference_answers(model: Path, max_tokens: int, seeds: list[int]) -> dict[tuple[str, int | None], str]:
    """(prompt, sampling seed or None for greedy) -> the whole model's answer as `meshd ask` prints it, to
    the prompt as one user message on the model's own chat template, as `meshd ask` and the API render it."""
    from meshd.client.chat import ChatRequest, own_or_chatml
    from meshd.engine import chat as native_chat
    from meshd.engine.chain import LocalChain
    from meshd.engine.engine import SamplingParams
    from wire.stage import ChatTemplate

    chain = LocalChain(model, None, n_ctx=1024, n_threads=1)
    out: dict[tuple[str, int | None], str] = {}
    try:
        head = chain.head
        template = own_or_chatml(ChatTemplate(**head.chat_info()))
        for prompt in PROMPTS:
            chat = ChatRequest(messages=[{"role": "user", "content": prompt}])
            text = native_chat.render(chat.as_request(template))["prompt"]
            tokens = head.tokenize(text, add_special=True, parse_special=True)
            for seed in [None, *seeds]:
                params = SamplingParams() if seed is None else SamplingParams(temperature=SAMPLED, seed=seed)
                new = [t for t in chain.generate(tokens, max_tokens, params) if not head.is_eog(t)]
                out[(prompt, seed)] = b"".join(head.token_piece(t) for t in new).decode(errors="replace")
    finally:
        chain.close()
    return out


@dataclass
class Outcome:
    t: float
    kind: str
    mode: str
    prompt: str
    seconds: float
    status: str  # "done", "failed", "wrong", "cancelled"
    error: str = ""
    failovers: int = 0
    explained: bool | None = None


class Asker:
    """Asks one at a time (a soak runs one per kind, side by side) and judges the answers."""

    def __init__(self, rng: random.Random, seed_addr: str, api_url: str, max_tokens: int, seeds: list[int],
                 references: dict[tuple[str, int | None], str], now: Callable[[], float],
                 say: Callable[..., None]) -> None:
        self.rng = rng
        self.seed_addr = seed_addr
        self.api_url = api_url
        self.max_tokens = max_tokens
        self.seeds = seeds
        self.references = references
        self.now = now
        self.say = say
        self.seeded_first: dict[tuple[str, str, int], str] = {}
        self.seeded_differ: list[dict[str, Any]] = []
        self.seeded_whole = {True: 0, False: 0}  # seeded answers equal to the whole model's with that seed, or not

    def judge(self, out: Outcome, text: str, want: str | None, complete: bool, seed: int | None,
              family: str) -> None:
        """`text` against the whole model's answer: equal when complete, a prefix of it when cancelled."""
        if seed is not None:
            key = (family, out.prompt, seed)
            first = self.seeded_first.setdefault(key, text) if complete else None
            if complete and want is not None:
                self.seeded_whole[text == want] += 1
            if complete and (first != text or want is not None and text != want):
                # a pick's draw depends on the seed and the tokens before it alone, on any route and after a
                # failover: a seeded answer is as exact as a greedy one
                self.seeded_differ.append({"t": out.t, "kind": out.kind, "prompt": out.prompt, "seed": seed,
                                           "failovers": out.failovers, "got": text, "first": first,
                                           "whole_model": want})
                out.status = "wrong"
                out.error = f"seeded {seed}: got {text!r}, before {first!r}, the whole model's {want!r}"
                self.say("WRONG", kind=out.kind, mode=out.mode, prompt=out.prompt, seed=seed, got=text[:80])
            return
        assert want is not None
        if (complete and text != want) or (not complete and not want.startswith(text)):
            out.status = "wrong"
            out.error = f"got {text!r}, the whole model's answer is {want!r}"
            self.say("WRONG", kind=out.kind, mode=out.mode, prompt=out.prompt, got=text[:80])

    async def cli_ask(self, mode: str) -> Outcome:
        prompt = self.rng.choice(PROMPTS)
        seed = self.rng.choice(self.seeds) if mode == "seeded" else None
        argv = meshd_command(["ask", "--seed", self.seed_addr, "--max-tokens", str(self.max_tokens),
                           "--timeout", str(ASK_STALL), *(["--temperature", str(SAMPLED), "--sampling-seed",
                                                            str(seed)] if seed is not None else []), prompt])
        out = Outcome(self.now(), "cli", mode, prompt, 0.0, "done")
        began = time.monotonic()
        cancel_at = self.rng.uniform(1.5, 5.0) if mode == "cancel" else ASK_BOUND
        interrupted = False

        async def interrupt(proc: trio.Process) -> None:
            nonlocal interrupted
            interrupted = True
            proc.send_signal(signal.SIGINT if mode == "cancel" else signal.SIGKILL)
            with trio.move_on_after(10):
                await proc.wait()
            proc.kill()

        code: int | None = None
        with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
            with trio.move_on_after(cancel_at):
                code = (await trio.run_process(argv, stdout=stdout, stderr=stderr, check=False,
                                               deliver_cancel=interrupt,
                                               env=os.environ | {"PYTHONUNBUFFERED": "1"})).returncode
            out.seconds = round(time.monotonic() - began, 2)
            stdout.seek(0)
            stderr.seek(0)
            text, err = stdout.read().decode(errors="replace"), stderr.read().decode(errors="replace")
        lines = [line for line in err.splitlines() if line.strip()]
        m = FAILOVER.search(err)
        out.failovers = int(m.group(1)) if m else 0
        want = self.references.get((prompt, seed))
        if "Traceback" in err:
            out.status, out.error = "failed", "traceback: " + " | ".join(lines[-3:])
        elif interrupted and mode == "cancel":
            out.status = "cancelled"
            # what it showed before Ctrl-C: a prefix of the whole model's answer
            self.judge(out, text.removesuffix("\n"), want, False, seed, "cli")
        elif interrupted:
            out.status, out.error = "failed", f"no answer within {ASK_BOUND:.0f} s (the harness's bound)"
        elif code != 0:
            out.status, out.error = "failed", lines[-1] if lines else f"exit {code} with nothing on stderr"
        else:
            self.judge(out, text.removesuffix("\n"), want, True, seed, "cli")
        return out

    def http_blocking(self, mode: str, prompt: str, seed: int | None, chunks_before_cancel: int) -> tuple[str, bool]:
        import openai

        client = openai.OpenAI(base_url=self.api_url, api_key="none", max_retries=0, timeout=60)
        try:
            messages: Any = [{"role": "user", "content": prompt}]
            sampling: dict[str, Any] = {"temperature": 0} if seed is None else {"temperature": SAMPLED, "seed": seed}
            if mode == "greedy":
                reply = client.chat.completions.create(model="", messages=messages, max_tokens=self.max_tokens,
                                                       **sampling)
                return reply.choices[0].message.content or "", True
            stream = client.chat.completions.create(model="", messages=messages, max_tokens=self.max_tokens,
                                                    stream=True, **sampling)
            parts: list[str] = []
            try:
                for i, chunk in enumerate(stream):
                    if mode == "cancel" and i >= chunks_before_cancel:
                        return "".join(parts), False  # the client hangs up mid-answer
                    if chunk.choices:
                        parts.append(chunk.choices[0].delta.content or "")
            finally:
                stream.close()
            return "".join(parts), True
        finally:
            client.close()

    async def http_ask(self, mode: str, prompt: str | None = None) -> Outcome:
        """An ask through the API of ``prompt`` (default: one at random), judged as `meshd ask`'s are."""
        prompt = prompt or self.rng.choice(PROMPTS)
        seed = self.rng.choice(self.seeds) if mode == "seeded" else None
        out = Outcome(self.now(), "http", mode, prompt, 0.0, "done")
        began = time.monotonic()
        cut = self.rng.randint(1, 4)
        result: tuple[str, bool] | None = None
        with trio.move_on_after(ASK_BOUND):
            try:
                result = await trio.to_thread.run_sync(self.http_blocking, mode, prompt, seed, cut,
                                                       abandon_on_cancel=True)
            except Exception as exc:  # what the user of the openai client saw
                out.status, out.error = "failed", f"{type(exc).__name__}: {exc}"[:400]
        out.seconds = round(time.monotonic() - began, 2)
        if out.status == "failed":
            return out
        if result is None:
            out.status, out.error = "failed", f"no answer within {ASK_BOUND:.0f} s (the harness's bound)"
            return out
        text, complete = result
        if not complete:
            out.status = "cancelled"
        # the API renders the chat as `meshd ask` does (the model's own template): a greedy answer is held to
        # the whole model's, a seeded one to the first of its kind (the API's sampler defaults are its own)
        want = self.references[(prompt, None)] if seed is None else None
        self.judge(out, text, want, complete, seed, "http")
        return out
