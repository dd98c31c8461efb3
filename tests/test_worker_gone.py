"""A volunteer whose engine worker cannot come back (its model file deleted under it), with real
`meshd join` daemons on loopback: it gives the worker up, says why in one log line, withdraws its
range from its signed record, and answers the stage protocol with a typed error that says so; the
tracker routes the model over the volunteer that still has its file."""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from attacks import typed_error
from localmesh import Served, mesh_status, start_join, stop_all
from test_mesh_daemons import workers

from meshd.client.ask import AskRequest
from meshd.client.failover import ask_with_failover
from meshd.client.route import Stage, route_from_reply
from meshd.engine.supervisor import EngineSupervisor
from meshd.net.peers import Peers
from meshd.net.rpc import mesh_rpc
from tests.conftest import greedy_reference
from wire.errors import ErrorCode
from wire.meshrpc import RouteReply, RouteRequest, StatusReply
from wire.stage import STAGE_PROTOCOL, Open, new_session_id

pytestmark = pytest.mark.slow  # three daemons and two engine workers

PROMPT = "Name three colours."
TOKENS = 8
SESSIONS = ["--threads", "1", "--max-sessions", "2", "--session-tokens", "256"]


@pytest.fixture
def mesh(tmp_path: Path, tiny_models: dict[str, Path]) -> Iterator[list[Served]]:
    """A seed and two volunteers, each with its own copy of one tiny model (one digest)."""
    nodes: list[Served] = []
    try:
        nodes.append(start_join("--no-model", "--state-dir", str(tmp_path / "seed"), *SESSIONS))
        for name in ("a", "b"):
            model = tmp_path / name / "tiny.gguf"
            model.parent.mkdir()
            shutil.copy(tiny_models["llama-gqa-untied"], model)
            nodes.append(start_join("--seed", nodes[0].address, "--model", str(model),
                                    "--state-dir", str(tmp_path / f"state-{name}"), *SESSIONS))
        yield nodes
    finally:
        stop_all(nodes)


async def until(peers: Peers, node: Served, done: object, timeout: float = 60.0) -> StatusReply:
    """`node`'s status once `done(view)` holds."""
    assert callable(done)
    with trio.fail_after(timeout):
        while not done(view := await mesh_status(peers, node)):
            await trio.sleep(0.1)
    return view


async def test_a_volunteer_whose_model_file_is_gone_withdraws_its_range_and_says_why(
        mesh: list[Served], peers: Peers, tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    seed, *volunteers = mesh
    ids = {n.node_id for n in volunteers}

    def serving(view: StatusReply) -> dict[str, list[str]]:
        return {m.node_id: m.served for m in view.members if m.node_id in ids}

    # both volunteers serve (the whole model fits each: one stage, and a replica)
    view = await until(peers, seed, lambda v: len(serving(v)) == 2 and all(serving(v).values())
                       and all(c.covered_layers == c.n_layers for c in v.coverage) and v.coverage)
    victim = next(n for n in volunteers if serving(view)[n.node_id])
    path = tmp_path / ("a" if victim is volunteers[0] else "b") / "tiny.gguf"
    (worker,) = workers(victim)
    n_layers, name = view.coverage[0].n_layers, view.coverage[0].name
    path.unlink()
    os.kill(worker, signal.SIGKILL)

    # one line says why, at ERROR, once the restarts have failed
    line = re.compile(rf"ERROR meshd\.daemon: layers \[0, {n_layers}\) of {re.escape(name)} withdrawn: the engine "
                      rf"worker failed to start (\d+) times in a row: model file not found: {re.escape(str(path))}$",
                      re.MULTILINE)
    assert victim.log is not None
    with trio.fail_after(60):
        while not (found := line.search(victim.log.read_text())):
            await trio.sleep(0.1)
    assert int(found.group(1)) == EngineSupervisor.give_up_after
    assert victim.log.read_text().count(" withdrawn: ") == 1

    # its signed record offers, holds and carries no range of the model: the seed sees it so
    def withdrawn(v: StatusReply) -> bool:
        member = next((m for m in v.members if m.node_id == victim.node_id), None)
        return member is not None and member.state == "alive" and not member.served and not member.models

    await until(peers, seed, withdrawn)

    # asked to open a session anyway, it says so: not "overloaded, restarting", and not to be retried
    control = await peers.open_stream(victim.address, STAGE_PROTOCOL, node_id=victim.node_id)
    async with control:
        await control.send_message(Open(session=new_session_id(), epoch=0, layer_begin=0, layer_end=n_layers))
        err = await typed_error(control)
    assert err.code is ErrorCode.NOT_FOUND and not err.retryable, err
    assert f"layers [0, {n_layers}) of {name} are withdrawn here: the engine worker failed to start" in err.message
    assert str(path) not in err.message  # the local path is for the log alone

    # the tracker routes the model over the other volunteer, and its answer is the whole model's
    other = next(n for n in volunteers if n is not victim)
    with trio.fail_after(60):
        while True:
            route = await mesh_rpc(peers, seed.address, RouteRequest(model=view.coverage[0].model), timeout=20.0)
            assert isinstance(route, RouteReply)
            if [s.node_id for s in route.stages] == [other.node_id]:
                break
            await trio.sleep(0.2)

    async def find(excluded: list[str]) -> list[Stage]:
        return route_from_reply(route)

    with trio.fail_after(60):
        result = await ask_with_failover(peers, find, AskRequest(messages=[{"role": "user", "content": PROMPT}],
                                                                  max_tokens=TOKENS))
    expected = greedy_reference(tiny_models["llama-gqa-untied"], [PROMPT], TOKENS)[PROMPT]
    assert result.tokens == expected
