"""The console's state endpoint against a fake daemon view: what it shows, and what a hostile member cannot do to it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing
from api_fakes import FakeMesh as StatusOnlyMesh  # the front door's fake: a status view and canned asks
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.testclient import TestClient

from meshd.client.ask import AskResult
from meshd.front import console
from meshd.front.app import build_app
from meshd.front.console import Console, console_routes
from meshd.front.door import Asking, FrontDoor
from meshd.mesh.election import Tracker
from meshd.mesh.membership import MemberInfo, MemberState
from meshd.mesh.records import CapabilityRecord, ModelInfo, ServedRange
from meshd.mesh.routing import SpeedBook
from meshd.mesh.status import stage_speeds, status_view
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.meshrpc import RouteReply, RouteStage, SpeedsReply, StatusReply
from wire.stage import StageInfo

MODEL = ModelInfo(digest="ab" * 32, name="SmolLM2-135M", n_layers=30, bytes_per_layer=1 << 20, kv_bytes_per_token=64)
REASON = "memory needed 190 MiB (weights + KV) against 2 × 64 MiB offered (62 MiB short)"


@dataclass
class FakeMesh:
    """A fake daemon view (`console.MeshSource`): real signed records, states, figures and routes the
    test sets. `figures[node]` is what that member's stage reports; a member missing from it fails."""

    members_: list[MemberInfo] = field(default_factory=list)
    tracker: Tracker | None = None
    figures: dict[str, dict[str, float]] = field(default_factory=dict)
    hang: set[str] = field(default_factory=set)
    route_error: str = ""
    route_hangs: bool = False
    polls: list[str] = field(default_factory=list)
    routes_asked: list[str] = field(default_factory=list)
    # what the tracker timed of each member's stage (the rest count at the default)
    timed: SpeedBook = field(default_factory=SpeedBook)

    def add(self, served: list[tuple[int, int]], state: MemberState = MemberState.ALIVE, leaving: bool = False,
            rtt: float | None = 0.002, address: str = "127.0.0.1:7001", name: str = MODEL.name) -> str:
        identity = NodeIdentity.generate()
        record = CapabilityRecord.create(
            identity, 1, addresses=[address], reachability="public", memory_bytes=64 << 20,
            models=[MODEL.model_copy(update={"name": name})], leaving=leaving, seconds_per_layer=0.0005,
            served=[ServedRange(model=MODEL.digest, start=a, end=b) for a, b in served])
        self.members_.append(MemberInfo(identity.node_id, state, 1, record, rtt))
        return identity.node_id

    def status(self) -> StatusReply:
        live = [m.record for m in self.members_ if m.state in (MemberState.ALIVE, MemberState.SUSPECT)]
        return status_view(self.members_[0].node_id, self.members_, live, self.tracker,
                           reason_of=lambda info: REASON)

    def members(self) -> list[MemberInfo]:
        return list(self.members_)

    async def route(self, model: str) -> RouteReply:
        self.routes_asked.append(model)
        if self.route_hangs:
            await trio.sleep_forever()
        if self.route_error:
            raise ProtocolError(ErrorCode.NOT_FOUND, self.route_error)
        stages = [RouteStage(node_id=m.node_id, address=m.record.addresses[0], start=s.start, end=s.end)
                  for m in self.members_ for s in m.record.served][:3]
        return RouteReply(model=model, n_layers=MODEL.n_layers, stages=stages, seconds_per_token=0.015)

    async def stage_speeds(self) -> SpeedsReply | None:
        if self.tracker is None:
            return None
        live = [m.record for m in self.members_ if m.state in (MemberState.ALIVE, MemberState.SUSPECT)]
        return SpeedsReply(by=self.tracker.node_id, speeds=stage_speeds(live, self.timed, self.tracker.node_id))

    async def stage_metrics(self, node_id: str) -> dict[str, float]:
        self.polls.append(node_id)
        if node_id in self.hang:
            await trio.sleep_forever()
        if node_id not in self.figures:
            raise ProtocolError(ErrorCode.UNREACHABLE, "gone")
        return self.figures[node_id]


def three_stages() -> tuple[FakeMesh, list[str]]:
    mesh = FakeMesh()
    ids = [mesh.add([(0, 10)]), mesh.add([(10, 20)]), mesh.add([(20, 30)]), mesh.add([(0, 15)])]
    mesh.tracker = Tracker(term=3, node_id=ids[1])
    return mesh, ids


def by_node(state: dict, node_id: str) -> dict:
    return next(m for m in state["members"] if m["node_id"] == node_id)


