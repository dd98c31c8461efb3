"""Attacking members against real `meshd serve` stages: stolen sessions, forged hops, bad carried ids.

The attacker is meshd's own peer code driven to do what an honest asker or
stage never does: re-open an honest session (whose id a stage on its route
sees) at a higher epoch, feed that session a hop stream of its own, and carry
an out-of-vocabulary token id to the tail, where it would reach the sampler's
repetition-penalty history in the same engine call as everyone else's rows.
Each attack happens while an honest ask is mid-answer (inside its token
callback, so the session is certainly held), is refused with a typed error,
and the honest answer is still the one an undisturbed ask gives.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import numpy as np
import pytest
import trio
from localmesh import Served, start_serve
from test_hostile_stage import drain, typed_error

from meshd.client.ask import AskRequest, AskResult
from meshd.client.route import route_at
from meshd.client.session import run_session
from meshd.net.peers import Peers, open_peers
from wire.errors import ErrorCode
from wire.identity import NodeIdentity
from wire.stage import STAGE_PROTOCOL, Hop, Open, Opened, PeerRef, new_session_id
from wire.tensors import Activation, TensorEntry

pytestmark = pytest.mark.slow

N_EMBD = 576
HONEST = AskRequest(text="The three primary colours are", max_tokens=12)


@pytest.fixture(scope="module")
def stages() -> Iterator[list[Served]]:
    served: list[Served] = []
    try:
        for layers in ("0:10", "10:30"):
            served.append(start_serve("--layers", layers, "--threads", "1", "--max-sessions", "4"))
        yield served
    finally:
        for s in served:
            s.stop()


@pytest.fixture
async def attacker() -> AsyncIterator[tuple[Peers, PeerRef]]:
    """An attacking member: a fresh identity that listens (draining) so a stage can dial it."""
    async with open_peers(NodeIdentity.generate()) as peers:
        peers.handle(STAGE_PROTOCOL, drain)
        port = await peers.listen("127.0.0.1", 0)
        yield peers, PeerRef(address=f"127.0.0.1:{port}", node_id=peers.node_id)


async def honest_ask(stages: list[Served], session: str | None = None,
                     attack: Callable[[], Awaitable[None]] | None = None) -> list[int]:
    """An honest asker of its own identity; ``attack`` runs once, awaited, at its first token."""
    ran: list[int] = []

    async def on_token(token: int, piece: bytes) -> None:
        if attack is not None and not ran:
            ran.append(token)
            await attack()

    async with open_peers(NodeIdentity.generate()) as peers:
        with trio.fail_after(120):
            result = await run_session(peers, route_at([s.address for s in stages]), HONEST, AskResult(),
                                       on_token=on_token, session_id=session)
    assert len(result.tokens) == HONEST.max_tokens
    assert attack is None or ran, "the attack never ran"
    return result.tokens


async def test_an_open_at_a_higher_epoch_from_another_node_is_refused(
        stages: list[Served], attacker: tuple[Peers, PeerRef]) -> None:
    peers, sink = attacker
    before = await honest_ask(stages)
    session = new_session_id()

    async def hijack() -> None:
        for stage in stages:
            control = await peers.open_stream(stage.address, STAGE_PROTOCOL)
            async with control:
                await control.send_message(Open(session=session, epoch=7, next=sink, head=sink))
                err = await typed_error(control)
            assert err.code == ErrorCode.UNAUTHORIZED, err
            assert "belongs to another node" in err.message

    assert await honest_ask(stages, session, hijack) == before


async def test_a_hop_stream_from_anyone_but_the_named_upstream_is_refused(
        stages: list[Served], attacker: tuple[Peers, PeerRef]) -> None:
    peers, _ = attacker
    before = await honest_ask(stages)
    session = new_session_id()
    head, tail = stages

    async def forge() -> None:
        # the tail's upstream is the head, the head's (its ring) is the tail; the attacker is neither
        for stage, ring in ((tail, False), (head, True)):
            hop = await peers.open_stream(stage.address, STAGE_PROTOCOL)
            async with hop:
                await hop.send_message(Hop(session=session, epoch=0, ring=ring, prompt_tokens=1))
                err = await typed_error(hop)
            assert err.code == ErrorCode.UNAUTHORIZED, err
            assert "takes its rows from another node" in err.message

    assert await honest_ask(stages, session, forge) == before


async def test_an_out_of_vocabulary_carried_token_fails_only_its_own_session(
        stages: list[Served], attacker: tuple[Peers, PeerRef]) -> None:
    peers, sink = attacker
    before = await honest_ask(stages)
    tail = stages[1]

    async def carry_bad_id() -> None:
        control = await peers.open_stream(tail.address, STAGE_PROTOCOL)
        async with control:
            await control.send_message(Open(session="oov", epoch=0, head=sink))
            assert isinstance(await control.receive_message(), Opened)
            hop = await peers.open_stream(tail.address, STAGE_PROTOCOL)
            async with hop:
                # the Hop says the ids are sent to this stage, so they are looked at
                await hop.send_message(Hop(session="oov", epoch=0, prompt_tokens=4, carry_tokens=1))
                rows = TensorEntry.from_array("hidden_states", np.zeros((1, N_EMBD), dtype=np.float32))
                # a prompt position: its carried id would go into the sampler's history
                await hop.send_message(Activation(session="oov", epoch=0, step=0, pos=0, n_tokens=1,
                                                  tensors=[rows], tokens=[1_000_000]))
                err = await typed_error(control)
        assert err.code == ErrorCode.BAD_REQUEST, err
        assert "token id 1000000 is outside the vocabulary" in err.message

    assert await honest_ask(stages, attack=carry_bad_id) == before


@pytest.mark.parametrize("target", ["127.0.0.1:{port}/admin", "ws://127.0.0.1:{port}/status?x=1",
                                    "http://127.0.0.1:{port}", "127.0.0.1"])
async def test_an_open_naming_a_url_with_a_path_is_refused_before_anything_is_dialled(
        stages: list[Served], attacker: tuple[Peers, PeerRef], target: str) -> None:
    peers, _ = attacker
    hits: list[int] = []

    async def web(stream: trio.SocketStream) -> None:
        hits.append(1)
        await stream.send_all(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, web, 0)
        port = listeners[0].socket.getsockname()[1]
        control = await peers.open_stream(stages[0].address, STAGE_PROTOCOL)
        async with control:
            await control.send_message(Open(session=new_session_id(), epoch=0,
                                            next=PeerRef(address=target.format(port=port))))
            err = await typed_error(control)
        nursery.cancel_scope.cancel()
    assert err.code == ErrorCode.BAD_REQUEST and err.message == "a stage dials only host:port addresses"
    assert hits == []


async def test_an_unreachable_next_stage_is_reported_without_what_the_far_side_said(
        stages: list[Served], attacker: tuple[Peers, PeerRef]) -> None:
    peers, _ = attacker

    async def web(stream: trio.SocketStream) -> None:
        await stream.send_all(b"HTTP/1.1 403 Forbidden: secret-internal-reason\r\nContent-Length: 0\r\n\r\n")

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, web, 0)
        port = listeners[0].socket.getsockname()[1]
        control = await peers.open_stream(stages[0].address, STAGE_PROTOCOL)
        async with control:
            await control.send_message(Open(session=new_session_id(), epoch=0,
                                            next=PeerRef(address=f"127.0.0.1:{port}")))
            err = await typed_error(control)
        nursery.cancel_scope.cancel()
    assert err.code == ErrorCode.UNREACHABLE
    assert err.message == f"the next stage 127.0.0.1:{port} is unreachable"
    assert "Forbidden" not in err.message and "secret" not in err.message  # (a port may hold "403")
    assert await honest_ask(stages) == await honest_ask(stages)
