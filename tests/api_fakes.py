"""A fake mesh for the front door's unit tests: canned answers, recorded requests, failures on demand."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio
from chat_goldens import templates_dir

from meshd.client.ask import AskRequest, AskResult, OnToken, Unchecked, give
from meshd.client.chat import render
from wire.meshrpc import ModelCoverage, StatusReply
from wire.stage import ChatTemplate

DIGEST = "ab" * 32
NAME = "Fake Model"


def coverage(name: str = NAME, digest: str = DIGEST, covered: int = 30, reason: str = "") -> ModelCoverage:
    return ModelCoverage(model=digest, name=name, n_layers=30, covered_layers=covered, assigned=[], replicas=0,
                         reason=reason)


# two calls in the Hermes format of Qwen 2.5's template (pinned("Qwen-Qwen2.5-7B-Instruct")), as a model makes them
TWO_CALLS = (b'<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>\n',
             b'<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>')


def pinned(name: str) -> ChatTemplate:
    """One of llama.cpp's pinned templates (its models/templates/), as a ChatML model's head reports it."""
    return ChatTemplate(template=(templates_dir() / f"{name}.jinja").read_text(), eos_token="<|im_end|>")


@dataclass
class FakeMesh:
    """Answers every ask with `pieces` (then `reason`), or raises `error` after `fail_after` pieces."""

    pieces: Sequence[bytes] = (b"Hel", b"lo", b" wor", b"ld")
    reason: str = "eog"
    prompt_tokens: int = 5
    models: list[ModelCoverage] = field(default_factory=lambda: [coverage()])
    error: Exception | None = None
    fail_after: int = 0
    # each piece waits here, so a test can hold an answer mid-stream
    gate: trio.Event | None = None
    asked: list[tuple[str, AskRequest]] = field(default_factory=list)
    cancelled: int = 0
    started: trio.Event = field(default_factory=trio.Event)
    # after this many pieces a spot check "catches a lie": the answer starts again, with other tokens, so
    # the client's pieces are withdrawn (as meshd.client.ask.give counts them)
    withdraw_after: int | None = None
    # what output verification says of every answer: checked on replicas, these ranges left unchecked
    checked: bool | None = True
    unchecked: list[Unchecked] = field(default_factory=list)
    # where a failover carried every answer onto other numerics (after how many tokens)
    crossed: list[int] = field(default_factory=list)
    # a chat template, as a head would report it: a chat ask is rendered with it (llama.cpp's common/chat,
    # for real), so its canned pieces are parsed into content, reasoning and tool calls as a mesh's are
    template: ChatTemplate | None = None

    def status(self) -> StatusReply:
        return StatusReply(node_id="cd" * 32, term=1, members=[], coverage=self.models)

    async def ask(self, model: str, request: AskRequest, on_token: OnToken | None, result: AskResult) -> AskResult:
        self.asked.append((model, request))
        self.started.set()
        try:
            result.prompt_tokens = list(range(self.prompt_tokens))
            if request.chat is not None and self.template is not None:
                result.rendered = await render(request.chat, self.template)
                # a fake tokenizer: a token a byte of the rendered prompt
                result.prompt_tokens = list(range(len(result.rendered.prompt.encode())))
            if request.count_only:
                # as the head's count: the prompt's tokens, and nothing runs
                result.reason = "counted"
                return result
            pieces = list(self.pieces[:request.max_tokens])
            if self.withdraw_after is not None:
                pieces = pieces[:self.withdraw_after] + pieces
            for i, piece in enumerate(pieces):
                if i == self.withdraw_after:
                    result.restart()
                if self.error is not None and i == self.fail_after:
                    raise self.error
                if self.gate is not None and i > 0:
                    await self.gate.wait()
                await trio.lowlevel.checkpoint()
                if result.first_token_at is None:
                    result.first_token_at = time.perf_counter()
                result.tokens.append(i)
                result.pieces.append(piece)
                if request.logprobs is not None:
                    # a fake's log-probabilities: the same for every token and every alternative
                    result.logprobs.append((piece, -0.5, [(t, -0.5, piece) for t in range(request.logprobs)]))
                if on_token is not None:
                    await give(result, on_token, i, piece)
            if self.error is not None and self.fail_after >= len(self.pieces):
                raise self.error
            # as the tail: the budget ends an answer that the model would have gone on with
            cut = len(self.pieces) >= request.max_tokens and self.reason == "eog"
            result.reason = "max_tokens" if cut else self.reason
            result.finished_at = time.perf_counter()
            result.checked = self.checked
            for note in self.unchecked:
                result.note_unchecked(note)
            result.crossed_numerics_at.extend(self.crossed)
            return result
        except trio.Cancelled:
            self.cancelled += 1
            raise


def fails_with(error: Exception, after: int = 0) -> FakeMesh:
    return FakeMesh(error=error, fail_after=after)
