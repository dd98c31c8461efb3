"""Credit where people look (issue 33, part 5): the console's column per member and /metrics' gauge,
from the daemon's ledger (a source that keeps no ledger shows none); each API key's usage on /metrics."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import trio
import trio.testing
from api_fakes import NAME
from api_fakes import FakeMesh as FakeFront
from prometheus_client import generate_latest
from test_api_front import USER, claude, oai
from test_console_state import FakeMesh, three_stages

from meshd.front.connections import Connections
from meshd.front.console import Console, CreditSource
from meshd.front.door import FrontDoor, key_label, load_api_keys
from meshd.front.metrics import Figures


@dataclass
class CreditMesh(FakeMesh):
    """The console's fake daemon view, with a ledger's balances."""

    balances: dict[str, float] = field(default_factory=dict)

    def credits(self) -> dict[str, float]:
        return dict(self.balances)


async def test_each_member_shows_its_credit_and_metrics_export_it(autojump_clock: trio.testing.MockClock) -> None:
    plain, ids = three_stages()
    mesh = CreditMesh(members_=plain.members_, tracker=plain.tracker)
    mesh.balances = {ids[0]: 2400.0, ids[1]: -300.0}
    assert isinstance(mesh, CreditSource)
    state = await Console(mesh).state()
    assert [m["credit"] for m in state["members"]] == [2400.0, -300.0, 0.0, 0.0]
    scraped = generate_latest(Figures(state, 0, Connections())).decode()
    assert f'meshd_member_credit{{node="{ids[0]}"}} 2400.0' in scraped
    assert f'meshd_member_credit{{node="{ids[1]}"}} -300.0' in scraped


async def test_a_source_without_a_ledger_shows_no_credit(autojump_clock: trio.testing.MockClock) -> None:
    mesh, _ = three_stages()
    state = await Console(mesh).state()
    assert {m["credit"] for m in state["members"]} == {None}
    assert "meshd_member_credit{" not in generate_latest(Figures(state, 0, Connections())).decode()


async def test_each_api_key_s_usage_is_its_own_on_metrics(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("first-key\nsecond-key\n")
    front = FrontDoor(FakeFront(), load_api_keys(keys))
    for _ in range(2):
        assert (await oai(front, "first-key").chat.completions.create(model=NAME, messages=USER)).choices
    assert (await claude(front, "second-key").messages.create(model=NAME, max_tokens=5, messages=USER)).content
    scraped = generate_latest(front.metrics.registry).decode()
    usage = {(key, kind): float(v) for key, kind, v in
             re.findall(r'meshd_api_key_tokens_total\{key="([^"]+)",kind="(\w+)"\} (\S+)', scraped)}
    first, second = key_label("first-key"), key_label("second-key")
    assert {key for key, _ in usage} == {first, second} and "first-key" not in scraped
    assert usage[(first, "completion")] == 2 * usage[(second, "completion")] > 0
