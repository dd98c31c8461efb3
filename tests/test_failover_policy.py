"""The asker's failover policy with fake sessions and fake probes: whom it blames, how many it routes
around at once, its budget of attempts and time, where it asks for routes when the tracker is gone,
the route answer's exclusions before SWIM has declared anyone dead, and what `meshd ask` says after."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import pytest
import trio
from test_mesh_duty import MODEL, Mesh, duty

from meshd.cli.figures import figures_line
from meshd.client import ask, failover
from meshd.client import route as routes
from meshd.client.ask import AskRequest, AskResult, StageError
from meshd.client.failover import FAILOVER_ATTEMPTS, FAILOVER_SECONDS, ask_with_failover, blamed
from meshd.client.route import RouteSources, Stage, route_from_reply
from meshd.client.verifier import Verifier
from meshd.mesh.duty import MeshDuty
from wire.errors import ErrorCode, ProtocolError
from wire.meshrpc import MAX_REPLICAS_PER_STAGE
from wire.stage import StageInfo

# Three ranges served twice: node "a0" and "a1" serve [0, 10), "b0" and "b1" [10, 20), "c0" and "c1" [20, 30).
REPLICAS = {name: Stage(f"10.0.0.{i}:7000", name, "sha256:m", ((ord(name[0]) - 97) * 10, (ord(name[0]) - 96) * 10))
            for i, name in enumerate(["a0", "a1", "b0", "b1", "c0", "c1"], start=1)}


def fake_tracker(asked: list[list[str]]) -> routes.RouteFinder:
    """A fake route source: the first replica of each range that is not excluded."""
    async def find(excluded: list[str]) -> list[Stage]:
        asked.append(list(excluded))
        route = []
        for r in "abc":
            options = [s for name, s in REPLICAS.items() if name[0] == r and name not in excluded]
            if not options:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"no route: nothing serves range {r}")
            route.append(options[0])
        return route
    return find


class FakeMesh:
    """Fake sessions and probes: a session fails at its first stage that is in `dead` (raising from
    the stage after it, as a neighbour of a dead stage reports), else yields `tokens` new tokens."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, dead: set[str], tokens: int = 4) -> None:
        self.dead = dead
        self.tokens = tokens
        self.routes: list[list[str | None]] = []
        self.probes = 0
        self.kill_between: list[set[str]] = []
        monkeypatch.setattr(failover, "run_session", self.run_session)
        monkeypatch.setattr(failover, "_probe", self.probe)

    async def run_session(self, peers: object, route: Sequence[Stage], request: AskRequest, result: AskResult,
                          on_token: ask.OnToken, session: str, epoch: int, stall_timeout: float,
                          verifier: object = None) -> AskResult:
        self.routes.append([s.node_id for s in route])
        result.epochs += 1
        await trio.sleep(1.0)
        for i, stage in enumerate(route):
            if stage.node_id in self.dead:
                raise StageError(min(i + 1, len(route) - 1),
                                 ProtocolError(ErrorCode.UNREACHABLE, f"stage {stage.address} is unreachable"))
        while len(result.tokens) < self.tokens:
            result.tokens.append(len(result.tokens))
            await on_token(result.tokens[-1], b"x")  # type: ignore[misc]
            if self.kill_between:
                self.dead |= self.kill_between.pop(0)
                raise StageError(0, ProtocolError(ErrorCode.UNREACHABLE, "lost the stream"))
        result.reason = "length"
        return result

    async def probe(self, peers: object, route: Sequence[Stage]) -> list[bool]:
        self.probes += 1
        return [s.node_id not in self.dead for s in route]