async def test_a_covered_model_shows_its_members_layers_replicas_and_route(autojump_clock: trio.testing.MockClock) -> None:
    mesh, ids = three_stages()
    mesh.figures = {ids[0]: {"sessions": 2.0, "kv_tokens": 300.0, "decode_rows": 10.0, "step_ms_p50": 4.5}}
    mesh.timed.observe(ids[0], 10, 4e-3)
    state = await Console(mesh).state()
    json.dumps(state, allow_nan=False)
    assert (state["node_id"], state["tracker"], state["term"]) == (ids[0], ids[1], 3)
    assert [m["node_id"] for m in state["members"]] == ids
    head = by_node(state, ids[0])
    assert (head["address"], head["state"], head["memory_bytes"]) == ("127.0.0.1:7001", "alive", 64 << 20)
    assert head["served"] == [{"model": MODEL.digest, "start": 0, "end": 10}]
    # what routes count: the tracker timed it at 0.4 ms a layer (it says 0.5 itself)
    assert head["rtt_ms"] == pytest.approx(2.0) and head["ms_per_layer"] == pytest.approx(0.4)
    assert head["stage"]["sessions"] == 2.0 and head["stage"]["kv_tokens"] == 300.0
    assert "tracker" in by_node(state, ids[1])["roles"]
    # the members whose stages could not say show no figures, and the snapshot is not held up
    assert by_node(state, ids[2])["stage"] is None

    [model] = state["models"]
    assert (model["name"], model["n_layers"], model["covered_layers"], model["covered"]) == (MODEL.name, 30, 30, True)
    assert model["depth"] == [2] * 10 + [2] * 5 + [1] * 15 and model["replicas"] == 0
    assert sorted((r["start"], r["end"]) for r in model["ranges"]) == [(0, 10), (0, 15), (10, 20), (20, 30)]
    assert model["why"] == []
    assert [(s["start"], s["end"]) for s in model["route"]["stages"]] == [(0, 10), (10, 20), (20, 30)]


async def test_each_range_shows_the_speed_routes_count_and_where_it_came_from(
        autojump_clock: trio.testing.MockClock) -> None:
    mesh, ids = three_stages()
    mesh.timed.observe(ids[0], 10, 4e-3)
    mesh.timed.observe(ids[0], 10, 6e-3)
    [model] = (await Console(mesh).state())["models"]
    speeds = {(r["node_id"], r["start"]): r["speed"] for r in model["ranges"]}
    assert speeds[ids[0], 0] == {"ms_per_layer": pytest.approx(0.5), "source": "probe",
                                 "from": "probe by tracker, median of 2; it says 0.5"}
    # not timed: the default (1 ms a layer), never the 0.5 it says of itself
    assert speeds[ids[2], 20] == {"ms_per_layer": pytest.approx(1.0), "source": "default",
                                  "from": "unmeasured: default; it says 0.5"}
    # the tracker's own stage: its own figure
    assert speeds[ids[1], 10]["source"] == "own"
    # a member the tracker timed far slower than it says shows the time, on its row and its range
    liar = mesh.add([(0, 30)])
    mesh.timed.observe(liar, 30, 3.0)
    state = await Console(mesh).state()
    row = by_node(state, liar)
    assert row["ms_per_layer"] == pytest.approx(100.0) and row["speed_from"].startswith("probe by tracker")
    # a source that knows no speeds (a mesh of fakes, no tracker) shows none
    mesh.tracker = None
    state = await Console(mesh).state()
    assert by_node(state, ids[0])["ms_per_layer"] is None
    assert all(r["speed"] is None for r in state["models"][0]["ranges"])


async def test_live_tok_s_is_the_growth_of_each_stage_decode_counter(autojump_clock: trio.testing.MockClock) -> None:
    mesh, ids = three_stages()
    mesh.figures = {ids[0]: {"decode_rows": 100.0}, ids[1]: {"decode_rows": 40.0}}
    view = Console(mesh)
    first = await view.state()
    assert by_node(first, ids[0])["stage"]["tok_s"] == 0.0  # one reading gives no rate
    await trio.sleep(2.0)
    mesh.figures = {ids[0]: {"decode_rows": 150.0}, ids[1]: {"decode_rows": 3.0}}
    second = await view.state()
    assert by_node(second, ids[0])["stage"]["tok_s"] == pytest.approx(25.0)
    # a counter that went back (its worker restarted) is a new start, not a negative rate
    assert by_node(second, ids[1])["stage"]["tok_s"] == 0.0


