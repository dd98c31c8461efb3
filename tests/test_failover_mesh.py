"""Failover under several failures, against real `meshd join` daemons on loopback: a seed and six
volunteers of a tiny model, every one of its three ranges served twice.

A rack losing power is every process of one replica of each range SIGKILLed at once while an
answer streams; the asker must route around all of them in one failover and give the whole
model's answer. Then the tracker dies too: the asker asks a member it knows for the route.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from localmesh import READY, Served, mesh_status, meshd_command, spawn, stop_all, stop_process

from meshd.client.ask import AskRequest, AskResult
from meshd.client.failover import ask_with_failover
from meshd.client.route import RouteSources, Stage, route_from_reply
from meshd.net.peers import Peers
from meshd.net.rpc import mesh_rpc
from tests.conftest import greedy_reference
from wire.meshrpc import RouteReply, RouteRequest

pytestmark = pytest.mark.slow  # seven daemons and six engine workers

PROMPT = "Tell me about lighthouses."
TOKENS = 40
# The tiny model with f32 weights: its re-prefill after a failover is bit-identical to decoding token by
# token (with the f16-weight tiny model it is not: a near tie of its random logits flips some 30 tokens on).
MODEL = "llama-gqa-untied"
# Its six layers take 210 KiB each with the KV of 2 x 256 tokens: 560 KiB holds two layers and the head
# (or the tail), not three, so the model needs three stages and six volunteers serve each range twice.
VOLUNTEER = ["--memory", "560K", "--threads", "1", "--max-sessions", "2", "--session-tokens", "256"]


def start_joins(argvs: list[list[str]], logs: Path, timeout: float = 90.0) -> list[Served]:
    """`meshd join` processes started together (each imports and loads while the others do),
    returned once every one printed its ready line; all stopped if any does not."""
    started: list[tuple[subprocess.Popen[str], Path]] = []
    try:
        for i, argv in enumerate(argvs):
            log = logs / f"join{i}.log"
            with log.open("w") as out:
                proc = spawn(meshd_command("join", "--listen", "127.0.0.1:0", *argv), stdout=out,
                             stderr=subprocess.STDOUT, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
            started.append((proc, log))
        served: list[Served] = []
        deadline = time.monotonic() + timeout
        for proc, log in started:
            while True:
                match = next((m for m in map(READY.match, log.read_text().splitlines()) if m), None)
                if match is not None:
                    served.append(Served(proc, match.group(1), 0, node_id=match.group(3), log=log))
                    break
                assert proc.poll() is None and time.monotonic() < deadline, \
                    f"meshd join did not become ready:\n{log.read_text()}"
                time.sleep(0.05)
        return served
    except BaseException:
        for proc, _ in started:
            stop_process(proc)
        raise


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> Path:
    return tiny_models[MODEL]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[list[Served]]:
    base = tmp_path_factory.mktemp("failover-mesh")
    nodes: list[Served] = []
    try:
        nodes += start_joins([["--no-model", "--state-dir", str(base / "seed")]], base)
        nodes += start_joins([["--seed", nodes[0].address, "--state-dir", str(base / f"v{i}"), "--model", str(model),
                               *VOLUNTEER] for i in range(6)], base)
        yield nodes
    finally:
        stop_all(nodes)


@pytest.fixture(scope="module")
def expected(model: Path) -> list[int]:
    tokens = greedy_reference(model, [PROMPT], TOKENS)[PROMPT]
    assert len(tokens) == TOKENS, "the reference answer ends early: the kill would come after it"
    return tokens


async def wait_every_range_twice(peers: Peers, seed: Served, volunteers: list[Served]) -> dict[str, str]:
    """Waits until each volunteer serves a range of its own and every range has two replicas;
    returns each volunteer's range by node id."""
    ranges: dict[str, str] = {}
    with trio.fail_after(120):
        while True:
            view = await mesh_status(peers, seed)
            ranges = {m.node_id: s.split(" ", 1)[1] for m in view.members if m.state == "alive"
                      for s in m.served}
            counts = Counter(ranges.values())
            if set(ranges) == {v.node_id for v in volunteers} and len(counts) == 3 and set(counts.values()) == {2}:
                return ranges
            await trio.sleep(0.5)


