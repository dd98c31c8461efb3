"""The daemon's mesh driving loop and duties on 200 nodes over a virtual network, in trio virtual time.

Each simulated node runs the daemon's own `MeshDriver` around its own `MeshDuty`
(membership, election, the tracker's placement and the volunteer's asks), in its
own trio task; a virtual network delivers messages after a random latency, drops
some, can be cut in two, and carries the assignment asks as request/reply calls.
trio's MockClock jumps over idle time, so minutes of protocol time take seconds.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from collections.abc import Callable
from typing import TypeVar

import pytest
import trio
import trio.testing

from meshd.daemon.driver import MeshDriver
from meshd.mesh.duty import MeshDuty
from meshd.mesh.duty_events import AskAssignment, DutyConfig, DutyEvent, LoadRange
from meshd.mesh.membership import MemberEvent, MemberState, Ping, SwimMessage
from meshd.mesh.node import MeshNode
from meshd.mesh.records import CapabilityRecord, ModelInfo
from meshd.mesh.routing import plan_route, stage_options
from wire.errors import ProtocolError
from wire.identity import NodeIdentity
from wire.meshrpc import AssignmentReply

N = 200
# The loss and partition runs cost time in proportion to the nodes; half the mesh still shows them
# (thousands of probes under loss, a side of 50 electing its own tracker) at half the suite's time.
N_HALF = N // 2
PROBE_PERIOD = 1.0  # SwimConfig().probe_interval
# Deliveries fall on a 5 ms grid, so one trio wakeup delivers many messages: trio's per-wakeup
# work, not the protocol, is most of what simulating costs.
TICK = 0.005
RPC_TIMEOUT = 5.0  # NodeConfig().rpc_timeout
LOAD_SECONDS = 0.5  # what loading a range takes a volunteer here
R = TypeVar("R")


def on_grid(t: float) -> float:
    """The first grid point at or after t (never before it, whatever the rounding)."""
    tick = math.ceil(t / TICK)
    return tick * TICK if tick * TICK >= t else (tick + 1) * TICK


class VirtualNetwork:
    """Delivers each message after a random latency, drops some, and can be cut; nodes can die.

    trio runs ready tasks in a random order on purpose; drawing each sender's losses and
    latencies from its own generator, and ordering ties by sender, keeps a run reproducible.
    """

    def __init__(self, seed: int, latency: tuple[float, float] = (0.001, 0.010), loss: float = 0.0):
        self._seed = seed
        self._rngs: dict[str, random.Random] = {}
        self._latency = latency
        self.loss = loss
        # (src, dest) -> True when the link is cut
        self.cut: Callable[[str, str], bool] | None = None
        self.down: set[str] = set()
        self._queue: list[tuple[float, str, int, Callable[[], None]]] = []
        self._sent: dict[str, int] = {}
        self._drivers: dict[str, MeshDriver] = {}
        self._wakeup: trio.CancelScope | None = None

    def attach(self, node_id: str, driver: MeshDriver) -> None:
        self._drivers[node_id] = driver
        self._rngs[node_id] = random.Random(f"{self._seed}-{node_id}")
        self._sent[node_id] = 0

    def reachable(self, src: str, dest: str) -> bool:
        return dest in self._drivers and src not in self.down and dest not in self.down \
            and not (self.cut and self.cut(src, dest))

    def send(self, src: str, dest: str, message: SwimMessage) -> None:
        if self._rngs[src].random() < self.loss or not self.reachable(src, dest):
            return
        driver = self._drivers[dest]
        self.later(src, self._rngs[src].uniform(*self._latency), lambda: self._deliver(driver, dest, src, message))

    def _deliver(self, driver: MeshDriver, dest: str, src: str, message: SwimMessage) -> None:
        if dest not in self.down:
            driver.deliver(src, message)

    def call(self, src: str, dest: str, request: Callable[[], R], reply: Callable[[R | None], None]) -> None:
        """A request/reply over a reliable stream: answered one round trip later, or None after
        RPC_TIMEOUT when either end is cut off or dead."""
        if not self.reachable(src, dest):
            self.later(src, RPC_TIMEOUT, lambda: reply(None))
            return
        rng = self._rngs[src]
        there, back = rng.uniform(*self._latency), rng.uniform(*self._latency)

        def at_dest() -> None:
            if not self.reachable(src, dest):
                self.later(src, RPC_TIMEOUT - there, lambda: reply(None))
                return
            answer = request()
            self.later(src, back, lambda: reply(answer if src not in self.down else None))

        self.later(src, there, at_dest)

    def later(self, src: str, delay: float, action: Callable[[], None]) -> None:
        self._sent[src] += 1
        at = on_grid(trio.current_time() + delay)
        heapq.heappush(self._queue, (at, src, self._sent[src], action))
        if self._wakeup is not None and at < self._wakeup.deadline:
            self._wakeup.deadline = at

    async def run(self) -> None:
        while True:
            with trio.CancelScope(deadline=self._queue[0][0] if self._queue else math.inf) as self._wakeup:
                await trio.sleep_forever()
            self._wakeup = None
            now = trio.current_time()
            while self._queue and self._queue[0][0] <= now:
                _, _, _, action = heapq.heappop(self._queue)
                action()


MODEL = ModelInfo(
    digest="sha256:demo", name="demo", n_layers=32, bytes_per_layer=200_000_000, kv_bytes_per_token=4096
)


class Mesh:
    """Simulated nodes, each the daemon's own `MeshDriver` around its own `MeshDuty`: the tracker
    places the model, volunteers ask it for their ranges over the virtual network, "load" them
    (after LOAD_SECONDS) and publish them, exactly as daemons do."""

    def __init__(self, seed: int, loss: float = 0.0):
        self.seed = seed
        self.rng = random.Random(seed)
        self.network = VirtualNetwork(seed, loss=loss)
        self.ids: list[str] = []
        self.nodes: dict[str, MeshNode] = {}
        self.duties: dict[str, MeshDuty] = {}
        self.drivers: dict[str, MeshDriver] = {}
        self._scopes: dict[str, trio.CancelScope] = {}
        self.dead_declared: list[tuple[str, str, float]] = []
        self.loads = 0
        self._nursery: trio.Nursery | None = None

    async def start(self, nursery: trio.Nursery, n: int, stagger: float = 0.01) -> None:
        self._nursery = nursery
        nursery.start_soon(self.network.run)
        for _ in range(n):
            self.add()
            await trio.sleep(stagger)

    def add(self, memory_gib: int | None = None) -> str:
        """A new node; every one but the first joins through node 0, the seed."""
        assert self._nursery is not None
        i = len(self.ids)
        identity = NodeIdentity.from_private_bytes(hashlib.sha256(b"sim-%d-%d" % (self.seed, i)).digest())
        now = trio.current_time()
        record = CapabilityRecord.create(
            identity,
            version=1,
            addresses=[f"10.0.{i // 256}.{i % 256}:7400"],
            reachability="public",
            memory_bytes=(memory_gib or self.rng.choice([4, 8, 16])) << 30,
            seconds_per_layer=self.rng.uniform(0.0005, 0.004),
            models=[MODEL],
            started_at=now,
        )
        node = MeshNode(identity, record, now, rng=random.Random(self.rng.random()))
        node_id = node.node_id
        duty = MeshDuty(node, DutyConfig(volunteer=MODEL))
        driver = MeshDriver(duty, lambda dest, message: self.network.send(node_id, dest, message),
                            lambda event: self._on_event(duty, driver, event), inbox=math.inf)
        self.network.attach(node_id, driver)
        if self.ids:
            node.join(now, [self.ids[0]])
        self.ids.append(node_id)
        self.nodes[node_id], self.duties[node_id], self.drivers[node_id] = node, duty, driver
        scope = self._scopes[node_id] = trio.CancelScope()
        self._nursery.start_soon(self._run, scope, driver)
        return node_id

    @staticmethod
    async def _run(scope: trio.CancelScope, driver: MeshDriver) -> None:
        with scope:
            await driver.run()

    def kill(self, node_id: str) -> None:
        """The node stops dead: no goodbye, nothing more sent or received."""
        self.network.down.add(node_id)
        self._scopes[node_id].cancel()

    def _on_event(self, duty: MeshDuty, driver: MeshDriver, event: DutyEvent) -> None:
        node_id = duty.node_id
        if isinstance(event, MemberEvent) and event.kind == "dead":
            self.dead_declared.append((node_id, event.node_id, trio.current_time()))
        elif isinstance(event, AskAssignment):
            tracker = self.duties[event.tracker.node_id]

            def answer() -> AssignmentReply | None:
                try:
                    return tracker.assignment_for(node_id)
                except ProtocolError:
                    return None

            def replied(reply: AssignmentReply | None) -> None:
                duty.assignment_reply(trio.current_time(), reply)
                driver.poke()

            self.network.call(node_id, tracker.node_id, answer, replied)
        elif isinstance(event, LoadRange):
            self.loads += 1

            def loaded() -> None:
                if node_id not in self.network.down:
                    duty.range_loaded(trio.current_time(), event.start, event.end)
                    driver.poke()

            self.network.later(node_id, LOAD_SECONDS, loaded)

    @property
    def alive(self) -> list[str]:
        return [node_id for node_id in self.ids if node_id not in self.network.down]

    def converged(self, group: list[str]) -> bool:
        """Every node of `group` sees exactly the group, alive, at their current records, and
        follows the same tracker, which is in the group."""
        members = set(group)
        tracker = self.nodes[group[0]].tracker
        if tracker is None or tracker.node_id not in members:
            return False
        # The cheap checks on everyone first: most calls fail here.
        if any(
            self.nodes[node_id].tracker != tracker
            or self.nodes[node_id].membership.live_count() != len(group)
            for node_id in group
        ):
            return False
        for node_id in group:
            membership = self.nodes[node_id].membership
            for other in group:
                if membership.state(other) is not MemberState.ALIVE:
                    return False
                held = membership.record_of(other)
                if held is None or held.version != self.nodes[other].record.version:
                    return False
        return True

    def served_as_assigned(self, group: list[str]) -> bool:
        """The group's tracker placed the model on members of the group only, every member that
        can hold a range has one, and each serves (and says it serves) exactly its range."""
        tracker = self.nodes[group[0]].tracker
        if tracker is None:
            return False
        placed = self.duties[tracker.node_id].assignments.get(MODEL.digest)
        if placed is None:
            return False
        ranges = placed.ranges()
        if not set(ranges) <= set(group):
            return False
        for node_id in group:
            want = ranges.get(node_id)
            served = self.nodes[node_id].record.served
            if want is None:
                # only a node too small to pair up with anyone for a whole copy may be left out
                if self.nodes[node_id].record.memory_bytes > 4 << 30:
                    return False
            elif [(s.model, s.start, s.end) for s in served] != [(MODEL.digest, *want)]:
                return False
        return True

    def claimants(self, group: list[str] | None = None) -> list[str]:
        return [node_id for node_id in group or self.alive if self.nodes[node_id].record.tracker_term > 0]

    async def wait_for(self, what: Callable[[], bool], limit: float, why: str) -> float:
        """Virtual seconds until `what()` holds; fails after `limit`."""
        start = trio.current_time()
        while not what():
            assert trio.current_time() - start < limit, f"{why}: not after {limit} s"
            await trio.sleep(PROBE_PERIOD)
        return trio.current_time() - start

    async def wait_converged(self, group: list[str], limit: float) -> float:
        return await self.wait_for(lambda: self.converged(group), limit, "not converged")

    async def wait_served(self, group: list[str], limit: float) -> float:
        """Until the group converged on records that serve the model as its tracker placed it."""
        return await self.wait_for(lambda: self.served_as_assigned(group) and self.converged(group), limit,
                                   "not served as assigned")

    def routes_everywhere(self, askers: list[str]) -> None:
        for asker in askers:
            view = self.nodes[asker].membership.live_records()
            route = plan_route(stage_options(view, MODEL.digest), MODEL.n_layers, asker=asker)
            assert route.stages[0].start == 0 and route.stages[-1].end == MODEL.n_layers
            assert set(route.node_ids) <= set(self.alive)


@pytest.mark.slow
async def test_200_nodes_converge_and_the_tracker_duty_serves_the_model_through_joins_and_deaths(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mesh = Mesh(seed=1)
    async with trio.open_nursery() as nursery:
        await mesh.start(nursery, N)
        # Counted from the last node's start; the bound is in probe periods.
        elapsed = await mesh.wait_converged(mesh.ids, limit=20 * PROBE_PERIOD)
        print(f"\n{N} nodes converged {elapsed / PROBE_PERIOD:.1f} probe periods after the last joined")
        assert len(mesh.claimants()) == 1
        assert not mesh.dead_declared

        # Nobody places anything by hand: the tracker's duty does, the volunteers ask and load.
        served = await mesh.wait_served(mesh.ids, limit=20 * PROBE_PERIOD)
        print(f"served as the tracker placed it {served / PROBE_PERIOD:.1f} probe periods later")
        tracker = mesh.duties[mesh.nodes[mesh.ids[0]].tracker.node_id]
        before = tracker.assignments[MODEL.digest]
        # Everyone serves, but for a small node that found no partner to share a whole copy with.
        assert len(before.stages) >= N - 1
        mesh.routes_everywhere(mesh.ids[::40])

        # Ten members die (hosts of the fastest chain first, never the tracker nor node 0, the seed the
        # joiners dial: the tracker is elected by observed uptime and node id, so it need not be node 0)
        # and ten join.
        spared = {tracker.node_id, mesh.ids[0]}
        victims = [s.node_id for s in before.chain if s.node_id not in spared]
        victims += [node_id for node_id in mesh.ids if node_id not in victims and node_id not in spared]
        for node_id in victims[:10]:
            mesh.kill(node_id)
        joiners = [mesh.add(memory_gib=8) for _ in range(10)]
        await mesh.wait_served(mesh.alive, limit=60 * PROBE_PERIOD)
        after = tracker.assignments[MODEL.digest]
        assert set(joiners) <= set(after.ranges()) and not set(victims[:10]) & set(after.ranges())
        assert {d for _, d, _ in mesh.dead_declared} == set(victims[:10])
        mesh.routes_everywhere(mesh.alive[::40])
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_no_live_node_declared_dead_with_5_percent_loss(autojump_clock: trio.testing.MockClock) -> None:
    mesh = Mesh(seed=2, loss=0.05)
    async with trio.open_nursery() as nursery:
        await mesh.start(nursery, N_HALF)
        elapsed = await mesh.wait_converged(mesh.ids, limit=30 * PROBE_PERIOD)
        await trio.sleep(60 * PROBE_PERIOD)
        refutations = sum(node.membership.refutations for node in mesh.nodes.values())
        print(
            f"\nwith 5% loss: converged after {elapsed:.1f} s; {refutations} suspicions refuted in 60 more s"
        )
        assert mesh.dead_declared == []
        tracker = mesh.nodes[mesh.ids[0]].tracker
        assert all(
            node.membership.live_count() == N_HALF and node.tracker == tracker for node in mesh.nodes.values()
        )
        assert mesh.served_as_assigned(mesh.ids)
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_partition_gives_one_tracker_per_side_and_healing_leaves_one_serving_the_model(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mesh = Mesh(seed=3)
    async with trio.open_nursery() as nursery:
        await mesh.start(nursery, N_HALF)
        await mesh.wait_served(mesh.ids, limit=30 * PROBE_PERIOD)
        left, right = mesh.ids[: N_HALF // 2], mesh.ids[N_HALF // 2 :]
        side = {node_id: node_id in set(left) for node_id in mesh.ids}
        mesh.network.cut = lambda src, dest: side[src] != side[dest]
        cut_at = trio.current_time()
        # Each side elects its own tracker, which places the model on its side alone.
        await mesh.wait_served(left, limit=90)
        await mesh.wait_served(right, limit=90)
        split = trio.current_time() - cut_at
        trackers = {mesh.nodes[left[0]].tracker, mesh.nodes[right[0]].tracker}
        assert len(trackers) == 2
        assert sorted(side[node_id] for node_id in mesh.claimants()) == [False, True]

        mesh.network.cut = None
        healed = await mesh.wait_served(mesh.ids, limit=90)
        print(f"\npartition: sides served after {split:.0f} s; healed mesh served after {healed:.0f} s")
        assert len(mesh.claimants()) == 1
        # Each side's tracker has half the votes of the healed mesh, a majority of none: a new
        # election carries one of them (or another) at a new term.
        healed_tracker = mesh.nodes[mesh.ids[0]].tracker
        assert healed_tracker is not None and healed_tracker.term > max(trackers).term
        mesh.routes_everywhere(mesh.ids[::40])
        nursery.cancel_scope.cancel()


async def test_leave_returns_once_the_goodbye_went_round_and_nobody_declares_the_leaver_dead(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mesh = Mesh(seed=4)
    async with trio.open_nursery() as nursery:
        await mesh.start(nursery, 8)
        await mesh.wait_served(mesh.ids, limit=30 * PROBE_PERIOD)
        leaver = mesh.ids[3]
        started = trio.current_time()
        with trio.fail_after(5):
            await mesh.drivers[leaver].leave()
        took = trio.current_time() - started
        assert mesh.duties[leaver].left_announced
        # the daemon's deadline on leaving (NodeConfig.leave_timeout) is not what ended it
        assert took < 2.0
        # what it sent is still passed on after it stopped: within a few gossip rounds all know
        rest = [node_id for node_id in mesh.ids if node_id != leaver]
        await mesh.wait_for(lambda: all(mesh.nodes[n].membership.state(leaver) is MemberState.LEFT for n in rest),
                            limit=2 * PROBE_PERIOD, why="the goodbye did not spread")
        # the tracker placed the model without it, and the rest serve that
        await mesh.wait_served(rest, limit=10 * PROBE_PERIOD)
        await trio.sleep(30 * PROBE_PERIOD)
        assert mesh.dead_declared == []
        nursery.cancel_scope.cancel()


async def test_a_lone_node_leaves_at_once(autojump_clock: trio.testing.MockClock) -> None:
    mesh = Mesh(seed=5)
    async with trio.open_nursery() as nursery:
        await mesh.start(nursery, 1)
        with trio.fail_after(0.01):
            await mesh.drivers[mesh.ids[0]].leave()
        nursery.cancel_scope.cancel()


async def test_a_flood_of_swim_messages_is_dropped_at_the_bound_not_queued(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A peer sending faster than the state machine takes messages costs at most `inbox` of them."""
    identity = NodeIdentity.from_private_bytes(hashlib.sha256(b"flooded").digest())
    node = MeshNode(identity, CapabilityRecord.create(identity, 1), trio.current_time())
    taken: list[str] = []

    class Counting(MeshDuty):
        def handle_message(self, now: float, src: str, message: SwimMessage) -> None:
            taken.append(src)
            super().handle_message(now, src, message)

    driver = MeshDriver(Counting(node), lambda dest, message: None, lambda event: None, inbox=8)
    flooder = NodeIdentity.from_private_bytes(hashlib.sha256(b"flooder").digest()).node_id
    for seq in range(1000):
        driver.deliver(flooder, Ping(seq=seq, version=1))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(driver.run)
        await trio.testing.wait_all_tasks_blocked()
        assert len(taken) == 8
        driver.deliver(flooder, Ping(seq=1000, version=1))
        await trio.testing.wait_all_tasks_blocked()
        assert len(taken) == 9
        nursery.cancel_scope.cancel()