async def test_a_model_that_lost_a_volunteer_says_not_covered_and_why(autojump_clock: trio.testing.MockClock) -> None:
    mesh = FakeMesh()
    head, middle = mesh.add([(0, 10)]), mesh.add([(10, 20)], state=MemberState.LEFT, leaving=True)
    mesh.add([(20, 30)])
    state = await Console(mesh).state()
    [model] = state["models"]
    assert model["covered"] is False and model["covered_layers"] == 20
    assert model["depth"] == [1] * 10 + [0] * 10 + [1] * 10
    assert model["why"][0] == REASON
    assert f"unreachable: {middle[:12]} (left) served layers [10, 20)" in model["why"]
    assert model["route"] is None and mesh.routes_asked == []
    assert {r["node_id"]: r["state"] for r in model["ranges"]}[middle] == "left"
    assert middle not in mesh.polls and head in mesh.polls


async def test_a_covered_model_without_a_route_says_why(autojump_clock: trio.testing.MockClock) -> None:
    mesh, _ = three_stages()
    mesh.route_error = "no route for SmolLM2-135M: the tail is unreachable"
    [model] = (await Console(mesh).state())["models"]
    assert model["route"] is None and model["route_error"] == mesh.route_error


async def test_a_tracker_that_never_plans_costs_one_timeout_not_the_snapshot(
        autojump_clock: trio.testing.MockClock) -> None:
    mesh, ids = three_stages()
    mesh.route_hangs = True
    mesh.figures = {ids[0]: {"sessions": 1.0}}
    start = trio.current_time()
    state = await Console(mesh).state()
    assert trio.current_time() - start <= 2 * console.METRICS_TIMEOUT + 0.01
    [model] = state["models"]
    assert model["route"] is None and model["route_error"] == "no route was planned in time"
    assert by_node(state, ids[0])["stage"]["sessions"] == 1.0


class TwoPlans:
    """A fake daemon whose own records plan one route and whose tracker plans another."""

    def __init__(self, planned: RouteReply) -> None:
        self.planned = planned

    def route(self, model: str | None, exclude: list[str] | None = None) -> RouteReply:
        raise AssertionError("the console asked for this node's own plan, not the tracker's")

    async def planned_route(self, model: str | None, exclude: list[str] | None = None) -> RouteReply:
        return self.planned


async def test_the_console_shows_the_route_the_tracker_plans_for_an_ask() -> None:
    """What an ask through this member gets (meshd.front.mesh.DaemonMember.route): the tracker's plan."""
    planned = RouteReply(model=MODEL.digest, n_layers=30, seconds_per_token=0.02, stages=[
        RouteStage(node_id="a" * 40, address="10.0.0.4:7000", start=0, end=15),
        RouteStage(node_id="b" * 40, address="10.0.0.3:7000", start=15, end=30)])
    source = console.DaemonSource(TwoPlans(planned))  # type: ignore[arg-type]
    assert await source.route(MODEL.digest) is planned


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0, 1e300, True])
async def test_a_member_s_unbelievable_figures_are_dropped(bad: float, autojump_clock: trio.testing.MockClock) -> None:
    mesh, ids = three_stages()
    mesh.figures = {ids[0]: {"sessions": bad, "kv_tokens": bad, "decode_rows": bad, "step_ms_p50": bad}}
    liar = mesh.add([(25, 40), (31, 32)])  # layers the model does not have
    state = await Console(mesh).state()
    json.dumps(state, allow_nan=False)
    [model] = state["models"]
    clipped = {"node_id": liar, "start": 25, "end": 30, "state": "alive"}
    assert len(model["depth"]) == 30 and any(r.items() >= clipped.items() for r in model["ranges"])
    assert all(r["start"] < r["end"] <= 30 for r in model["ranges"])
    stage = by_node(state, ids[0])["stage"]
    assert (stage["sessions"], stage["kv_tokens"], stage["step_ms_p50"], stage["tok_s"]) == (None, None, None, 0.0)


async def test_a_member_that_never_answers_costs_one_timeout_not_the_snapshot(
        autojump_clock: trio.testing.MockClock) -> None:
    mesh, ids = three_stages()
    mesh.hang = {ids[1], ids[2]}
    mesh.figures = {ids[0]: {"sessions": 1.0}}
    start = trio.current_time()
    state = await Console(mesh).state()
    assert trio.current_time() - start <= 2 * console.METRICS_TIMEOUT + 0.01
    assert by_node(state, ids[0])["stage"]["sessions"] == 1.0
    assert by_node(state, ids[1])["stage"] is None and by_node(state, ids[2])["stage"] is None


