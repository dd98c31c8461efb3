"""Token ids reach only the stages that need them (issue 14): a middle stage gets rows only.

Three stages of the default model in this process (each with its own engine
worker) and a whole-model stage for reference. The middle stage is an observer,
as an attacker would run one: it records every message it receives. The tail
has the prompt's ids from the asker (its sampler's penalty history, its
drafter's text), so answers with a repetition penalty and with prompt-lookup
speculation equal the whole model's. A stage refuses ids it was not to get, the
tail refuses a stranger's, and a tail the asker sends no ids fails that session
with a typed error. (The hash-routed case, where the ids do ride to a middle
stage, is tests/test_arch_dsv4.py's serve test.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import trio
from attacks import stranger_error

from meshd.client.ask import AskRequest, AskResult
from meshd.client.route import route_at
from meshd.client.session import run_session
from meshd.net.peers import Peers, PeersConfig, open_peers
from meshd.net.stream import Stream
from meshd.stage.books import StageLimits
from meshd.stage.node import StageNode, stage_node
from meshd.stage.service import StageService
from wire.errors import ErrorCode
from wire.identity import NodeIdentity
from wire.message import Message
from wire.stage import Hop, Open, PromptTokens, Sampling
from wire.tensors import Activation

pytestmark = pytest.mark.slow  # four engine workers

# every ask ends within this (a bound against hangs, not a speed claim)
ASK_DEADLINE = 120
PASSAGE = ("The lighthouse keeper climbed the stairs every evening at dusk. He wiped the lens, trimmed the wick "
           "and lit the lamp, and the beam swept across the dark water until morning.")
REWRITE = f"Repeat the following passage word for word.\n\n{PASSAGE}"
# the tail waits this long for the asker's ids before it fails the session (short: one case waits it out)
HOP_TIMEOUT = 2.0


class ObserverStage:
    """An attacker-style middle stage: it serves honestly and records every message it receives."""

    def __init__(self, service: StageService) -> None:
        self.received: list[Message] = []
        serve = service.handle_first

        async def recording_first(stream: Stream, first: Message) -> None:
            self.received.append(first)
            receive = stream.receive_message

            async def recording_receive() -> Message:
                msg = await receive()
                self.received.append(msg)
                return msg

            stream.receive_message = recording_receive  # type: ignore[method-assign]
            set_hook = stream.set_message_hook

            def recording_hook(hook: Callable[[Message], bool] | None) -> None:
                # what a hop stream's hook takes never reaches receive_message: record it here
                def recorded(msg: Message) -> bool:
                    self.received.append(msg)
                    if hook is not None and hook(msg):
                        return True
                    self.received.pop()  # left to the reader, which records it
                    return False

                set_hook(recorded)

            stream.set_message_hook = recording_hook  # type: ignore[method-assign]
            await serve(stream, first)

        service.handle_first = recording_first  # type: ignore[method-assign]

    def of(self, kind: type[Message]) -> list[Message]:
        return [m for m in self.received if isinstance(m, kind)]


@asynccontextmanager
async def stages(model: Path, ranges: Sequence[tuple[int, int]]) -> AsyncIterator[list[StageNode]]:
    limits = StageLimits(max_sessions=4, max_session_tokens=512, hop_timeout=HOP_TIMEOUT)
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(stage_node(
            model, layers, limits, NodeIdentity.generate(), PeersConfig(drain_timeout=0.5), threads=1))
            for layers in ranges]


async def ask(peers: Peers, nodes: Sequence[StageNode], request: AskRequest) -> AskResult:
    with trio.fail_after(ASK_DEADLINE):
        return await run_session(peers, route_at([n.address for n in nodes]), request, AskResult())


async def test_a_middle_stage_gets_rows_only_and_the_answers_stay_the_whole_models(default_model: Path) -> None:
    penalised = AskRequest(messages=[{"role": "user", "content": "Name three colours, then three more."}],
                           max_tokens=24, sampling=Sampling(repeat_penalty=1.5, repeat_last_n=64))
    rewrite = AskRequest(messages=[{"role": "user", "content": REWRITE}], max_tokens=24, speculate="ngram")
    async with open_peers(NodeIdentity.generate(), PeersConfig(drain_timeout=0.5)) as peers:
        async with stages(default_model, [(0, 30)]) as (whole,):
            want_penalised = (await ask(peers, [whole], penalised)).tokens
            want_rewrite = (await ask(peers, [whole], AskRequest(messages=rewrite.messages, max_tokens=24))).tokens
        async with stages(default_model, [(0, 10), (10, 20), (20, 30)]) as nodes:
            observer = ObserverStage(nodes[1].service)
            # the daemons' path: every message the middle stage gets is seen
            got_penalised = await ask(peers, nodes, replace(penalised, fast=False))
            got_rewrite = await ask(peers, nodes, replace(rewrite, fast=False))

            # the middle stage served both answers from rows alone: no id, no prompt text reached it
            activations = observer.of(Activation)
            # (a step per token without speculation: the prompt's rows, then one row per token after the first)
            assert len(activations) > len(got_penalised.tokens)
            assert all(a.tokens is None for a in activations)  # type: ignore[attr-defined]
            assert all(h.carry_tokens == 0 for h in observer.of(Hop))  # type: ignore[attr-defined]
            assert not observer.of(PromptTokens)
            for opened in observer.of(Open):
                assert "colours" not in opened.model_dump_json() and "lighthouse" not in opened.model_dump_json()
            # the fast path: the rows reach the middle's worker without its daemon, which sees no
            # activation; its Hop says no ids come (its worker refuses rows that carry any)
            seen = len(observer.of(Hop))
            fast_penalised = await ask(peers, nodes, penalised)
            fast_rewrite = await ask(peers, nodes, rewrite)
            assert len(observer.of(Activation)) == len(activations) and not observer.of(PromptTokens)
            fast_hops = observer.of(Hop)[seen:]
            assert len(fast_hops) == 2 and all(h.fast is not None and h.carry_tokens == 0  # type: ignore[attr-defined]
                                               for h in fast_hops)

            # a stage the session sends no ids refuses rows with them; the middle takes no prompt ids
            width = nodes[1].service.report.stage_width  # every stage of a split takes the residual
            err = await stranger_error(peers, nodes[1].address, width, [1, 2], 0)
            assert err.code is ErrorCode.BAD_REQUEST and "sends this stage none" in err.message, err
            err = await stranger_error(peers, nodes[1].address, width, None, 0, prompt_ids=[1, 2])
            assert err.code is ErrorCode.BAD_REQUEST and "only a tail" in err.message, err
            # the tail checks the asker's ids (count, vocabulary), and without them fails that session
            err = await stranger_error(peers, nodes[2].address, width, None, 0, prompt_ids=[1, 2, 3])
            assert err.code is ErrorCode.BAD_REQUEST and "3 token ids for a prompt of 2" in err.message, err
            err = await stranger_error(peers, nodes[2].address, width, None, 0, prompt_ids=[1] * 513)
            assert err.code is ErrorCode.BAD_REQUEST and "session budget of 512" in err.message, err
            err = await stranger_error(peers, nodes[2].address, width, None, 0, prompt_ids=[1, 1 << 30])
            assert err.code is ErrorCode.BAD_REQUEST and "outside the vocabulary" in err.message, err
            err = await stranger_error(peers, nodes[2].address, width, None, 0)
            assert err.code is ErrorCode.BAD_REQUEST and "no token ids of the prompt" in err.message, err

            # and the route still answers the same after the strangers
            again = await ask(peers, nodes, penalised)
    assert got_penalised.tokens == want_penalised == again.tokens == fast_penalised.tokens
    assert got_rewrite.tokens == want_rewrite == fast_rewrite.tokens
    # prompt lookup drafted from the prompt's ids, which only the asker gave the tail
    assert got_rewrite.accepted > 0