def sources(peers: Peers, first: Served) -> RouteSources:
    """`meshd ask --seed`'s route finding: the seed first, then the members its routes named."""
    async def ask(address: str, node_id: str | None, excluded: list[str]) -> list[Stage]:
        reply = await mesh_rpc(peers, address, RouteRequest(exclude=excluded), node_id, timeout=10.0)
        assert isinstance(reply, RouteReply)
        return route_from_reply(reply)

    async def find(excluded: list[str]) -> list[Stage]:
        return await ask(first.address, first.node_id, excluded)

    async def ask_member(member: Stage, excluded: list[str]) -> list[Stage]:
        return await ask(member.address, member.node_id, excluded)

    return RouteSources(find, ask_member)


def power_off(node: Served) -> None:
    """The daemon and its engine worker die at once, as in a rack losing power."""
    os.killpg(node.proc.pid, signal.SIGKILL)
    node.proc.wait(timeout=10)


async def test_a_rack_losing_power_mid_answer_one_replica_of_every_range_still_gives_the_whole_models_answer(
        mesh: list[Served], peers: Peers, expected: list[int]) -> None:
    seed, volunteers = mesh[0], mesh[1:]
    t0 = time.perf_counter()
    await wait_every_range_twice(peers, seed, volunteers)
    print(f"every range served twice {time.perf_counter() - t0:.1f} s after the last volunteer was ready")
    find = sources(peers, seed)
    result = AskResult()
    victims: list[Served] = []
    got: list[int] = []

    def on_token(token: int, piece: bytes) -> None:
        got.append(token)
        # at the first token: the tail tells a session's first token at once and holds the ones after it
        # for up to STREAM_INTERVAL (50 ms), in which the tiny model's ring decodes most of the answer.
        # The stages killed are the ones this ask's route took (a route asked for a moment before may name
        # other replicas: a CI run killed part of the ask's route, and the next route then met the rest)
        if len(got) == 1:
            victims.extend(next(v for v in volunteers if v.node_id == info.node_id) for info in result.route)
            for victim in victims:
                power_off(victim)

    t0 = time.perf_counter()
    await ask_with_failover(peers, find, AskRequest(messages=[{"role": "user", "content": PROMPT}],
                                                    max_tokens=TOKENS), on_token, stall_timeout=10.0, result=result)
    assert len(victims) == 3 and all(v.proc.poll() is not None for v in victims), "the route's stages were never killed"
    assert result.tokens == expected
    # all three found dead by one round of probes: one failover, not one per stage
    assert result.failovers == 1 and set(result.excluded) == {v.node_id for v in victims}
    assert not {v.node_id for v in victims} & {info.node_id for info in result.route}
    print(f"{len(result.tokens)} tokens in {time.perf_counter() - t0:.2f} s; the route's three stages killed "
          f"after the first: {result.failovers} failover over {result.epochs} epochs, {result.failover_seconds:.2f} s lost")


async def test_with_the_tracker_dead_too_the_asker_asks_a_member_it_knows_for_the_route(
        mesh: list[Served], peers: Peers, expected: list[int]) -> None:
    seed = mesh[0]
    alive = [v for v in mesh[1:] if v.proc.poll() is None]
    assert len(alive) == 3, "runs after the rack test, on the replicas it left"
    find = sources(peers, seed)
    request = AskRequest(messages=[{"role": "user", "content": PROMPT}], max_tokens=TOKENS)
    before = await ask_with_failover(peers, find, request, stall_timeout=10.0)
    assert before.tokens == expected
    power_off(seed)
    t0 = time.perf_counter()
    after = await ask_with_failover(peers, find, request, stall_timeout=10.0)
    assert find.first_down and after.tokens == expected
    assert {info.node_id for info in after.route} == {v.node_id for v in alive}
    print(f"seed (the tracker) killed: the next answer came through a member in {time.perf_counter() - t0:.2f} s")