async def test_viewers_share_one_snapshot_and_a_big_mesh_is_polled_within_bounds(
        autojump_clock: trio.testing.MockClock) -> None:
    mesh = FakeMesh()
    for i in range(100):
        mesh.add([(i % 30, i % 30 + 1)], address=f"10.0.0.{i}:7000")
    view = Console(mesh)
    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(view.state)
    assert len(mesh.polls) == console.MAX_POLLED
    await trio.sleep(console.REFRESH)
    await view.state()
    assert len(mesh.polls) == 2 * console.MAX_POLLED


HOSTILE = "<img src=x onerror=alert(1)>"


def app(mesh: FakeMesh, guard: console.Guard | None = None) -> Starlette:
    return Starlette(routes=console_routes(Console(mesh), guard))


def test_the_page_its_assets_and_the_state_are_served_from_the_package() -> None:
    mesh, ids = three_stages()
    with TestClient(app(mesh), backend="trio") as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        # only the package's own script runs: a name a member chose cannot become a script
        assert "script-src 'self'" in page.headers["content-security-policy"]
        for asset, kind in (("console.js", "javascript"), ("console.css", "text/css")):
            assert asset in page.text
            got = client.get(f"/console/static/{asset}")
            assert got.status_code == 200 and kind in got.headers["content-type"]
        assert client.get("/console/static/../console.py").status_code == 404
        state = client.get("/console/state")
        assert state.status_code == 200 and state.headers["cache-control"] == "no-store"
        assert [m["node_id"] for m in state.json()["members"]] == ids


def test_a_member_s_markup_reaches_the_page_as_json_text_only() -> None:
    mesh = FakeMesh()
    mesh.add([(0, 30)], name=HOSTILE)
    with TestClient(app(mesh), backend="trio") as client:
        assert client.get("/console/state").json()["models"][0]["name"] == HOSTILE
    script = (console.files("meshd.front") / "static" / "console.js").read_text()
    # the page builds its DOM from text nodes: nothing a member names is parsed as HTML
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script and "document.write" not in script


def test_on_the_front_door_the_state_wants_its_api_key_and_shows_its_asks_in_flight() -> None:
    mesh, ids = three_stages()
    front = FrontDoor(mesh, api_keys=["right"])  # type: ignore[arg-type]  # the fake has no ask: none is made
    result = AskResult(prompt_tokens=[1, 2, 3], tokens=[7, 8], epochs=1, route=[
        StageInfo(node_id=ids[0], model_digest=MODEL.digest, model_name=MODEL.name, layer_begin=0, layer_end=10,
                  n_layer=30, stage_width=576, ready=True)])
    front.asking[5] = Asking(5, MODEL.digest, "openai", True, 0.0, result)
    with TestClient(build_app(front), backend="trio") as client:
        assert client.get("/").status_code == 200
        refused = client.get("/console/state")
        assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"]
        assert mesh.polls == []
        for headers in ({"Authorization": "Bearer right"}, {"x-api-key": "right"}):
            got = client.get("/console/state", headers=headers)
            assert got.status_code == 200
        [ask] = got.json()["asks"]
        assert (ask["id"], ask["dialect"], ask["prompt_tokens"], ask["tokens"], ask["epochs"]) == (5, "openai", 3, 2, 1)
        assert ask["route"] == [{"node_id": ids[0], "start": 0, "end": 10}]


def test_the_guard_refuses_the_state_but_not_the_page() -> None:
    def guard(request: Request) -> Response | None:
        if request.headers.get("authorization") == "Bearer right":
            return None
        return JSONResponse({"error": {"message": "bad key"}}, status_code=401)

    mesh, _ = three_stages()
    with TestClient(app(mesh, guard), backend="trio") as client:
        assert client.get("/").status_code == 200
        assert client.get("/console/state").status_code == 401
        assert mesh.polls == []
        assert client.get("/console/state", headers={"Authorization": "Bearer right"}).status_code == 200


def test_a_front_door_whose_mesh_only_has_a_status_view_still_shows_it() -> None:
    with TestClient(build_app(FrontDoor(StatusOnlyMesh())), backend="trio") as client:
        state = client.get("/console/state").json()
    [model] = state["models"]
    assert (model["name"], model["covered"], model["route"]) == ("Fake Model", True, None)
    assert model["route_error"] == "this front door's mesh plans no routes"