async def test_one_replica_of_every_range_dead_at_once_costs_one_failover(
        monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeMesh(monkeypatch, dead={"a0", "b0", "c0"})
    asked: list[list[str]] = []
    with caplog.at_level(logging.INFO, "meshd.client.failover"):
        result = await ask_with_failover(None, fake_tracker(asked), AskRequest())  # type: ignore[arg-type]
    # lost: from the last progress (the start) through the failed epoch's 1 s and the next one's 1 s (fake clock)
    assert "answered after 1 failover(s) around 3 stage(s), 2.0 s lost" in caplog.text
    assert result.tokens == [0, 1, 2, 3] and result.reason == "length"
    assert asked == [[], ["a0", "b0", "c0"]]
    assert fake.routes[-1] == ["a1", "b1", "c1"]
    assert result.failovers == 1 and result.excluded == ["a0", "b0", "c0"]


async def test_stages_dying_one_after_another_are_each_routed_around_and_the_time_counted(
        monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock) -> None:
    fake = FakeMesh(monkeypatch, dead=set(), tokens=6)
    fake.kill_between = [{"b0"}, {"c0"}]
    result = await ask_with_failover(None, fake_tracker([]), AskRequest())  # type: ignore[arg-type]
    assert result.tokens == list(range(6))
    assert fake.routes == [["a0", "b0", "c0"], ["a0", "b1", "c0"], ["a0", "b1", "c1"]]
    assert result.failovers == 2 and result.excluded == ["b0", "c0"]
    # each fake epoch spends 1 s (on the mock clock) before its first token
    assert result.failover_seconds == pytest.approx(2.0)


async def test_a_stage_error_naming_its_culprit_excludes_it_without_probing(
        monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock) -> None:
    fake = FakeMesh(monkeypatch, dead=set())

    class FakeLied(StageError):
        culprit = "b0"

    calls = 0

    async def session(peers: object, route: Sequence[Stage], request: AskRequest, result: AskResult,
                      on_token: ask.OnToken, session: str, epoch: int, stall_timeout: float,
                          verifier: object = None) -> AskResult:
        nonlocal calls
        calls += 1
        if calls == 1:
            # the tail reports it, but the proof names the middle stage
            raise FakeLied(2, ProtocolError(ErrorCode.BAD_REQUEST, "the hop's input hash does not match"))
        return await fake.run_session(peers, route, request, result, on_token, session, epoch, stall_timeout)

    monkeypatch.setattr(failover, "run_session", session)
    result = await ask_with_failover(None, fake_tracker([]), AskRequest())  # type: ignore[arg-type]
    assert fake.probes == 0 and result.excluded == ["b0"] and fake.routes == [["a0", "b1", "c0"]]


def stalling_at(node: str, fake: FakeMesh, monkeypatch: pytest.MonkeyPatch,
                error: Callable[[Sequence[Stage]], BaseException]) -> None:
    """Sessions on a route through `node` stall for their whole stall timeout, then raise `error(route)`;
    the rest run on `fake`."""
    async def session(peers: object, route: Sequence[Stage], request: AskRequest, result: AskResult,
                      on_token: ask.OnToken, session: str, epoch: int, stall_timeout: float,
                      verifier: object = None) -> AskResult:
        if node in [s.node_id for s in route]:
            fake.routes.append([s.node_id for s in route])
            await trio.sleep(stall_timeout)
            raise error(route)
        return await fake.run_session(peers, route, request, result, on_token, session, epoch, stall_timeout)

    monkeypatch.setattr(failover, "run_session", session)


async def test_a_middle_stage_that_stalls_but_answers_probes_is_blamed_on_the_second_stall(
        monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock) -> None:
    fake = FakeMesh(monkeypatch, dead=set())
    # the tail waits for rows that never come: it is the one whose stream times out
    stalling_at("b0", fake, monkeypatch, lambda route: StageError(
        len(route) - 1, ProtocolError(ErrorCode.DEADLINE_EXCEEDED, "the stage stalled")))
    result = await ask_with_failover(None, fake_tracker([]), AskRequest())  # type: ignore[arg-type]
    # the honest tail first; then the stages both stalled routes share, the staller among them
    assert fake.routes == [["a0", "b0", "c0"], ["a0", "b0", "c1"], ["a1", "b1", "c1"]]
    assert result.excluded == ["c0", "a0", "b0"] and result.failovers == 2 and result.tokens == [0, 1, 2, 3]


async def test_a_stall_at_opening_is_retried_once_and_then_blames_the_whole_route(
        monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock) -> None:
    fake = FakeMesh(monkeypatch, dead=set())
    stalling_at("b0", fake, monkeypatch, lambda route: trio.TooSlowError())
    result = await ask_with_failover(None, fake_tracker([]), AskRequest())  # type: ignore[arg-type]
    assert fake.routes == [["a0", "b0", "c0"], ["a0", "b0", "c0"], ["a1", "b1", "c1"]]
    assert result.excluded == ["a0", "b0", "c0"] and result.failovers == 2


async def test_with_every_stage_alive_the_reporter_is_blamed_and_a_stall_at_opening_blames_nobody() -> None:
    route = list(REPLICAS.values())[::2]
    assert blamed(route, [True, False, False], 0) == ["b0", "c0"]
    assert blamed(route, [True, True, True], 1) == ["b0"]
    assert blamed(route, [True, True, True], None) == []
    assert blamed(route, [True, True, True], 2, suspects={"a0", "b0", "x"}) == ["a0", "b0"]
    assert blamed(route, [True, False, True], 2, suspects={"a0"}) == ["b0"]
    # a route given by addresses names no node to exclude
    assert blamed([Stage("10.0.0.9:7000")], [False], 0) == []


async def test_failover_gives_up_after_its_attempts(
        monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock) -> None:
    # more dead replicas than attempts: each epoch finds one more
    many = {f"b{i}": Stage(f"10.0.1.{i}:7000", f"b{i}", "sha256:m", (10, 20)) for i in range(2, 12)}
    monkeypatch.setattr("test_failover_policy.REPLICAS", REPLICAS | many)
    fake = FakeMesh(monkeypatch, dead=set())

    async def probe(peers: object, route: Sequence[Stage]) -> list[bool]:
        fake.probes += 1
        return [False if s.layers == (10, 20) else True for s in route]

    async def session(peers: object, route: Sequence[Stage], request: AskRequest, result: AskResult,
                      on_token: ask.OnToken, session: str, epoch: int, stall_timeout: float,
                          verifier: object = None) -> AskResult:
        fake.routes.append([s.node_id for s in route])
        raise StageError(1, ProtocolError(ErrorCode.UNREACHABLE, "gone"))

    monkeypatch.setattr(failover, "run_session", session)
    monkeypatch.setattr(failover, "_probe", probe)
    with pytest.raises(StageError, match="gone"):
        await ask_with_failover(None, fake_tracker([]), AskRequest())  # type: ignore[arg-type]
    assert len(fake.routes) == FAILOVER_ATTEMPTS


async def test_failover_gives_up_past_its_time_budget(
        monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock) -> None:
    fake = FakeMesh(monkeypatch, dead=set())

    async def session(peers: object, route: Sequence[Stage], request: AskRequest, result: AskResult,
                      on_token: ask.OnToken, session: str, epoch: int, stall_timeout: float,
                          verifier: object = None) -> AskResult:
        fake.routes.append([s.node_id for s in route])
        # every epoch stalls for the whole stall timeout, and each is blamed on a fresh node
        await trio.sleep(stall_timeout)
        raise StageError(0, ProtocolError(ErrorCode.DEADLINE_EXCEEDED, "the stage stalled"))

    names = iter(range(100))

    async def find(excluded: list[str]) -> list[Stage]:
        return [Stage(f"10.0.2.1:{7000 + (n := next(names))}", f"n{n}", "sha256:m", (0, 30))]

    async def probe(peers: object, route: Sequence[Stage]) -> list[bool]:
        return [True] * len(route)

    monkeypatch.setattr(failover, "run_session", session)
    monkeypatch.setattr(failover, "_probe", probe)
    began = trio.current_time()
    with pytest.raises(StageError, match="stalled"):
        await ask_with_failover(None, find, AskRequest(), stall_timeout=30.0)  # type: ignore[arg-type]
    # epochs at 30, 60, 90 s fail; the one failing at 120 s is past 30 + 60 s after the last progress (0 s)
    assert len(fake.routes) == 4 < FAILOVER_ATTEMPTS
    assert trio.current_time() - began == pytest.approx(30.0 * 4)
    assert FAILOVER_SECONDS == 60.0


async def test_a_non_retryable_error_is_not_failed_over(
        monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock) -> None:
    fake = FakeMesh(monkeypatch, dead=set())

    async def session(*args: object) -> AskResult:
        raise StageError(0, ProtocolError(ErrorCode.BAD_REQUEST, "the prompt is too long"))

    monkeypatch.setattr(failover, "run_session", session)
    with pytest.raises(StageError, match="too long"):
        await ask_with_failover(None, fake_tracker([]), AskRequest())  # type: ignore[arg-type]
    assert fake.probes == 0


async def test_a_stage_busy_for_a_moment_is_waited_for_a_few_times_then_routed_around(
        monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock) -> None:
    fake = FakeMesh(monkeypatch, dead=set())
    honest = fake.run_session
    # b0 refuses sessions as busy (its one slot taken by the tracker's probe, say) once more than the asker
    # waits for it: each refusal but the last costs a wait on the same route, the last routes around it
    busy = {"b0": failover.BUSY_TRIES + 1}

    async def session(peers: object, route: Sequence[Stage], *args: object) -> AskResult:
        for i, stage in enumerate(route):
            if busy.get(stage.node_id or "", 0):
                busy[stage.node_id or ""] -= 1
                fake.routes.append([s.node_id for s in route])
                raise StageError(i, ProtocolError(ErrorCode.OVERLOADED, "all 1 session slots are busy",
                                                  retry_after_ms=60_000))
        return await honest(peers, route, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(failover, "run_session", session)
    t0 = trio.current_time()
    result = await ask_with_failover(None, fake_tracker([]), AskRequest())  # type: ignore[arg-type]
    assert fake.routes == [["a0", "b0", "c0"]] * (failover.BUSY_TRIES + 1) + [["a0", "b1", "c0"]]
    assert result.excluded == ["b0"] and len(result.tokens) == 4
    # its word (60 s) is bounded by the asker's own, doubling
    assert trio.current_time() - t0 < failover.BUSY_WAIT * (2 ** failover.BUSY_TRIES - 1) + 3


async def test_with_the_tracker_unreachable_the_route_is_asked_of_the_members_it_named(
        autojump_clock: trio.abc.Clock) -> None:
    tracker_up = True
    asked_members: list[tuple[str | None, list[str]]] = []
    tracker = fake_tracker([])
    tracker_asked = 0

    async def first(excluded: list[str]) -> list[Stage]:
        nonlocal tracker_asked
        tracker_asked += 1
        if not tracker_up:
            raise ProtocolError(ErrorCode.UNREACHABLE, "connection refused")
        return await tracker(excluded)

    async def ask_member(member: Stage, excluded: list[str]) -> list[Stage]:
        asked_members.append((member.node_id, excluded))
        if member.node_id == "b0":
            raise ProtocolError(ErrorCode.DEADLINE_EXCEEDED, "no answer")
        return await tracker(excluded)

    sources = RouteSources(first, ask_member)
    assert [s.node_id for s in await sources([])] == ["a0", "b0", "c0"]
    tracker_up = False
    # a0 is excluded (it died), b0 cannot be reached, so c0 answers
    route = await sources(["a0"])
    assert [s.node_id for s in route] == ["a1", "b0", "c0"]
    assert asked_members == [("b0", ["a0"]), ("c0", ["a0"])]
    # once down, the tracker is not asked again (each ask would cost its timeout)
    await sources(["a0"])
    assert tracker_asked == 2 and asked_members[-1] == ("c0", ["a0"])


async def test_a_route_source_that_answers_is_believed_even_when_it_has_no_route() -> None:
    async def first(excluded: list[str]) -> list[Stage]:
        raise ProtocolError(ErrorCode.NOT_FOUND, "no route covers all 30 layers")

    async def ask_member(member: Stage, excluded: list[str]) -> list[Stage]:
        raise AssertionError("asked a member although the route source answered")

    sources = RouteSources(first, ask_member)
    sources.members["a0"] = REPLICAS["a0"]
    with pytest.raises(ProtocolError, match="no route covers"):
        await sources([])


def test_the_members_a_route_source_learns_are_bounded() -> None:
    sources = RouteSources(fake_tracker([]), fake_tracker([]))  # type: ignore[arg-type]
    route = [Stage(f"10.0.3.{i % 250}:{7000 + i}", f"{i:064x}", None, (i, i + 1)) for i in range(256)]
    sources._learn(route)
    assert len(sources.members) == routes.MAX_ROUTE_SOURCES


def six_members() -> tuple[list[MeshDuty], MeshDuty, Mesh]:
    """Six members of 400 bytes each (every range served twice or more), their tracker and their
    simulated mesh, converged."""
    duties = [duty(i, memory=400) for i in range(6)]
    mesh = Mesh(*duties)
    mesh.run_until(20.0)
    return duties, mesh.tracker, mesh


def dial(record: object) -> str:
    return "10.0.0.1:7400"


def test_the_trackers_route_honours_exclusions_of_members_swim_still_calls_alive() -> None:
    duties, tracker, _ = six_members()
    first = tracker.route(MODEL.digest, (), dial)
    used = [s.node_id for s in first.stages]
    alive = {r.node_id for r in tracker.node.membership.live_records()}
    assert set(used) <= alive
    # every stage of the route is excluded at once, all of them still alive to SWIM
    second = tracker.route(MODEL.digest, used, dial)
    assert not set(used) & {s.node_id for s in second.stages}
    assert [(s.start, s.end) for s in second.stages][-1][1] == MODEL.n_layers
    everyone = [d.node_id for d in duties]
    with pytest.raises(ProtocolError, match="excluded") as refused:
        tracker.route(MODEL.digest, everyone, dial)
    assert refused.value.code is ErrorCode.NOT_FOUND


def test_a_failover_keeps_the_range_it_replaces_on_the_numerics_it_was_computed_with() -> None:
    duties, tracker, mesh = six_members()
    route = tracker.route(MODEL.digest, (), dial)
    stage = route.stages[-1]
    # where the tail goes when its member is routed around, with every member of one numerics
    cheapest = tracker.route(MODEL.digest, [stage.node_id], dial).stages[-1]
    same = next(d for d in duties if d.node_id not in (stage.node_id, cheapest.node_id) and any(
        (sr.start, sr.end) == (stage.start, stage.end) for sr in d.node.record.served))
    assert cheapest.node_id != stage.node_id and (cheapest.start, cheapest.end) == (stage.start, stage.end)
    by_id = {d.node_id: d for d in duties}
    for d in duties:
        d.node.update_record(mesh.net.now, numerics="build-a/x86_64/gpu" if d.node_id == cheapest.node_id
                             else "build-a/x86_64/cpu")
    mesh.run_until(mesh.net.now + 5.0)
    # the cheapest computes other last bits than the routed-around tail: one of the tail's own numerics is taken
    moved = tracker.route(MODEL.digest, [stage.node_id], dial).stages[-1]
    assert moved.node_id == same.node_id and by_id[moved.node_id].node.record.numerics == "build-a/x86_64/cpu"
    # none of its numerics left: the cheapest of any
    assert tracker.route(MODEL.digest, [stage.node_id, same.node_id], dial).stages[-1].node_id == cheapest.node_id


async def test_the_trackers_route_names_each_stages_replicas_and_the_verifier_asks_no_more() -> None:
    duties, tracker, mesh = six_members()
    reply = tracker.route(MODEL.digest, (), dial)
    on_route = {s.node_id for s in reply.stages}
    assert reply.replicas is not None
    served = {(rec.node_id, sr.start, sr.end) for rec in tracker.node.membership.live_records() for sr in rec.served}
    for stage in reply.stages:
        mine = [r for r in reply.replicas if (r.start, r.end) == (stage.start, stage.end)]
        # other members on exactly this range, none of the route's own, at most two
        assert 1 <= len(mine) <= MAX_REPLICAS_PER_STAGE
        assert all(r.node_id not in on_route and (r.node_id, r.start, r.end) in served for r in mine)
    # an excluded member is nobody's replica
    avoided = reply.replicas[0].node_id
    assert avoided not in {r.node_id for r in tracker.route(MODEL.digest, [avoided], dial).replicas or []}

    async def no_route_requests(excluded: list[str]) -> list[Stage]:
        raise AssertionError("the route named its replicas: no request before the first token")

    # a member of other numerics (another build or backend) is a stage's replica after those of its own, named
    # with its numerics: the asker compares its sketches within a tolerance (wire.sketch), not its bytes
    stage = reply.stages[0]
    duties_by_id = {d.node_id: d for d in duties}
    first = [r for r in reply.replicas if (r.start, r.end) == (stage.start, stage.end)][0]
    duties_by_id[stage.node_id].node.update_record(mesh.net.now, numerics="build-a/x86_64/cpu")
    duties_by_id[first.node_id].node.update_record(mesh.net.now, numerics="build-a/x86_64/gpu")
    mesh.run_until(mesh.net.now + 5.0)
    again = tracker.route(MODEL.digest, (), dial)
    assert again.stages[0].node_id == stage.node_id and again.replicas is not None
    mine = [r for r in again.replicas if (r.start, r.end) == (stage.start, stage.end)]
    assert mine[-1].node_id == first.node_id and mine[-1].numerics == "build-a/x86_64/gpu"
    assert all(r.numerics == "" for r in mine[:-1])
    # the same at the tail, whose tokens the asker compares
    tail = again.stages[-1]
    other = [r for r in again.replicas if (r.start, r.end) == (tail.start, tail.end)][0]
    duties_by_id[tail.node_id].node.update_record(mesh.net.now, numerics="build-a/x86_64/cpu")
    duties_by_id[other.node_id].node.update_record(mesh.net.now, numerics="build-a/x86_64/gpu")
    mesh.run_until(mesh.net.now + 5.0)
    third = tracker.route(MODEL.digest, (), dial)
    assert third.stages[-1].node_id == tail.node_id and third.replicas is not None
    named = {r.node_id: r.numerics for r in third.replicas if (r.start, r.end) == (tail.start, tail.end)}
    assert named[other.node_id] == "build-a/x86_64/gpu"
    assert route_from_reply(third)[-1].replicas is not None
    assert {r.node_id: r.numerics for r in route_from_reply(third)[-1].replicas or ()} == named

    route = route_from_reply(reply)
    verifier = Verifier(None, find_route=no_route_requests)  # type: ignore[arg-type]
    await verifier.prepare(route, [])
    assert {c.node_id for c in verifier.plan.candidates} == {r.node_id for r in reply.replicas}
    # a node this ask routed around checks nothing
    await verifier.prepare(route, [avoided])
    assert avoided not in {c.node_id for c in verifier.plan.candidates}


def test_a_failover_onto_other_numerics_is_said_where_it_happened() -> None:
    def info(numerics: str) -> StageInfo:
        return StageInfo(node_id="a" * 40, model_digest="ab" * 32, model_name="m", layer_begin=0, layer_end=30,
                         n_layer=30, stage_width=8, ready=True, numerics=numerics)

    result = AskResult(prompt_tokens=[1, 2], tokens=[3, 4, 5], reason="eog", started=0.0, first_token_at=0.1,
                       finished_at=0.5, route=[info("build-a/x86_64/cpu")])
    # the same numerics, a first epoch, or a new route that took over no token: nothing to say
    for before, carried in ((frozenset({"build-a/x86_64/cpu"}), 3), (frozenset(), 3), (frozenset({"x"}), 0)):
        failover._crossed(result, before, carried)
    assert result.crossed_numerics_at == [] and "numerics" not in figures_line(result)
    failover._crossed(result, frozenset({"build-a/x86_64/gpu"}), 3)
    assert result.crossed_numerics_at == [3]
    assert ", continued on other numerics after 3 tokens (one engine build and backend throughout may answer " \
           "otherwise)" in figures_line(result)
    result.restart()
    assert result.crossed_numerics_at == []


def test_the_figures_line_says_when_and_at_what_cost_the_answer_failed_over() -> None:
    result = AskResult(prompt_tokens=[1, 2, 3], tokens=[4, 5, 6], reason="length", started=0.0,
                       first_token_at=0.25, finished_at=1.25)
    assert "failed over" not in figures_line(result)
    result.failovers, result.failover_seconds, result.excluded = 2, 3.04, ["a0", "b0", "c0"]
    line = figures_line(result)
    assert line == ("[3 prompt tokens, 3 new tokens, first token 250 ms, 2.0 tokens/s, failed over 2 times "
                    "(3 stages routed around, 3.0 s lost), stopped by length]")
    result.failovers, result.excluded = 1, ["b0"]
    assert "failed over 1 time (1 stage routed around, 3.0 s lost)" in figures_line(result)
    silent = AskResult(prompt_tokens=[1], reason="stop", failovers=1, failover_seconds=0.5, excluded=["a0"])
    assert figures_line(silent) == "[1 prompt token, no new tokens, failed over 1 time (1 stage routed around, " \
                                   "0.5 s lost), stopped by stop]"


async def test_an_answer_given_again_gives_the_client_only_what_it_does_not_hold() -> None:
    got: list[int] = []

    def client(token: int, piece: bytes) -> None:
        got.append(token)

    async def answer(result: AskResult, tokens: Sequence[int]) -> None:
        for token in tokens:
            result.tokens.append(token)
            result.pieces.append(b"%d " % token)
            await ask.give(result, client, token, result.pieces[-1])

    result = AskResult()
    await answer(result, [5, 6, 7])
    # a stage stalled on its receipts: the answer starts again, and comes out the same (an honest stall
    # changes no token): the client holds the first three and is given only what follows
    result.restart()
    await answer(result, [5, 6, 7, 8])
    assert got == [5, 6, 7, 8] and result.withdrawn == 0 and result.held == [5, 6, 7, 8]
    # a lie caught: the answer given again differs at its third token, so what the client holds is
    # withdrawn and the new answer given whole
    result.restart()
    await answer(result, [5, 6, 9])
    assert got == [5, 6, 7, 8, 5, 6, 9] and result.withdrawn == 4 and result.held == [5, 6, 9]
    # the answer given again ends before the text the client holds does: that text is withdrawn too
    result.restart()
    await answer(result, [5, 6])
    await ask.withdraw_past_end(result, client)
    assert got[-2:] == [5, 6] and result.withdrawn == 7 and result.held == [5, 6]
