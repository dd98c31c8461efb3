"""Credit where people look (issue 33, part 5): the console's column per member and /metrics' gauge,
from the daemon's ledger; a source that keeps no ledger shows none."""

from __future__ import annotations

from dataclasses import dataclass, field

import trio
import trio.testing
from prometheus_client import generate_latest
from test_console_state import FakeMesh, three_stages

from meshd.front.connections import Connections
from meshd.front.console import Console, CreditSource
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
